"""benchmarks/report.py (`keras-rec-emb bench`): the report of a quick run,
and its errors."""

import argparse
import importlib.util
import pathlib
import re

import pytest

REPORT_PY = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "report.py"
_spec = importlib.util.spec_from_file_location("benchmarks_report", REPORT_PY)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """One quick run (about a minute on 2 cores), shared by the checks."""
    out = tmp_path_factory.mktemp("bench-report")
    return bench.run(out, quick=True)


def _results_table(text):
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_report_sections(quick_report):
    text = quick_report.read_text()
    assert quick_report.name == "report.md"
    for section in bench.SECTIONS:
        assert section + "\n" in text, section
    assert "cores" in text and "tensorflow-cpu" in text and "keras " in text
    # The huge page mode moves gather-bound results; the report says which it ran with.
    thp = bench._machine(REPORT_PY.parent)["transparent_hugepages"]
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        assert f"[{thp}]" in f.read()
    assert f"transparent huge pages `{thp}`" in text
    assert "Skipped in quick mode" in text  # says the data benchmark was skipped
    commands = text.split("## Commands", 1)[1].split("```sh\n", 1)[1].split("```")[0]
    for script in ("lookup.py", "filters.py", "group_embedding.py", "training.py",
                   "memory_per_key.py", "storage.py", "checkpoint.py"):
        assert f"python benchmarks/{script} " in commands


def test_every_ratio_is_a_number(quick_report):
    header, rows = _results_table(quick_report.read_text())
    assert header == ["benchmark", "comparison", "ratio", "target", "status"]
    # Rows measured by this run, and the stored `storage.py --scale` result's
    # rows (a 100M-id run is not repeated by `keras-rec-emb bench`).
    stored = [row for row in rows if "(stored result of" in row[0]]
    benchmarks = {row[0].split(":")[0] for row in rows if row not in stored}
    assert benchmarks == {"`lookup.py`", "`filters.py`", "`group_embedding.py`",
                          "`training.py`", "`memory_per_key.py`", "`storage.py`",
                          "`checkpoint.py`"}
    assert stored and all(row[0].startswith(("`storage.py --scale`", "`distributed.py`"))
                          for row in stored)
    assert any(row[0].startswith("`distributed.py`") for row in stored)
    for row in rows:
        assert len(row) == 5, row
        ratio = float(row[2])
        assert ratio > 0, row
        assert row[4] in ("met", "not met", "-"), row
        if row[3] != "-":
            sign, target = re.fullmatch(r"(>=|<=) ([0-9.]+)x", row[3]).groups()
            met = ratio >= float(target) if sign == ">=" else ratio <= float(target)
            assert row[4] == ("met" if met else "not met"), row
    assert any("EmbeddingVariable + our Adagrad / Hashing+Embedding" in row[1]
               for row in rows)
    # Memory per key against its bound, lookups against tf.gather.
    assert any(row[0].startswith("`memory_per_key.py`") and row[3] == "<= 1.3x"
               for row in rows)
    assert any("`tf.gather` on a dense variable" in row[1] for row in rows)
    # Incremental vs full save, target <= 0.1x at 1% changed.
    assert any(row[0].startswith("`checkpoint.py`") and "(1% of rows changed)" in row[1]
               and row[3] == "<= 0.1x" for row in rows)


def test_plots_are_png_files(quick_report):
    text = quick_report.read_text()
    for name in bench.PLOTS.values():
        path = quick_report.parent / name
        assert path.is_file(), name
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", name
        assert f"]({name})" in text


def test_benchmarks_dir_not_found(tmp_path):
    with pytest.raises(bench.BenchError, match="benchmarks directory not found: .*nowhere"
                       ".*source checkout.*--benchmarks-dir"):
        bench.run(tmp_path / "out", benchmarks_dir=tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()


def test_failing_benchmark_is_named_with_its_output(tmp_path, capsys):
    scripts = tmp_path / "benchmarks"
    scripts.mkdir()
    (scripts / "lookup.py").write_text(
        "import sys\nprint('building the table')\n"
        "print('MemoryError: out of arena', file=sys.stderr)\nsys.exit(3)\n")
    for name in ("filters", "group_embedding", "training", "memory_per_key", "storage",
                 "checkpoint"):
        (scripts / f"{name}.py").write_text("")
    with pytest.raises(bench.BenchError) as info:
        bench.run(tmp_path / "out", quick=True, benchmarks_dir=scripts)
    message = str(info.value)
    assert "benchmark 'lookup (100,000 rows)' failed (exit status 3)" in message
    assert "MemoryError: out of arena" in message and "lookup.py --rows 100000" in message

    args = bench.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--quick", "--benchmarks-dir", str(tmp_path / "nowhere"),
         "--output-dir", str(tmp_path / "out2")])
    assert bench.command(args) == 1
    assert "keras-rec-emb bench: error: benchmarks directory not found" in \
        capsys.readouterr().err


