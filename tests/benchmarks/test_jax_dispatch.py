"""benchmarks/jax_dispatch.py runs and reports every dispatch it times
(never its times' values)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_it_reports_both_dispatches_for_each_size(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "jax_dispatch.py"), "--arrays", "1,3",
         "--rounds", "2", "--calls", "3", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "jax_dispatch.json").read_text())
    assert [row["arrays"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert set(row["ms_per_call"]) == {"jax.jit", "OrderedJit", "jax.jit, no table call"}
        assert all(ms > 0 for ms in row["ms_per_call"].values())
        q = row["jax_jit_over_ordered_jit"]
        assert q["min"] <= q["median"] <= q["max"]
    assert "| 3 |" in done.stdout
