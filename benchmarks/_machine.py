"""The machine and versions a benchmark ran on, for its JSON report."""

import os
import platform
from importlib import metadata


def transparent_hugepages():
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`),
    or None where it cannot be read. It moves results: with `always`, a
    static table of a GB is mapped in 2 MB pages and its random row reads
    miss the TLB far less (measured ~1.5x faster gathers from 26 x 64 MB
    arrays on the peer benchmark's machine)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def machine_info():
    """CPU model and count, memory, transparent huge pages, platform, and the
    stack's versions."""
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    versions = {name: metadata.version(name)
                for name in ("tensorflow-cpu", "keras", "numpy", "pyarrow")}
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "cpus_available": len(os.sched_getaffinity(0)),
            "memory_gib": round(mem_kb / 2**20, 1),
            "transparent_hugepages": transparent_hugepages(), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions}


def write_json_report(path, report):
    """Writes a benchmark's JSON report to `path` and says so."""
    import json

    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def median_range(values):
    """{"median", "min", "max"} of a list of per-round figures (ratios)."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
