"""benchmarks/peers: the driver, on our and stock Keras workers only.

TorchRec and TFRA live in their own virtualenvs (`make bench-peers`) and are
not needed here: this runs `run.py --quick` with ours (GroupEmbedding and
separate EmbeddingVariable layers) and stock Keras, and checks the JSON,
the table and the plot for structure and consistency (never for time).
"""

import importlib.util
import json
import math
import pathlib
import sys

import numpy as np
import pytest

PEERS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
FRAMEWORKS = ("ours_group", "ours_separate", "keras")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(PEERS))
sys.path.insert(0, str(PEERS.parent))
run = _load("peers_run", PEERS / "run.py")
workload = _load("peers_workload", PEERS / "workload.py")
report = _load("peers_report", PEERS.parent / "report.py")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    data = run.main(["--quick", "--threads", "1", "--frameworks", ",".join(FRAMEWORKS),
                     "--output-dir", str(out)])
    return out, data


def test_workload_is_deterministic_and_padded(tmp_path):
    a = workload.generate(str(tmp_path / "a"), workload.QUICK, seed=3)
    b = workload.generate(str(tmp_path / "b"), workload.QUICK, seed=3)
    assert a == b
    for variant in workload.VARIANTS:
        ids, labels, meta = workload.load(str(tmp_path / "a"), variant)
        c = workload.QUICK
        assert ids.shape == (c["batch"] * c["batches"], c["features"], meta["max_ids"])
        assert labels.shape == (ids.shape[0],) and set(np.unique(labels)) <= {0.0, 1.0}
        valid = ids >= 0
        assert ids[valid].max() < c["vocab"] and (ids[~valid] == -1).all()
        # Padding only after the ids: every row holds 1..max_ids ids first.
        lengths = valid.sum(-1)
        assert lengths.min() >= 1 and lengths.max() <= meta["max_ids"]
        assert (valid == (np.arange(meta["max_ids"]) < lengths[..., None])).all()
        assert meta["ids_total"] == int(valid.sum())
        assert meta["distinct_keys"] == [int(np.unique(ids[:, f][valid[:, f]]).size)
                                         for f in range(c["features"])]


def test_results_structure(quick):
    out, data = quick
    saved = json.loads((out / "peers.json").read_text())
    assert saved["results"].keys() == data["results"].keys() == {"single-1t", "multi-1t"}
    assert saved["quick"] is True and saved["method"]["rounds"] == run.QUICK["rounds"]
    for key, res in saved["results"].items():
        assert set(res["frameworks"]) == set(FRAMEWORKS), key
        for name, r in res["frameworks"].items():
            assert len(r["rounds"]) == run.QUICK["rounds"], (key, name)
            for metric in ("steps_per_s", "lookup_ms"):
                s = r[metric]
                values = [x[metric] for x in r["rounds"]]
                assert s["min"] == min(values) and s["max"] == max(values)
                assert 0 < s["min"] <= s["median"] <= s["max"], (key, name, metric)
            assert all(math.isfinite(x) and 0 < x < 2 for x in r["loss"]), r["loss"]
            assert isinstance(r["rss_growth_bytes"], int)
        ref = res["frameworks"]["ours_group"]
        assert ref["train_vs_ours"] == 1.0 and ref["lookup_vs_ours"] == 1.0


def test_table_sizes_match_the_ids(quick):
    """Our dynamic tables hold exactly the distinct ids of the data (counted
    independently with NumPy); stock Keras holds its static vocab rows."""
    _, data = quick
    for key, res in data["results"].items():
        meta = data["data"][res["variant"]]
        fw = res["frameworks"]
        for name in ("ours_group", "ours_separate"):
            assert fw[name]["table_rows"] == meta["distinct_keys_total"], (key, name)
            per_key = fw[name]["bytes_per_key_table"]
            # At least the row and its Adagrad accumulator, 4 bytes a float.
            assert per_key >= 4 * meta["dim"] * 2, (key, name, per_key)
        c = data["workload"]
        assert fw["keras"]["table_rows"] == c["features"] * c["vocab"]
        assert fw["keras"]["table_bytes"] == 2 * c["features"] * c["vocab"] * c["dim"] * 4


def test_markdown_plot_and_report_section(quick, tmp_path):
    out, data = quick
    md = (out / "peers.md").read_text()
    for name in FRAMEWORKS:
        assert f"| {run.FRAMEWORKS[name][0]} |" in md
    assert "| framework | train, 1 id | forward lookup, 1 id | train, 1-5 ids |" in md
    assert "quick mode: not for quoting" in md
    assert data["method"]["torch_huge_pages"] is False
    assert "THP_MEM_ALLOC_ENABLE" not in md
    flagged = dict(data, method=dict(data["method"], torch_huge_pages=True))
    assert "TorchRec with THP_MEM_ALLOC_ENABLE=1" in report.peers_markdown(flagged)[0]
    assert (out / "peers.png").read_bytes()[:8] == PNG_SIGNATURE
    # report.py picks the peers up from its output folder.
    path = report.write_report(out, True, report._machine(PEERS.parent), [], {}, [], [], 1.0)
    text = path.read_text()
    assert "\n## Peers (TorchRec, TFRA, stock Keras)\n" in text
    assert "](peers.png)" in text


