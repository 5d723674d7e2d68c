"""The machine and versions a benchmark ran on, for its JSON report."""

import os
import platform
from importlib import metadata


def machine_info():
    """CPU model and count, memory, platform, and the stack's versions."""
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
            "memory_gib": round(mem_kb / 2**20, 1), "platform": platform.platform(),
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