def test_stored_scale_result_rows(tmp_path):
    # The stored `storage.py --scale` result (100M ids) becomes two labelled
    # rows: peak RSS against the 6 GiB ceiling, and disk bytes per key.
    stored = bench.stored_scale_result(REPORT_PY.parent)
    assert stored is not None and stored["benchmark"] == "storage_scale"
    rss, disk = bench._storage_scale_rows(stored)
    assert stored["date"] in rss["benchmark"] and stored["command"] in rss["benchmark"]
    assert rss["ratio"] == stored["peak_rss_bytes"] / (6 * 2**30) and rss["lower"]
    assert rss["status"] == ("met" if round(rss["ratio"], 3) <= 1.0 else "not met")
    assert disk["ratio"] == stored["disk_over_bound"]
    assert bench.stored_scale_result(tmp_path) is None


@pytest.mark.parametrize("name", ["results/distributed.json", "results/distributed_group.json"])
def test_stored_distributed_result_rows(tmp_path, name):
    # The stored `distributed.py` results (separate layers; the same tables
    # in one GroupEmbedding): for every MultiWorkerMirroredStrategy run
    # after the plain process, CPU of every process per step against the
    # plain one (with its targets at 2 and 4 workers) and the bytes the
    # sockets sent against the all-to-all ideal.
    stored = bench.stored_distributed_result(REPORT_PY.parent, name)
    assert stored is not None and stored["benchmark"] == "distributed"
    assert bool(stored["args"]["group"]) == name.endswith("_group.json")
    rows = bench._distributed_rows(stored, stored=True)
    assert all(("in one GroupEmbedding" in r["benchmark"]) == stored["args"]["group"]
               for r in rows)
    cluster = stored["results"]["cluster"]
    assert cluster[0]["workers"] == 0 and [r["workers"] for r in cluster[1:]] == [1, 2, 4]
    runs = [r for r in cluster[1:]]
    with_bytes = [r for r in runs if r["ideal_bytes_per_step"]]
    assert len(rows) == len(runs) + len(with_bytes)
    plain = cluster[0]["cpu_s_per_step"]
    cpu_rows = [r for r in rows if r["comparison"].startswith("CPU s")]
    for run, row in zip(runs, cpu_rows):
        assert stored["date"] in row["benchmark"] and stored["command"] in row["benchmark"]
        assert row["ratio"] == run["cpu_s_per_step"] / plain and row["lower"]
        assert row["target"] == bench.DISTRIBUTED_CPU_TARGETS.get(run["workers"])
    byte_rows = [r for r in rows if r["comparison"].startswith("bytes sent")]
    for run, row in zip(with_bytes, byte_rows):
        assert row["ratio"] == run["bytes_per_step"] / run["ideal_bytes_per_step"]
        assert row["target"] == bench.DISTRIBUTED_BYTES_TARGET and row["status"] == "met"
    assert bench.stored_distributed_result(tmp_path) is None


def test_stored_distributed_ps_result_rows(tmp_path):
    # The stored `distributed.py --ps` result: for each worker count,
    # examples/s and CPU of every process per example against one plain
    # process, and bytes per worker step against the ideal exchange.
    stored = bench.stored_distributed_ps_result(REPORT_PY.parent)
    assert stored is not None and stored["benchmark"] == "distributed_ps"
    results = stored["results"]
    runs = results["ps"]
    assert [r["workers"] for r in runs] == [1, 2, 4] and {r["ps_tasks"] for r in runs} == {2}
    rows = bench._distributed_ps_rows(stored)
    assert len(rows) == 3 * len(runs)
    for run, (rate, cpu, sent) in zip(runs, zip(rows[0::3], rows[1::3], rows[2::3])):
        for row in (rate, cpu, sent):
            assert row["benchmark"].startswith("`distributed.py`")
            assert stored["date"] in row["benchmark"] and "--ps" in row["benchmark"]
        assert rate["ratio"] == run["examples_per_s"] / results["plain_examples_per_s"]
        assert cpu["ratio"] == run["cpu_s_per_example"] / results["plain_cpu_s_per_example"]
        assert cpu["lower"] and sent["lower"]
        assert sent["ratio"] == run["bytes_per_step"] / run["ideal_bytes_per_step"]
    assert bench.stored_distributed_ps_result(tmp_path) is None
