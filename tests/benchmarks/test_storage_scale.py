"""benchmarks/storage.py --scale (the 100M-id run), run tiny: the
table is filled by chunks and trained, and the report's figures add up."""

import json
import pathlib
import subprocess
import sys

STORAGE_PY = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "storage.py"


def test_scale_mode_tiny(tmp_path):
    out = tmp_path / "scale.json"
    storage = tmp_path / "store"
    cmd = [sys.executable, str(STORAGE_PY), "--scale", "--scale-keys", "20000",
           "--scale-chunk", "6000", "--scale-cache-bytes", "65536", "--scale-steps", "3",
           "--batch", "256", "--features", "4", "--dim", "8", "--batches", "3",
           "--storage-dir", str(storage), "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "storage_scale"
    # 20000 ids in 4 features of 5000; filled in chunks 6000, 6000, 6000, 2000.
    assert report["target_keys"] == report["keys_filled"] == 20000 and report["complete"]
    # Training drew its ids from the filled ones: no new rows.
    assert report["rows"] == 20000
    # The cache holds 65536 bytes of 64-byte rows (value + accumulator) at most.
    assert 0 < report["cached_rows"] <= 65536 // 64 + 16 * 32
    assert report["row_bound_bytes_per_key"] == 4 * 8 * 2
    # Every row not in the cache is on disk at least once.
    on_disk = report["rows"] - report["cached_rows"]
    assert report["disk_bytes"] >= on_disk * 64
    assert 0.0 <= report["cache_hit_rate"] <= 1.0 and report["steps_per_s"] > 0
    assert report["peak_rss_bytes"] >= report["rss_end"]["RssAnon"] > 0
    assert "peak RSS" in run.stdout and "ids filled" in run.stdout
    # Self-labelled (a stored result names its date and command).
    assert report["command"].startswith("benchmarks/storage.py --scale --scale-keys 20000")
    assert len(report["date"]) == 10 and report["date"][4] == "-"
    # The folder that was asked for was used (a table's files go under it).
    assert any(path.name == "LOCK" for path in storage.rglob("*"))
