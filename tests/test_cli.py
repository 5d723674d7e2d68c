"""The `keras-rec-emb` command (keras_rec_emb/cli.py)."""

import contextlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
import traceback
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_rec_emb as kre
import keras_rec_emb_cli
from keras_rec_emb import cli

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def run(args, **env):
    """`python ARGS` in a child. `inspect` and `strip-filtered` run in this
    process instead, through the same `main` the console script calls (the
    `demo` test runs the module in a child): each child would spend a
    TensorFlow start-up on reading a file."""
    if args[:2] == ["-m", "keras_rec_emb.cli"] and args[2] in IN_PROCESS and not env:
        return run_here(args[2:])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env), timeout=300)


IN_PROCESS = ("inspect", "strip-filtered")


def run_here(argv):
    """The command line `argv` run by keras_rec_emb_cli.main in this process,
    as a CompletedProcess: its exit status (an uncaught exception prints its
    traceback and gives 1, as a child would), stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = keras_rec_emb_cli.main(list(argv)) or 0
        except SystemExit as e:
            code = e.code
            if code is None:
                code = 0
            elif not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def trained_with_filter():
    """A model whose table admitted id 1 (seen 3x) and counted 2 (2x), 3 (1x)."""
    layer = kre.layers.EmbeddingVariable(4, name="ev", ev_option=kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_no_permission=-0.5),
        filter_option=kre.CounterFilter(3)))
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="mse")
    model.fit(np.array([[1, 1], [1, 2], [3, 2]]), np.ones((3, 1)), batch_size=3, verbose=0)
    return model, layer


def filtered(layer):
    data = layer.export()
    return dict(zip(data["keys_filtered"].tolist(), data["freqs_filtered"].tolist()))


# -- demo ----------------------------------------------------------------------



def test_cli_demo_small_and_inspect(tmp_path):
    out = tmp_path / "demo"
    result = run(["-m", "keras_rec_emb.cli", "demo", "--rows", "3000", "--epochs", "1",
                  "--features", "4", "--output", str(out)])
    assert result.returncode == 0, result.stderr
    assert "predictions identical after reload: yes" in result.stdout
    assert (out / "model.keras").exists() and (out / "serving" / "saved_model.pb").exists()
    inspect = run(["-m", "keras_rec_emb.cli", "inspect", str(out / "model.keras"), "--rows", "2"])
    assert inspect.returncode == 0, inspect.stderr
    assert "C1" in inspect.stdout and "keys" in inspect.stdout
    bad = run(["-m", "keras_rec_emb.cli", "inspect", str(tmp_path / "nope.keras")])
    assert bad.returncode == 2 and "nope.keras" in bad.stderr
    bad_rows = run_here(["demo", "--rows", "0"])  # refused by the parser: no child needed
    assert bad_rows.returncode == 2 and "--rows" in bad_rows.stderr


# -- inspect and strip-filtered ------------------------------------------------

def test_inspect_and_strip_filtered(tmp_path):
    model, layer = trained_with_filter()
    src, dst = str(tmp_path / "m.keras"), str(tmp_path / "serving.keras")
    model.save(src)
    inspect = run(["-m", "keras_rec_emb.cli", "inspect", src])
    assert inspect.returncode == 0, inspect.stderr
    assert "keys=1 filtered=2" in inspect.stdout
    strip = run(["-m", "keras_rec_emb.cli", "strip-filtered", src, dst])
    assert strip.returncode == 0, strip.stderr
    # Parts named by layer name, not by the h5 path (class name + counter).
    assert f"\n  {layer.name}: keys_filtered\n" in strip.stdout, strip.stdout
    assert "/vars/" not in strip.stdout
    with zipfile.ZipFile(dst) as z, z.open("model.weights.h5") as f, h5py.File(f, "r") as h5:
        names = []
        h5.visit(names.append)
    assert not [n for n in names if n.endswith("_filtered")] and any(n.endswith("/keys") for n in names)
    stripped = keras.saving.load_model(dst)
    assert filtered(stripped.layers[1]) == {}
    x = np.array([[1, 2], [3, 9]])
    np.testing.assert_array_equal(stripped.predict(x, verbose=0), model.predict(x, verbose=0))
    assert run(["-m", "keras_rec_emb.cli", "strip-filtered", src,
                str(tmp_path / "x.h5")]).returncode == 2


def test_inspect_a_model_without_tables(tmp_path, capsys):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    path = str(tmp_path / "plain.keras")
    model.save(path)
    assert cli.main(["inspect", path]) == 0
    assert capsys.readouterr().out == f"{path}: no EmbeddingVariable tables\n"


def test_inspect_prints_rows_up_to_rows(tmp_path, capsys):
    model, layer = trained_with_filter()
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert cli.main(["inspect", path, "--rows", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ev: dim=4 key_dtype=int64 keys=1 filtered=2 ")
    assert out[1].startswith("  key=1 freq=3 ") and len(out) == 3  # one admitted key
    assert out[2].startswith("total: 1 tables, 1 keys, 2 filtered, ")


def test_inspect_reads_a_large_table_in_chunks_with_progress(tmp_path, capsys, monkeypatch):
    """`inspect` reads a table's per-key arrays a chunk at a time (its
    memory does not grow with the table: tracemalloc sees NumPy's buffers)
    and says how far it is on stderr; its figures equal NumPy's over the
    whole arrays."""
    import tracemalloc

    n = 600_000
    layer = kre.layers.EmbeddingVariable(2, name="big", ev_option=kre.EmbeddingVariableOption(
        track_meta=True))
    ids = keras.Input((1,), dtype="int64")
    model = keras.Model(ids, layer(ids))
    rng = np.random.default_rng(0)
    freqs, versions = rng.integers(1, 1000, n), rng.integers(0, 10**9, n)
    layer.table.import_({"keys": np.arange(n, dtype=np.int64) * 7,
                         "values": rng.normal(size=(n, 2)).astype(np.float32),
                         "freqs": freqs, "versions": versions})
    path = str(tmp_path / "big.keras")
    model.save(path)
    monkeypatch.setattr(cli, "INSPECT_CHUNK", 1 << 14)
    monkeypatch.setattr(cli, "PROGRESS_KEYS", 100_000)
    tracemalloc.start()
    try:
        assert cli.main(["inspect", path, "--json"]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    captured = capsys.readouterr()
    import json

    table = json.loads(captured.out)["tables"][0]
    assert (table["keys"], table["latest_step"], table["total_freq"]) == (
        n, int(versions.max()), int(freqs.sum()))
    # One int64 array of the table is 4.8 MB; chunks of 16k entries are 128 kB.
    assert peak < 2_000_000, peak
    progress = [line for line in captured.err.splitlines() if "big:" in line]
    assert progress[-1] == f"keras-rec-emb inspect: big: 100% of {2 * n:,} entries read"
    percents = [int(line.split(": ")[2].split("%")[0]) for line in progress]
    assert percents == sorted(percents) and len(progress) > 10
    # The same file with its members compressed (another zip tool) reads
    # the same.
    deflated = str(tmp_path / "deflated.keras")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(deflated, "w",
                                                       zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), zipfile.ZIP_DEFLATED)
    assert cli.main(["inspect", deflated, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tables"][0] == table


# -- bench ---------------------------------------------------------------------

def _fake_checkout(root):
    """A checkout whose benchmarks/ holds the real report.py and a lookup
    script that fails: running it proves which report ran, with which options."""
    scripts = root / "benchmarks"
    scripts.mkdir(parents=True)
    for name in ("report.py", "_machine.py"):
        shutil.copy(BENCHMARKS / name, scripts / name)
    (scripts / "lookup.py").write_text(
        "import sys\nprint('MemoryError: out of arena', file=sys.stderr)\nsys.exit(3)\n")
    for name in ("filters", "group_embedding", "training", "memory_per_key", "storage",
                 "checkpoint"):
        (scripts / f"{name}.py").write_text("")
    return scripts


def test_bench_outside_a_checkout_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_CHECKOUT", str(tmp_path / "site-packages"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "keras-rec-emb bench: error: the benchmarks are not part of the installed " \
           "package" in err
    assert str(tmp_path / "site-packages" / "benchmarks") in err
    assert str(tmp_path / "benchmarks") in err and "--benchmarks-dir" in err
    assert not (tmp_path / "bench-report").exists()


@pytest.mark.parametrize("found_by", ["package", "cwd", "option"])
def test_bench_runs_the_checkouts_report_with_the_options(tmp_path, monkeypatch, capsys,
                                                          found_by):
    checkout = tmp_path / "checkout"
    scripts = _fake_checkout(checkout)
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--output-dir", str(out)]
    monkeypatch.setattr(cli, "_CHECKOUT", str(checkout if found_by == "package"
                                              else tmp_path / "elsewhere"))
    if found_by == "cwd":
        monkeypatch.chdir(checkout)
    elif found_by == "option":
        argv += ["--benchmarks-dir", str(scripts)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    # --quick reached the report: its first run is the quick 100,000-row lookup.
    assert "benchmark 'lookup (100,000 rows)' failed (exit status 3)" in err
    assert f"scripts in {scripts.resolve()}" in err
    assert "lookup.py --rows 100000" in err and "MemoryError: out of arena" in err
    assert (out / "logs" / "lookup_100000.log").is_file()  # --output-dir reached it


def test_bench_help_is_the_reports(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: keras-rec-emb bench")
    assert "--quick" in text and "--output-dir" in text and "--benchmarks-dir" in text


def test_unknown_options_of_other_commands_are_refused(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["inspect", "m.keras", "--quick"])
    assert info.value.code == 2
    assert "unrecognized arguments: --quick" in capsys.readouterr().err


def test_cli_help_and_version_do_not_import_tensorflow():
    probe = ("import sys, keras_rec_emb_cli\n"
             "for argv in (['--help'], ['--version'], ['inspect', '--help']):\n"
             "    try:\n"
             "        keras_rec_emb_cli.main(argv)\n"
             "    except SystemExit as e:\n"
             "        assert e.code == 0, (argv, e.code)\n"
             "print('IMPORTED', sorted(m for m in ('tensorflow', 'keras', 'keras_rec_emb')\n"
             "                         if m in sys.modules))\n")
    result = run(["-c", probe])
    assert result.returncode == 0, result.stderr
    assert "IMPORTED []" in result.stdout
    assert "usage: keras-rec-emb" in result.stdout and "--json" in result.stdout
    assert f"keras-rec-emb {kre.__version__}" in result.stdout


def test_cli_inspect_saved_models_json_order_totals_and_bad_files(tmp_path):
    import json

    import keras
    import numpy as np

    ids = keras.Input((2,), dtype="int64")
    tables = [kre.layers.EmbeddingVariable(dim, combiner="sum", name=name)
              for name, dim in (("zeta", 4), ("alpha", 2), ("mid", 3))]
    h = keras.layers.Concatenate()([t(ids + k) for k, t in enumerate(tables)])
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    model.compile(optimizer=kre.optimizers.SGD(0.1), loss="mse")
    model.fit(np.arange(20).reshape(10, 2), np.ones((10, 1)), verbose=0)
    sizes = {t.name: t.table_size() for t in tables}
    path = tmp_path / "m.keras"
    kre.save_model(model, path)
    model.export(str(tmp_path / "exported"), verbose=False)
    kre.export_for_serving(model, str(tmp_path / "serving"))

    text = run(["-m", "keras_rec_emb.cli", "inspect", str(path), "--rows", "1"])
    assert text.returncode == 0, text.stderr
    heads = [line.split(":")[0] for line in text.stdout.splitlines()
             if not line.startswith((" ", "total"))]
    assert heads == ["zeta", "alpha", "mid"]  # model order
    total = sum(sizes.values())
    assert f"total: 3 tables, {total:,} keys, 0 filtered" in text.stdout
    out = run(["-m", "keras_rec_emb.cli", "inspect", str(path), "--json"])
    report = json.loads(out.stdout)
    assert [(t["name"], t["dim"], t["keys"]) for t in report["tables"]] == [
        (t.name, t.embedding_dim, sizes[t.name]) for t in tables]
    assert report["totals"]["keys"] == total and report["totals"]["tables"] == 3

    exported = json.loads(run(["-m", "keras_rec_emb.cli", "inspect",
                               str(tmp_path / "exported"), "--json"]).stdout)
    assert sorted((t["dim"], t["keys"]) for t in exported["tables"]) == sorted(
        (t.embedding_dim, sizes[t.name]) for t in tables)
    served = json.loads(run(["-m", "keras_rec_emb.cli", "inspect",
                             str(tmp_path / "serving"), "--json"]).stdout)
    assert sorted(t["keys"] for t in served["tables"]) == sorted(sizes.values())

    junk = tmp_path / "junk.keras"
    junk.write_text("not a model")
    for bad, message in ((junk, "is not a valid .keras file"),
                         (tmp_path, "not a SavedModel (no saved_model.pb)")):
        result = run(["-m", "keras_rec_emb.cli", "inspect", str(bad)])
        assert result.returncode == 2
        assert message in result.stderr and "Traceback" not in result.stderr


# -- checkpoint links, file-tier models, output folders -------------------------

def test_inspect_describes_a_checkpoint_link_and_strip_filtered_names_it(tmp_path):
    import json

    model, layer = trained_with_filter()
    ckpt = kre.IncrementalCheckpointer(model, str(tmp_path / "chain"))
    full = ckpt.save_full()
    model.fit(np.array([[1, 7], [1, 7]]), np.ones((2, 1)), verbose=0)
    assert layer.table.erase([3]) == 1  # a counted (filtered) key erased
    link = ckpt.save_incremental()
    text = run(["-m", "keras_rec_emb.cli", "inspect", link])
    assert text.returncode == 0, text.stderr
    assert "an IncrementalCheckpointer incremental checkpoint link" in text.stdout
    assert f"after {os.path.basename(full)}" in text.stdout
    assert "IncrementalCheckpointer(model, directory).restore()" in text.stdout
    report = json.loads(run(["-m", "keras_rec_emb.cli", "inspect", link, "--json"]).stdout)
    with np.load(link) as z:
        changed, erased = len(z["t0/keys"]), len(z["t0/erased"])
    assert report["format"] == "checkpoint link" and report["link"]["kind"] == "incremental"
    assert report["link"]["parent"] == os.path.basename(full)
    assert [(t["name"], t["keys"], t["erased"]) for t in report["tables"]] == [
        ("ev/embeddings", changed, erased)] and erased == 1
    full_report = json.loads(run(["-m", "keras_rec_emb.cli", "inspect", full,
                                  "--json"]).stdout)
    assert full_report["tables"][0]["keys"] == 1 and full_report["tables"][0]["filtered"] == 2
    strip = run(["-m", "keras_rec_emb.cli", "strip-filtered", link, str(tmp_path / "o.keras")])
    assert strip.returncode == 2 and "Traceback" not in strip.stderr
    assert "not a .keras model but a checkpoint link" in strip.stderr
    assert len(strip.stderr.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="checkpoint link"):
        kre.load_model(link)


def test_strip_filtered_into_a_missing_folder_is_one_line(tmp_path):
    import argparse

    model, _ = trained_with_filter()
    src = str(tmp_path / "m.keras")
    model.save(src)
    out = str(tmp_path / "no" / "such" / "out.keras")
    result = run(["-m", "keras_rec_emb.cli", "strip-filtered", src, out])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "does not exist" in result.stderr and str(tmp_path / "no" / "such") in result.stderr
    # The command itself (past the parser) says so too, and writes nothing.
    args = argparse.Namespace(command="strip-filtered", input=src, output=out)
    assert cli.run(args) == 2
    assert not (tmp_path / "no").exists()
    assert os.listdir(tmp_path) == ["m.keras"]


@pytest.mark.parametrize("member", ["../../escaped.txt", "/ABS/escaped.txt",
                                    "assets/..\\..\\escaped.txt"])
def test_strip_filtered_refuses_a_member_name_that_leaves_the_folder(tmp_path, member):
    model, _ = trained_with_filter()
    clean = str(tmp_path / "clean.keras")
    model.save(clean)
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    src = str(work / "m.keras")
    member = member.replace("/ABS", str(tmp_path / "abs"))
    with zipfile.ZipFile(clean) as zin, zipfile.ZipFile(src, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info))
        zout.writestr(zipfile.ZipInfo(member), b"written where the file says")
    with zipfile.ZipFile(src) as z:
        assert member in z.namelist()  # the crafted name is really in the archive
    out = str(work / "out.keras")
    result = run(["-m", "keras_rec_emb.cli", "strip-filtered", src, out])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert repr(member) in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    # No output (whose unpacking would write outside), nothing beside or above it.
    assert sorted(os.listdir(work)) == ["m.keras"]
    assert sorted(os.listdir(tmp_path)) == ["a", "clean.keras"]
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]


def test_inspect_reads_a_file_tier_model_while_its_trainer_lives(tmp_path):
    """No table is built: the live trainer keeps its storage folder."""
    import json

    storage = tmp_path / "store"
    layer = kre.layers.EmbeddingVariable(4, combiner="sum", name="ev",
                                         ev_option=kre.EmbeddingVariableOption(
                                             storage_option=kre.StorageOption(
                                                 "FILE", storage_path=str(storage),
                                                 storage_size=4096)))
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.fit(np.arange(400).reshape(200, 2), np.ones((200, 1)), verbose=0)
    path = str(tmp_path / "m.keras")
    kre.save_model(model, path)
    files = sorted(p.relative_to(storage) for p in storage.rglob("*"))
    text = run(["-m", "keras_rec_emb.cli", "inspect", path, "--rows", "2"])
    assert text.returncode == 0, text.stderr
    assert "ev: dim=4 key_dtype=int64 keys=400 " in text.stdout
    assert f"file tier: storage_path={storage}" in text.stdout
    report = json.loads(run(["-m", "keras_rec_emb.cli", "inspect", path, "--json"]).stdout)
    data = layer.export()
    (table,) = report["tables"]
    assert table["keys"] == 400 and table["total_freq"] == int(data["freqs"].sum())
    assert table["latest_step"] == int(data["versions"].max())
    first = table["rows"][0]
    i = int(np.flatnonzero(data["keys"] == first["key"])[0])
    np.testing.assert_allclose(first["values"], data["values"][i], rtol=1e-6)
    assert sorted(p.relative_to(storage) for p in storage.rglob("*")) == files
    model.fit(np.arange(4).reshape(2, 2), np.ones((2, 1)), verbose=0)  # the trainer goes on