def test_bad_arguments():
    with pytest.raises(SystemExit):
        run.parse_args(["--frameworks", "ours_group,mxnet"])
    with pytest.raises(SystemExit):
        run.parse_args(["--threads", "0"])
    with pytest.raises(SystemExit):
        run.parse_args(["--rounds", "0"])


def test_before_runs_each_of_ours_again_on_another_build(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "FRAMEWORKS", dict(run.FRAMEWORKS))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with pytest.raises(SystemExit):
        run.parse_args(["--frameworks", "ours_group", "--before", str(tmp_path)])
    (tmp_path / "keras_rec_emb").mkdir()
    (tmp_path / "keras_rec_emb" / "__init__.py").write_text("")
    a = run.parse_args(["--frameworks", "ours_group,ours_jax_group,torchrec_tbe",
                        "--before", str(tmp_path)])
    assert a.frameworks == ["ours_group", "ours_jax_group", "torchrec_tbe",
                            "ours_group_before", "ours_jax_group_before"]
    assert run.worker_env("ours_group_before")["PYTHONPATH"] == str(tmp_path.resolve())
    assert run.worker_env("ours_jax_group_before")["KERAS_BACKEND"] == "jax"
    assert run.worker_env("ours_group")["PYTHONPATH"] == "/elsewhere"


def test_stored_result_is_rendered_and_consistent(tmp_path):
    """The stored full run (benchmarks/results/peers.json, `run.py --store`):
    every configuration and framework, ratios recomputed here with NumPy from
    the rounds, targets marked met exactly when reached, and `bench`'s
    report shows it when its folder has no fresh peers.json."""
    stored = report.stored_peers_result(PEERS.parent)
    assert stored is not None and stored["benchmark"] == "peers" and not stored["quick"]
    assert set(stored["results"]) == {"single-1t", "single-2t", "multi-1t", "multi-2t"}
    md = "\n".join(report.peers_markdown(stored))
    for key, res in stored["results"].items():
        fw = res["frameworks"]
        # Stock Keras (0.1 steps/s, 10 minutes of warm-up) only in single-1t;
        # a framework left out of the whole run is listed, with why, in "skipped".
        skipped = set(stored.get("skipped") or {})
        assert all(stored["skipped"][name] for name in skipped)
        expected = set(run.FRAMEWORKS) - skipped - (set() if key == "single-1t" else {"keras"})
        assert set(fw) == expected, key
        ours = fw["ours_group"]
        for name, r in fw.items():
            assert len(r["rounds"]) == stored["method"]["rounds"]
            train = np.median([x["steps_per_s"] / y["steps_per_s"]
                               for x, y in zip(r["rounds"], ours["rounds"])])
            fwd = np.median([y["lookup_ms"] / x["lookup_ms"]
                             for x, y in zip(r["rounds"], ours["rounds"])])
            assert f"{train:.2f}x" in md and f"{fwd:.2f}x" in md, (key, name)
            # The matched workload: every framework starts at ~ln 2 and its
            # warm-up pass lowers the loss about as much as ours does.
            assert abs(r["loss_initial"] - math.log(2)) < 0.01, (key, name)
            assert abs(r["loss_after_warmup"] - ours["loss_after_warmup"]) < 0.05, (key, name)
    targets = report.peer_target_rows(stored)
    assert len(targets) == 4 * len(report.PEER_TARGETS)
    for t in targets:
        assert t["met"] == (t["ratio"]["median"] >= t["target"])
        assert t["ratio"]["min"] <= t["ratio"]["median"] <= t["ratio"]["max"]
    path = report.write_report(tmp_path, False, report._machine(PEERS.parent), [], {}, [], [],
                               1.0, stored_peers=stored)
    text = path.read_text()
    assert f"Stored result `benchmarks/{report.STORED_PEERS_JSON}` of {stored['date']}" in text
    assert "| TorchRec DistributedModelParallel, 1 rank |" in text
    assert (tmp_path / "peers.png").read_bytes()[:8] == PNG_SIGNATURE


def test_worker_env_threads_and_huge_pages(monkeypatch):
    """Each worker's environment: the OMP wait policy for all, and torch's
    huge-page switch only for TorchRec's workers and only when asked (an
    inherited THP_MEM_ALLOC_ENABLE does not leak into a default run)."""
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    for name in run.FRAMEWORKS:
        default = run.worker_env(name)
        assert default["OMP_WAIT_POLICY"] == "PASSIVE"
        assert "THP_MEM_ALLOC_ENABLE" not in default, name
        assert "OMP_WAIT_POLICY" not in run.worker_env(name, "unset")
        huge = run.worker_env(name, torch_huge_pages=True)
        assert ("THP_MEM_ALLOC_ENABLE" in huge) == name.startswith("torchrec"), name
    assert run.worker_env("tfra")["TF_USE_LEGACY_KERAS"] == "1"
