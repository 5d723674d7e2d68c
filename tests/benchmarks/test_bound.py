"""benchmarks/bound.py: the floor's counts and the report's arithmetic
(never its times)."""

import importlib.util
import json
import pathlib
import sys

import numpy as np

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH / "peers"))
sys.path.insert(0, str(BENCH))
_spec = importlib.util.spec_from_file_location("bench_bound", BENCH / "bound.py")
bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bound)


def test_step_touches_counts_distinct_ids_per_batch_and_feature():
    rng = np.random.default_rng(3)
    batch, feats, max_ids, batches = 64, 3, 4, 2
    ids = rng.integers(0, 20, (batch * batches, feats, max_ids))
    ids[rng.random(ids.shape) < 0.3] = -1  # padding
    meta = {"batch": batch, "batches": batches, "dim": 16}
    got = bound.step_touches(ids, meta)
    distinct = [sum(np.unique(ids[i * batch:(i + 1) * batch, f][ids[i * batch:(i + 1) * batch, f]
                                                                 >= 0]).size
                    for f in range(feats)) for i in range(batches)]
    assert got["distinct_ids_per_step"] == np.mean(distinct)
    assert got["ids_per_step"] == np.mean([(ids[i * batch:(i + 1) * batch] >= 0).sum()
                                           for i in range(batches)])
    d = np.mean(distinct)
    # dim 16: a row is one 64-byte line; forward reads an index slot and the
    # row, the update reads and writes the row and its accumulator.
    assert got["forward_bytes"] == d * 64 * 2
    assert got["training_bytes"] == d * 64 * (2 + 4)


def test_probe_measures_each_access_kind(tmp_path):
    exe = bound.build_probe(tmp_path)
    rates = bound.machine_rates(exe, rows=4096, dim=8, threads=2, ops=200_000, repeats=2)
    assert len(rates["runs"]) == 2
    for k in ("probe_per_s", "gather_rows_per_s", "rmw_rows_per_s"):
        assert rates[k] == max(r[k] for r in rates["runs"]) > 0
    assert all(r["threads"] == 2 and r["rows"] == 4096 for r in rates["runs"])


def test_report_is_ours_over_the_floor(tmp_path):
    report = bound.main(["--quick", "--variants", "single", "--threads", "1", "--frameworks",
                         "ours_group", "--rounds", "1", "--steps", "2", "--lookups", "2",
                         "--probe-ops", "100000", "--probe-repeats", "1",
                         "--output-dir", str(tmp_path)])
    stored = json.loads((tmp_path / "bound.json").read_text())
    assert stored["results"].keys() == report["results"].keys() == {"single-1t"}
    r = stored["results"]["single-1t"]
    rates, d = r["machine_rates"], r["distinct_ids_per_step"]
    forward = 1e3 * (d / rates["probe_per_s"] + d / rates["gather_rows_per_s"])
    assert np.isclose(r["bound"]["forward_ms"], forward)
    assert np.isclose(r["bound"]["training_ms"], forward + 1e3 * d / rates["rmw_rows_per_s"])
    ours = r["frameworks"]["ours_group"]
    assert np.isclose(ours["step_ms"], 1e3 / ours["steps_per_s"]["median"])
    assert np.isclose(ours["training_vs_bound"], ours["step_ms"] / r["bound"]["training_ms"])
    assert np.isclose(ours["forward_vs_bound"], ours["forward_ms"] / r["bound"]["forward_ms"])
