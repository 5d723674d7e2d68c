"""benchmarks/storage.py's file-tier floor: the probe's measurements and the
floor's arithmetic (never its times)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH / "peers"))
sys.path.insert(0, str(BENCH))
_spec = importlib.util.spec_from_file_location("bench_storage", BENCH / "storage.py")
storage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(storage)


def test_file_probe_reads_and_appends_and_cleans_up(tmp_path):
    rates = storage.file_floor(str(tmp_path), rows=4096, rec_bytes=132, misses=700.4,
                               threads=2, repeats=2)
    assert rates["rows"] == 4096 and rates["rec_bytes"] == 132 and rates["threads"] == 2
    assert rates["reads"] == 700  # rounded to whole records
    preads = [rates[k] for k in ("pread_0_per_s", "pread_1k_per_s", "pread_4k_per_s",
                                 "pread_16k_per_s")]
    assert all(r > 0 for r in preads) and rates["pread_best_per_s"] == max(preads)
    assert rates["map_per_s"] > 0 and rates["append_per_s"] > 0
    # Only the compiled probe is left in the folder: its files are removed.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file_probe"]


def test_file_probe_rejects_bad_arguments(tmp_path):
    exe = storage.build_probe(tmp_path, "file_probe")
    for args in (["10", "132", "5", "1", "1"],          # too few rows
                 ["4096", "132", "4000", "1", "1"],     # more reads than half the rows
                 ["4096", "132", "10", "0", "1"],       # no thread
                 ["4096", "132", "10", "1"]):           # an argument missing
        run = subprocess.run([str(exe), str(tmp_path), *args], capture_output=True, text=True)
        assert run.returncode == 2, args
        assert "file_probe" in run.stderr
    run = subprocess.run([str(exe), str(tmp_path / "missing"), "4096", "132", "10", "1", "1"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "missing" in run.stderr


def test_static_bound_misses_match_a_brute_force_count():
    rng = np.random.default_rng(5)
    batches = [(rng.zipf(1.3, size=(50, 3)) % 40, None) for _ in range(4)]
    steps, cap = 6, 7
    distinct, misses = storage.lookup_misses_static(batches, steps, cap)
    # Brute force: count in how many batches each id occurs, keep the cap
    # most frequent (ties: the smaller id, as a stable sort of sorted ids).
    seen = {}
    for ids, _ in batches:
        for k in set(ids.ravel().tolist()):
            seen[k] = seen.get(k, 0) + 1
    top = set(sorted(seen, key=lambda k: (-seen[k], k))[:cap])
    timed = [set(batches[i % 4][0].ravel().tolist()) for i in range(steps)]
    assert distinct == pytest.approx(np.mean([len(s) for s in timed]))
    assert misses == pytest.approx(np.mean([len(s - top) for s in timed]))


def test_floor_ratio_adds_reads_and_appends_to_the_dram_step():
    rates = {"pread_best_per_s": 2e6, "map_per_s": 2e7, "append_per_s": 1e7}
    got = storage.floor_report(0.010, 20000, rates)
    assert got["misses_per_step"] == 20000
    assert got["pread"]["extra_ms"] == pytest.approx(1e3 * (20000 / 2e6 + 20000 / 1e7))
    assert got["pread"]["file_over_dram"] == pytest.approx(0.010 / (0.010 + 0.012))
    assert got["map"]["file_over_dram"] == pytest.approx(0.010 / (0.010 + 0.003))


def test_tiny_run_reports_the_floor(tmp_path):
    out = tmp_path / "storage.json"
    run = subprocess.run([sys.executable, str(BENCH / "storage.py"), "--batch", "256",
                          "--features", "4", "--vocab", "5000", "--batches", "3", "--steps", "2",
                          "--reps", "1", "--floor-threads", "1", "--floor-repeats", "1",
                          "--storage-dir", str(tmp_path / "store"), "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    floor = report["floor"]
    assert floor["threads"] == 1 and floor["rates"]["reads"] >= 1
    assert floor["measured_misses"]["misses_per_step"] == report["file_reads_per_step"]
    for key in ("measured_misses", "static_bound_misses"):
        for how in ("pread", "map"):
            assert 0 < floor[key][how]["file_over_dram"] < 1
    # The static bound never misses more than the table read (every row
    # the bound misses is one the table's cache of that size missed too).
    assert (floor["static_bound_misses"]["misses_per_step"]
            <= floor["measured_misses"]["misses_per_step"])
    assert 0 <= report["static_bound_misses_per_distinct_id"] <= 1
    assert report["file_reads_per_distinct_id"] == pytest.approx(
        report["file_reads_per_step"] / report["distinct_ids_per_step"])
    assert "file floor, misses measured" in run.stdout
