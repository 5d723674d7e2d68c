"""Runs the scripts of `benchmarks/` and writes a report (`keras-rec-emb bench`).

Each benchmark script runs its paths side by side in one process and writes
a JSON file. This module runs them one after another as subprocesses of the
same Python (each with `--json` into the output directory), collects their
JSON, and writes `report.md` with the machine, a table of ratios (ours vs
the stock reference and vs the hardware bound, with the issue's targets),
PNG plots (matplotlib, Agg backend) and the exact commands used.

It lives in a source checkout, next to the scripts it runs, not in the
installed package. Run it from the repository root:

    .venv/bin/python benchmarks/report.py [--quick] [--output-dir DIR]
    keras-rec-emb bench [--quick]      # the same, found from the package
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata

DEFAULT_BENCHMARKS_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_OUTPUT_DIR = "bench-report"
REPORT_NAME = "report.md"
HEARTBEAT_S = 30
STDERR_TAIL_LINES = 25

SECTIONS = ("## Machine", "## Results", "## Plots", "## Commands", "## Notes")
PLOTS = {"lookup": "lookup_vs_table_size.png", "training": "training_steps.png",
         "group": "group_fused_vs_unfused.png"}
# The stored result of the last `storage.py --scale` run (100M ids; hours,
# not run by `bench`): shown in the report, labelled with its date and command.
STORED_SCALE_JSON = "results/storage_scale.json"
# The stored result of the last `distributed.py` run (1, 2, 4 replicas and a
# 2-process cluster; minutes of cluster start-up, so not in `--quick`): shown
# when the run has no fresher one.
STORED_DISTRIBUTED_JSON = "results/distributed.json"
STORED_DISTRIBUTED_GROUP_JSON = "results/distributed_group.json"
# The stored result of the last `distributed.py --ps` run (asynchronous
# parameter servers; minutes of cluster start-ups): always shown, not rerun.
STORED_DISTRIBUTED_PS_JSON = "results/distributed_ps.json"
PEERS_JSON = "peers.json"  # written by benchmarks/peers/run.py into the report folder
PEERS_PLOT = "peers.png"
# The stored result of the last full `make bench-peers` run (TorchRec and TFRA
# need their own virtualenvs): shown when the report folder has no fresher one.
STORED_PEERS_JSON = "results/peers.json"

# Table sizes (rows) for the lookup runs, and every script's arguments.
LOOKUP_ROWS = {"quick": (100_000,), "full": (100_000, 1_000_000, 10_000_000)}
ARGS = {
    "quick": {
        "lookup": ["--batch", "20000", "--dims", "64", "--threads", "0",
                   "--reps", "3", "--warmup", "1"],
        "filters": ["--ids", "200000", "--batch", "20000", "--reps", "3"],
        "group_embedding": ["--features", "8", "--batch", "1024", "--vocab", "100000",
                            "--bins", "20000", "--warmup", "2", "--reps", "8"],
        "training": ["--quick"],
        "memory_per_key": ["--keys", "200000", "--chunk", "100000"],
        "storage": ["--batch", "512", "--features", "8", "--vocab", "20000",
                    "--batches", "5", "--steps", "3", "--reps", "2"],
        "checkpoint": ["--rows", "200000"],
    },
    "full": {
        "lookup": ["--batch", "1000000", "--dims", "64", "--threads", "0"],
        "filters": [],
        "group_embedding": [],
        "training": [],
        "memory_per_key": [],
        "storage": [],
        "checkpoint": ["--rows", "10000000"],
        "data": [],
        "distributed": ["--workers", "1,2,4"],
    },
}
QUICK_SKIPPED = {
    "data": "the Parquet/Kafka benchmark (`data.py`) writes a 2M-row file and starts "
            "a Kafka broker; run without `--quick` to include it",
}


class BenchError(RuntimeError):
    """A benchmark run that cannot go on: missing scripts, a failed script."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# -- Running the scripts -----------------------------------------------------------

def find_benchmarks_dir(benchmarks_dir=None):
    """The folder holding the benchmark scripts, or a BenchError saying where
    it was looked for and how to point at it."""
    path = pathlib.Path(benchmarks_dir) if benchmarks_dir else DEFAULT_BENCHMARKS_DIR
    if not (path / "lookup.py").is_file():
        where = "given" if benchmarks_dir else "default: the folder of report.py"
        raise BenchError(
            f"benchmarks directory not found: {path} ({where}). The benchmark scripts "
            "live in the `benchmarks` folder of a source checkout of keras-rec-emb: "
            "pass --benchmarks-dir /path/to/checkout/benchmarks.")
    return path.resolve()


def _run_script(label, cmd, log_path, cwd):
    """Runs one benchmark command, streaming its output to `log_path`, with
    progress on stderr; raises BenchError naming it, with its output's tail."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow",
           "MPLBACKEND": "Agg"}
    start = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=env)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    log(f"      ... {label} still running ({time.perf_counter() - start:.0f} s)")
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    elapsed = time.perf_counter() - start
    if rc != 0:
        lines = pathlib.Path(log_path).read_text(errors="replace").splitlines()
        tail = "\n".join("    " + line for line in lines[-STDERR_TAIL_LINES:])
        raise BenchError(
            f"benchmark {label!r} failed (exit status {rc}) after {elapsed:.0f} s.\n"
            f"  command: {shlex.join(cmd)}\n  full output: {log_path}\n"
            f"  last lines of its output:\n{tail}")
    return elapsed


def _plan(bench_dir, out_dir, quick):
    """(key, label, script name, argument list, json path) for every run."""
    mode = "quick" if quick else "full"
    runs = []
    for rows in LOOKUP_ROWS[mode]:
        runs.append((f"lookup_{rows}", f"lookup ({rows:,} rows)", "lookup.py",
                     ["--rows", str(rows), *ARGS[mode]["lookup"]]))
    for name in ("filters", "group_embedding", "training", "memory_per_key", "storage",
                 "checkpoint", "data", "distributed"):
        if name in ARGS[mode]:
            runs.append((name, name, f"{name}.py", list(ARGS[mode][name])))
    for _, label, script, _ in runs:
        if not (bench_dir / script).is_file():
            raise BenchError(f"benchmark script {script} (for {label}) not found in "
                             f"{bench_dir}")
    return [(key, label, script, args, out_dir / f"{key}.json")
            for key, label, script, args in runs]


def _supports_json(script_path):
    return '"--json"' in script_path.read_text()


def _shown(path, cwd):
    """`path` relative to `cwd` when inside it (for the report's commands)."""
    path = pathlib.Path(path)
    try:
        return str(path.relative_to(cwd))
    except ValueError:
        return str(path)


def _run_all(bench_dir, out_dir, quick):
    """Runs every planned script; returns {key: result JSON}, the commands
    (as shown in the report) and notes."""
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    plan = _plan(bench_dir, out_dir, quick)
    cwd = bench_dir.parent
    results, commands, notes = {}, [], []
    for i, (key, label, script, args, json_path) in enumerate(plan, 1):
        script_path = bench_dir / script
        if _supports_json(script_path):
            cmd = [sys.executable, str(script_path), *args, "--json", str(json_path)]
            written = json_path
        else:
            # The script writes its JSON next to itself: run a copy in the
            # output folder so the checkout's file is left alone.
            work = out_dir / "work"
            work.mkdir(exist_ok=True)
            for f in bench_dir.glob("*.py"):
                shutil.copy(f, work / f.name)
            cmd = [sys.executable, str(work / script), *args]
            written = work / f"{script_path.stem}.json"
            notes.append(f"`{script}` has no `--json` option: a copy of it ran in "
                         f"`{work}` (so the checkout's `{written.name}` is untouched).")
        shown = shlex.join(["python", _shown(script_path, cwd),
                            *(_shown(c, cwd) for c in cmd[2:])])
        if written != json_path:
            shown += f"  # writes {_shown(bench_dir / written.name, cwd)}"
        commands.append(shown)
        log(f"[{i}/{len(plan)}] {label}: {shown}")
        elapsed = _run_script(label, cmd, logs / f"{key}.log", cwd)
        if written != json_path:
            shutil.move(str(written), json_path)
        with open(json_path) as f:
            results[key] = json.load(f)
        log(f"      done in {elapsed:.1f} s")
    return results, commands, notes


# -- Turning JSON into table rows ----------------------------------------------------

def _row(bench, comparison, ratio, target=None, lower=False):
    """A results-table row: ratio is ours / the other (higher is better for
    us, except memory, where the comparison says so and `lower` makes the
    target a ceiling)."""
    # Judged on the value the report shows (3 decimals), so that a row never
    # reads "0.10 | <= 0.1x | not met".
    shown = round(float(ratio), 3)
    met = target is not None and (shown <= target if lower else shown >= target)
    return {"benchmark": bench, "comparison": comparison, "ratio": float(ratio),
            "target": target, "lower": lower,
            "status": "-" if target is None else ("met" if met else "not met")}


def _lookup_rows(results):
    rows = []
    for key in sorted((k for k in results if k.startswith("lookup_")),
                      key=lambda k: int(k.split("_")[1])):
        data = results[key]
        targets = data.get("targets", {})
        n = data["config"]["rows"]
        for worker in data["workers"]:
            threads = "all cores" if worker["requested_threads"] == 0 else \
                f"{worker['requested_threads']} thread(s)"
            for r in worker["results"]:
                what = f"`lookup.py`: {n:,} keys, dim {r['dim']}, {threads}"
                rows.append(_row(what, "lookups/s, ours / `tf.gather` on a dense "
                                 "variable (hardware bound)", r["ours_vs_dense_gather"],
                                 targets.get("ours_vs_dense_gather")))
                rows.append(_row(what, "lookups/s, ours / `MutableHashTable` + gather "
                                 "(reference)", r["ours_vs_mutable_hash_table"],
                                 targets.get("ours_vs_mutable_hash_table")))
    return rows


def _filters_rows(data):
    c = data["config"]
    what = f"`filters.py`: {c['ids']:,} ids, {data['stream']['singleton_fraction']:.0%} " \
           "of keys seen once"
    rows = []
    for name, label in (("counter", "counter filter"), ("cbf_uint8", "counting Bloom "
                                                        "filter (uint8)")):
        r = data["results"][name]
        rows.append(_row(what, f"lookups/s, {label} / no filter", r["throughput_vs_none"]))
        rows.append(_row(what, f"memory, {label} / no filter (lower is better)",
                         r["memory_vs_none"]))
    return rows


def _group_rows(data):
    c = data["config"]
    what = (f"`group_embedding.py`: {c['features']} features, batch {c['batch']:,}, "
            "fwd+bwd")
    r = data["ratios"]
    return [_row(what, "speed, fused group / separate lookups (time separate / group)",
                 r["separate_over_group"], 1.5),
            _row(what, "speed, fused group / Hashing+Embedding (time keras / group)",
                 r["keras_hashing_over_group"])]


def _training_rows(data):
    c = data["config"]
    what = (f"`training.py`: batch {c['batch']:,}, {c['features']} features, "
            f"Hashing bins {c['bins']:,}")
    ref = "Hashing+Embedding, `keras.optimizers.Adagrad`"
    labels = {"ev_adagrad": "EmbeddingVariable + our Adagrad",
              "ev_adagrad_decay": "EmbeddingVariable + our AdagradDecay",
              "group_adagrad": "GroupEmbedding + our Adagrad"}
    targets = data.get("targets", {})
    rows = []
    for name, label in labels.items():
        key = f"{name}_over_hashing_adagrad"
        if key in data["ratios"]:
            rows.append(_row(what, f"steps/s, {label} / {ref}", data["ratios"][key],
                             targets.get(key)))
    return rows


def _memory_rows(data):
    rows = []
    for r in data["results"]:
        what = f"`memory_per_key.py`: {r['keys']:,} keys, dim {r['dim']}, {r['slots']} slot(s)"
        rows.append(_row(what, f"bytes per key, table / `4*dim*(1+slots)+16` = "
                         f"{r['bound_bytes_per_key']} (lower is better)",
                         r["table_over_bound"], data["target_over_bound"], lower=True))
        rows.append(_row(what, "bytes per key, RSS growth / the same bound (lower is better)",
                         r["rss_over_bound"]))
    return rows


def _storage_rows(data):
    what = (f"`storage.py`: {data['rows']:,} rows, dim {data['config']['dim']}, cache "
            f"{data['config']['cache_fraction']:.0%} of the rows "
            f"(hit rate {data['cache_hit_rate']:.2f})")
    rows = [_row(what, "training steps/s, FILE tier / DRAM", data["file_over_dram"],
                 data["target_file_over_dram"])]
    if "file_over_dram_cpu" in data:
        rows.append(_row(what, "process CPU per training step, DRAM / FILE tier",
                         data["file_over_dram_cpu"]))
    floor = data.get("floor")
    if floor:
        for key, misses in (("measured_misses", "the misses measured"),
                            ("static_bound_misses", "the static bound's misses")):
            for how, label in (("pread", "read by pread"), ("map", "read from a memory map")):
                rows.append(_row(what, f"FILE/DRAM at the file floor ({misses}, {label}; "
                                 "no table can exceed it)",
                                 floor[key][how]["file_over_dram"]))
    rows.append(_row(what, f"bytes on disk per key / `4*dim*(1+slots)` = "
                     f"{data['row_bound_bytes_per_key']} (lower is better)",
                     data["disk_over_bound"]))
    return rows


def _checkpoint_rows(data):
    what = f"`checkpoint.py`: {data['rows']:,} rows, dim {data['dim']}"
    rows = []
    for share, target in (("1%", 0.1), ("10%", None)):
        r = data[f"incremental_{share}"]
        rows.append(_row(what, f"seconds, incremental save ({share} of rows changed) / full "
                         "save (lower is better)", r["time_ratio"], target, lower=True))
        rows.append(_row(what, f"bytes, incremental save ({share} changed) / full save "
                         "(lower is better)", r["bytes_ratio"], lower=True))
    rows.append(_row(what, "seconds, restore of full + 10 incremental links / one full "
                     "(lower is better)", data["restore"]["ratio"], lower=True))
    return rows


def _data_rows(data):
    what = f"`data.py`: {data['config']['rows']:,}-row Criteo-like Parquet"
    rows = [_row(what, "rows/s, ParquetDataset / `pyarrow.parquet.read_table` (bound)",
                 data["parquet_ratio"]["ours/raw"], 0.8),
            _row(what, "rows/s, pandas + `from_tensor_slices` / `read_table`",
                 data["parquet_ratio"]["naive/raw"])]
    kafka = data.get("kafka_messages_per_s") or {}
    if kafka.get("per_message"):
        rows.append(_row(f"`data.py`: Kafka, {data['config']['messages']:,} messages",
                         "messages/s, KafkaDataset(batch_size) / one message per element",
                         kafka["batched"] / kafka["per_message"]))
    return rows


def _storage_scale_rows(data):
    """Rows of a stored `storage.py --scale` result (see STORED_SCALE_JSON)."""
    what = (f"`storage.py --scale` (stored result of {data['date']}: "
            f"`{data['command']}`): {data['keys_filled']:,} ids x dim "
            f"{data['config']['dim']} + Adagrad, cache {data['cache_bytes'] / 2**30:.0f} GiB, "
            f"{data['steps_per_s']:.2f} steps/s, hit rate {data['cache_hit_rate']:.2f}, "
            f"{data['table_memory_bytes_per_key']:.0f} B/key of table DRAM")
    return [_row(what, "peak RSS / 6 GiB (lower is better)",
                 data["peak_rss_bytes"] / data["target_peak_rss_bytes"], 1.0, lower=True),
            _row(what, f"bytes on disk per key / `4*dim*(1+slots)` = "
                 f"{data['row_bound_bytes_per_key']} (lower is better)",
                 data["disk_over_bound"])]


def stored_scale_result(bench_dir):
    """The stored --scale result under bench_dir, or None."""
    path = pathlib.Path(bench_dir) / STORED_SCALE_JSON
    if not path.is_file():
        return None
    return json.loads(path.read_text())


# Issue 39's targets for MultiWorkerMirroredStrategy workers against one
# plain process (CPU of every process per step) and bytes sent against the
# all-to-all ideal, by worker count.
DISTRIBUTED_CPU_TARGETS = {2: 1.6, 4: 2.0}
DISTRIBUTED_BYTES_TARGET = 1.5


def _distributed_rows(data, stored=False):
    """Rows of a `distributed.py` result: for each MultiWorkerMirroredStrategy
    run, CPU seconds of every process per step against one plain process,
    and the bytes the processes' sockets sent per step against the
    all-to-all ideal; MirroredStrategy runs (one process) give steps/s."""
    a = data["args"]
    source = (f" (stored result of {data['date']}: `{data['command']}`)" if stored else "")
    results = data["results"]
    rows = []
    mirrored = results.get("mirrored", [])
    if mirrored:
        plain = mirrored[0].get("plain_steps_per_s") or mirrored[0]["steps_per_s"]
        for r in mirrored[1:]:
            what = (f"`distributed.py`{source}: MirroredStrategy, {r['replicas']} logical "
                    f"CPU devices, {a['features']} tables x dim {a['dim']}, global batch "
                    f"{a['batch']:,} x {a['ids']} ids")
            rows.append(_row(what, "steps/s / one process without a strategy",
                             r["steps_per_s"] / plain))
    cluster = results.get("cluster", [])
    if cluster:
        plain = cluster[0]["cpu_s_per_step"]
        for r in cluster[1:]:
            n = r["workers"]
            tables = (f"{a['features']} tables x dim {a['dim']}"
                      + (" in one GroupEmbedding" if a.get("group") else ""))
            what = (f"`distributed.py`{source}: MultiWorkerMirroredStrategy, {n} worker "
                    f"processes, {tables}, global batch {a['batch']:,} x {a['ids']} ids")
            rows.append(_row(what, "CPU s of every process per step / one plain process "
                             "(lower is better)", r["cpu_s_per_step"] / plain,
                             DISTRIBUTED_CPU_TARGETS.get(n), lower=True))
            if r["ideal_bytes_per_step"]:
                rows.append(_row(what, "bytes sent per step / all-to-all ideal "
                                 "(lower is better)",
                                 r["bytes_per_step"] / r["ideal_bytes_per_step"],
                                 DISTRIBUTED_BYTES_TARGET, lower=True))
    return rows


def _distributed_ps_rows(data):
    """Rows of a stored `distributed.py --ps` result: for each worker count,
    examples/s of all workers, CPU seconds of every process (PS tasks
    included) per example, both against one plain process, and the bytes
    every socket sent per worker step against the ideal exchange."""
    a, results = data["args"], data["results"]
    source = f" (stored result of {data['date']}: `{data['command']}`)"
    rows = []
    for r in results["ps"]:
        what = (f"`distributed.py`{source}: {r['workers']} asynchronous workers, "
                f"{r['ps_tasks']} parameter servers (tables and dense weights), "
                f"{a['features']} tables x dim {a['dim']}, batch {a['batch']:,} x "
                f"{a['ids']} ids a worker")
        rows.append(_row(what, "examples/s of all workers / one plain process",
                         r["examples_per_s"] / results["plain_examples_per_s"]))
        rows.append(_row(what, "CPU s of every process per example / one plain process "
                         "(lower is better)",
                         r["cpu_s_per_example"] / results["plain_cpu_s_per_example"],
                         lower=True))
        rows.append(_row(what, "bytes sent per worker step / ideal (lower is better)",
                         r["bytes_per_step"] / r["ideal_bytes_per_step"], lower=True))
    return rows


def stored_distributed_ps_result(bench_dir):
    """The stored `distributed.py --ps` result under bench_dir, or None."""
    path = pathlib.Path(bench_dir) / STORED_DISTRIBUTED_PS_JSON
    return json.loads(path.read_text()) if path.is_file() else None


def stored_distributed_result(bench_dir, name=STORED_DISTRIBUTED_JSON):
    """The stored `distributed.py` result under bench_dir (`name`: its
    separate-layer run, or `STORED_DISTRIBUTED_GROUP_JSON`, the same tables
    in one GroupEmbedding), or None."""
    path = pathlib.Path(bench_dir) / name
    return json.loads(path.read_text()) if path.is_file() else None


def table_rows(results):
    rows = _lookup_rows(results)
    for key, fn in (("filters", _filters_rows), ("group_embedding", _group_rows),
                    ("training", _training_rows), ("memory_per_key", _memory_rows),
                    ("storage", _storage_rows), ("checkpoint", _checkpoint_rows),
                    ("data", _data_rows), ("distributed", _distributed_rows)):
        if key in results:
            rows.extend(fn(results[key]))
    for r in rows:
        if not math.isfinite(r["ratio"]):
            raise BenchError(f"{r['benchmark']}: {r['comparison']} is not a number "
                             f"({r['ratio']})")
    return rows


# -- Plots ---------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise BenchError("`keras-rec-emb bench` draws its plots with matplotlib, which "
                         "is not installed: pip install \"keras-rec-emb[bench]\"") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _human(n):
    for unit, div in (("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


def _bar_plot(plt, path, values, is_ours, ylabel, title, rotate=0):
    """One bar per path of `values` ({name: value}), labelled with its
    value: blue where `is_ours(name)`, else gray."""
    names = list(values)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bars = ax.bar(names, [values[n] for n in names],
                  color=["tab:blue" if is_ours(n) else "tab:gray" for n in names])
    ax.bar_label(bars, fmt="%.1f")
    ax.margins(y=0.12)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if rotate:
        ax.tick_params(axis="x", labelrotation=rotate)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_plots(results, out_dir):
    """Writes the PNGs; returns {plot key: file name}."""
    plt = _pyplot()
    made = {}

    lookups = sorted((results[k] for k in results if k.startswith("lookup_")),
                     key=lambda d: d["config"]["rows"])
    if lookups:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        sizes = [d["config"]["rows"] for d in lookups]
        labels = {"dense_gather": "tf.gather, dense (bound)",
                  "mutable_hash_table": "MutableHashTable + gather",
                  "ours": "ours (inference)", "ours_insert": "ours (training, insert)"}
        worker = lambda d: d["workers"][-1]["results"][-1]
        for path, label in labels.items():
            ax.plot(sizes, [worker(d)["paths"][path]["lookups_per_s"] / 1e6 for d in lookups],
                    marker="o", label=label)
        r = worker(lookups[0])
        ax.set_xscale("log")
        ax.set_xticks(sizes, [_human(n) for n in sizes])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("keys in the table")
        ax.set_ylabel("million lookups/s")
        ax.set_title(f"Lookup throughput vs table size (dim {r['dim']}, batch "
                     f"{lookups[0]['config']['batch']:,} Zipf ids)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / PLOTS["lookup"], dpi=100)
        plt.close(fig)
        made["lookup"] = PLOTS["lookup"]

    if "training" in results:
        d = results["training"]
        c = d["config"]
        _bar_plot(plt, out_dir / PLOTS["training"], d["steps_per_s"],
                  lambda n: n != "hashing_adagrad",
                  "training steps/s (model.fit)",
                  f"Training: EV vs Hashing+Embedding (batch {c['batch']}, "
                  f"{c['features']} features)", rotate=15)
        made["training"] = PLOTS["training"]

    if "group_embedding" in results:
        d = results["group_embedding"]
        c = d["config"]
        _bar_plot(plt, out_dir / PLOTS["group"],
                  {n: 1e3 * s for n, s in d["median_s"].items()}, lambda n: n == "group",
                  "ms per forward+backward step (lower is better)",
                  f"Fused group vs separate lookups ({c['features']} features, "
                  f"batch {c['batch']})")
        made["group"] = PLOTS["group"]
    return made


# -- Peers (benchmarks/peers/run.py) -------------------------------------------------

def stored_peers_result(bench_dir):
    """The stored peers result under bench_dir (STORED_PEERS_JSON), or None."""
    path = pathlib.Path(bench_dir) / STORED_PEERS_JSON
    return json.loads(path.read_text()) if path.is_file() else None


def paired_ratios(a, b, key):
    """Per-round ratios of two frameworks' results measured in the same
    interleaved rounds: a / b for steps/s, b / a for forward ms (above 1:
    `a` faster). Returns {"median", "min", "max"} or None."""
    ra, rb = a.get("rounds"), b.get("rounds")
    if not ra or not rb or len(ra) != len(rb):
        return None
    if key == "steps_per_s":
        values = sorted(x[key] / y[key] for x, y in zip(ra, rb))
    else:
        values = sorted(y[key] / x[key] for x, y in zip(ra, rb))
    n = len(values)
    median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return {"median": median, "min": values[0], "max": values[-1]}


def _peer_cell(r, key, unit, ref=None):
    """Median value; ratio to ours (framework / ours, above 1 faster than
    ours): the median of the per-round ratios, with their range."""
    s = r[key]
    cell = f"{s['median']:.3g} {unit}"
    ratio = None if ref is None else paired_ratios(r, ref, key)
    if ratio is not None:
        cell += f", {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
    else:
        old = r.get("train_vs_ours" if key == "steps_per_s" else "lookup_vs_ours")
        if old is not None:
            cell += f", {old:.2f}x"
        cell += f" (±{50 * s['spread']:.0f}%)"
    return cell


# Issue 19's targets: ours (GroupEmbedding) against the faster TorchRec path
# and against 26 separate layers, per (variant, threads).
PEER_TARGETS = (("training steps/s, ours / TorchRec", "steps_per_s", "torchrec", 1.2),
                ("forward lookup, TorchRec ms / ours", "lookup_ms", "torchrec", 1.0),
                ("training steps/s, group / separate", "steps_per_s", "ours_separate", 1.0),
                ("forward lookup, separate ms / group", "lookup_ms", "ours_separate", 1.0))


def peer_target_rows(data):
    """Rows (config, comparison, paired ratio, target, met) of PEER_TARGETS;
    "torchrec" is whichever TorchRec path has the better median."""
    rows = []
    for key, res in data["results"].items():
        fw = res["frameworks"]
        ours = fw.get("ours_group")
        if ours is None:
            continue
        for what, metric, peer, target in PEER_TARGETS:
            cands = [n for n in ("torchrec_tbe", "torchrec_dmp") if n in fw] \
                if peer == "torchrec" else [peer] * (peer in fw)
            if not cands:
                continue
            sign = 1 if metric == "steps_per_s" else -1
            best = max(cands, key=lambda n: sign * fw[n][metric]["median"])
            ratio = paired_ratios(ours, fw[best], metric)
            if ratio is None:
                continue
            rows.append({"config": key, "comparison": what.replace("TorchRec", fw[best][
                "label"].split(" (")[0] if peer == "torchrec" else "TorchRec"),
                "ratio": ratio, "target": target, "met": ratio["median"] >= target})
    return rows


def peers_markdown(data):
    """Markdown lines for the peers JSON: per thread count a table of
    steps/s and forward ms (ratio framework / ours GroupEmbedding, above 1
    faster than ours: median and range of the per-round ratios), then
    issue 19's targets, CPU time per step, the loss check and bytes per key."""
    res = data["results"]
    w, m = data["workload"], data["method"]
    load = [x["load_avg"] for r in res.values() for f in r["frameworks"].values()
            for x in f.get("rounds", []) if "load_avg" in x]
    lines = [f"Peers measured {data['date']}{' (quick mode: not for quoting)' if data['quick'] else ''}: "
             f"{w['features']} features, dim {w['dim']}, batch {w['batch']:,}, ids Zipf({w['zipf_a']}) "
             f"over {w['vocab']:,} values, Adagrad lr {w['learning_rate']}; median of "
             f"{m['rounds']} interleaved rounds of {m['steps']} steps and {m['lookups']} lookups"
             + (f", OMP_WAIT_POLICY={m['omp_wait_policy']}" if "omp_wait_policy" in m else "")
             + (", TorchRec with THP_MEM_ALLOC_ENABLE=1" if m.get("torch_huge_pages") else "")
             + (f"; machine load (1-min average) {min(load):.1f}-{max(load):.1f} during the rounds"
                if load else "") + ". "
             "Ratios are framework / ours (GroupEmbedding), median (min-max) of the "
             "per-round ratios: above 1 is faster than ours.", ""]
    if data.get("command"):
        lines += [f"Command: `{data['command']}`", ""]
    threads = sorted({r["threads"] for r in res.values()})
    variants = [v for v in ("single", "multi") if any(r["variant"] == v for r in res.values())]
    vname = {"single": "1 id", "multi": "1-5 ids"}
    for t in threads:
        cols = [(v, f"{v}-{t}t") for v in variants if f"{v}-{t}t" in res]
        names = list(dict.fromkeys(n for _, k in cols for n in res[k]["frameworks"]))
        lines += [f"{t} thread{'s' * (t > 1)}:", "",
                  "| framework | " + " | ".join(f"train, {vname[v]} | forward lookup, {vname[v]}"
                                                 for v, _ in cols) + " |",
                  "|---|" + "---|" * (2 * len(cols))]
        for n in names:
            cells = []
            for _, k in cols:
                fw = res[k]["frameworks"]
                r, ref = fw.get(n), fw.get(data.get("reference", "ours_group"))
                cells += ["-", "-"] if r is None else [
                    _peer_cell(r, "steps_per_s", "steps/s", ref),
                    _peer_cell(r, "lookup_ms", "ms", ref)]
            label = next(res[k]["frameworks"][n]["label"] for _, k in cols
                         if n in res[k]["frameworks"])
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    targets = peer_target_rows(data)
    if targets:
        lines += ["Issue 19's targets (ours = GroupEmbedding; paired per-round ratios, "
                  "median (min-max); met when the median reaches the target):", "",
                  "| configuration | comparison | ratio | target | met |", "|---|---|---|---|---|"]
        for r in targets:
            q = r["ratio"]
            lines.append(f"| {r['config']} | {r['comparison']} | {q['median']:.2f} "
                         f"({q['min']:.2f}-{q['max']:.2f}) | >= {r['target']:g} | "
                         f"{'yes' if r['met'] else 'no'} |")
        lines.append("")
    keys = [k for k in res if any("cpu_ms_per_step" in f for f in res[k]["frameworks"].values())]
    if keys:
        names = list(dict.fromkeys(n for k in keys for n in res[k]["frameworks"]))
        lines += ["CPU time per training step (ms, all threads of the process, median of "
                  "rounds): less sensitive to the other jobs than wall time.", "",
                  "| framework | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for n in names:
            cells = [f"{res[k]['frameworks'][n]['cpu_ms_per_step']['median']:.0f}"
                     if n in res[k]["frameworks"] else "-" for k in keys]
            label = next(res[k]["frameworks"][n]["label"] for k in keys
                         if n in res[k]["frameworks"])
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    keys = [k for k in res if any("loss_initial" in f for f in res[k]["frameworks"].values())]
    if keys:
        lines += ["Loss check (binary cross-entropy on the first batch before any step -> "
                  "after the warm-up pass of one step per batch): the same model "
                  "trained at the same pace in every framework.", "",
                  "| framework | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        names = list(dict.fromkeys(n for k in keys for n in res[k]["frameworks"]))
        for n in names:
            cells = []
            for k in keys:
                f = res[k]["frameworks"].get(n)
                cells.append("-" if f is None else
                             f"{f['loss_initial']:.3f} -> {f['loss_after_warmup']:.3f}")
            label = next(res[k]["frameworks"][n]["label"] for k in keys
                         if n in res[k]["frameworks"])
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Bytes per distinct key seen (table: the framework's own size with Adagrad "
              "state; RSS: process growth from model build to after warm-up), 1 thread:", "",
              "| framework | " + " | ".join(f"table, {vname[v]} | RSS, {vname[v]}"
                                             for v in variants) + " |",
              "|---|" + "---|" * (2 * len(variants))]
    t0 = threads[0]
    names = list(dict.fromkeys(n for v in variants for n in res.get(f"{v}-{t0}t", {}).get(
        "frameworks", {})))
    for n in names:
        cells, label = [], n
        for v in variants:
            r = res.get(f"{v}-{t0}t", {}).get("frameworks", {}).get(n)
            if r is None:
                cells += ["-", "-"]
                continue
            label = r["label"]
            bt = r["bytes_per_key_table"]
            cells += ["-" if bt is None else f"{bt:,.0f}", f"{r['bytes_per_key_rss']:,.0f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if data.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in data["skipped"].items())]
    lines += [""] + data["notes"] if data.get("notes") else []
    m = data["machine"]
    thp = m.get("transparent_hugepages")
    thp = f", transparent huge pages `{thp}`" if thp else ""
    lines += ["", f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, {m['memory_gib']} GiB{thp}."]
    return lines


def peers_plot(data, path):
    """Grouped bars per (variant, threads), one bar per framework (median,
    min-max whiskers over the rounds): training steps/s above, forward
    lookup ms below (log scales: stock Keras is 100x slower)."""
    plt = _pyplot()
    res = data["results"]
    keys = list(res)
    names = list(dict.fromkeys(n for k in keys for n in res[k]["frameworks"]))
    fig, axes = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    width = 0.8 / max(len(names), 1)
    cmap = plt.get_cmap("tab10")
    for ax, metric, ylabel in ((axes[0], "steps_per_s", "training steps/s (higher is better)"),
                               (axes[1], "lookup_ms", "forward lookup ms (lower is better)")):
        for i, n in enumerate(names):
            xs, med, lo, hi = [], [], [], []
            for j, k in enumerate(keys):
                r = res[k]["frameworks"].get(n)
                if r is None:
                    continue
                xs.append(j + i * width)
                med.append(r[metric]["median"])
                lo.append(r[metric]["median"] - r[metric]["min"])
                hi.append(r[metric]["max"] - r[metric]["median"])
            label = res[next(k for k in keys if n in res[k]["frameworks"])]["frameworks"][n][
                "label"]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=label, color=cmap(i))
        ax.set_yscale("log")
        ax.set_ylabel(ylabel, fontsize=8)
    axes[1].set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))],
                       [f"{res[k]['variant']}, {res[k]['threads']} thr" for k in keys])
    axes[0].set_title(f"Peers ({data['date']}): batch {data['workload']['batch']}, "
                      f"{data['workload']['features']} features, dim {data['workload']['dim']}")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- The report ----------------------------------------------------------------------

def _machine(bench_dir):
    spec = importlib.util.spec_from_file_location("_kre_bench_machine",
                                                  bench_dir / "_machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    info = module.machine_info()
    for name in ("keras-rec-emb", "matplotlib"):
        try:
            info["versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["versions"][name] = "not installed"
    return info


def _fmt_target(t, lower=False):
    return "-" if t is None else f"{'<=' if lower else '>='} {t:g}x"


def write_report(out_dir, quick, machine, rows, plots, commands, notes, elapsed,
                 stored_peers=None):
    mode = "quick (small sizes: for checking the pipeline, not for quoting)" if quick \
        else "full"
    lines = [
        "# keras-rec-emb benchmark report",
        "",
        f"Written {datetime.datetime.now().isoformat(timespec='seconds')} by "
        f"`keras-rec-emb bench{' --quick' if quick else ''}` in {elapsed:.0f} s. "
        f"Mode: {mode}.",
        "",
        "## Machine",
        "",
        f"- CPU: {machine['cpu_model']}, {machine['cpu_count']} cores "
        f"({machine['cpus_available']} available to this process)",
        f"- Memory: {machine['memory_gib']} GiB, transparent huge pages "
        f"`{machine.get('transparent_hugepages')}`",
        f"- Platform: {machine['platform']}, Python {machine['python']}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in machine["versions"].items()),
        "",
        "## Results",
        "",
        "Each ratio is ours / the other path, measured side by side in one process "
        "(higher is better, except memory). Noisy machines move ratios by 10-30%.",
        "",
        "| benchmark | comparison | ratio | target | status |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['benchmark']} | {r['comparison']} | {r['ratio']:.3f} | "
                     f"{_fmt_target(r['target'], r.get('lower', False))} | {r['status']} |")
    peers = out_dir / PEERS_JSON
    if peers.is_file() or stored_peers is not None:
        if peers.is_file():
            data = json.loads(peers.read_text())
            source = (f"From `{PEERS_JSON}` (`make bench-peers` / "
                      "`python benchmarks/peers/run.py`).")
        else:
            data = stored_peers
            source = (f"Stored result `benchmarks/{STORED_PEERS_JSON}` of {data['date']} "
                      "(not rerun: `make bench-peers` needs the TorchRec and TFRA "
                      "virtualenvs; its fresh `peers.json` in this folder replaces it).")
        lines += ["", "## Peers (TorchRec, TFRA, stock Keras)", "", source,
                  ""] + peers_markdown(data)
        if not (out_dir / PEERS_PLOT).is_file():
            peers_plot(data, out_dir / PEERS_PLOT)
        plots = {**plots, "peers": PEERS_PLOT}
    lines += ["", "## Plots", ""]
    titles = {"lookup": "Lookup throughput vs table size",
              "training": "Training steps/s: EmbeddingVariable vs Hashing+Embedding",
              "group": "Fused vs unfused group lookup",
              "peers": "Training steps/s and forward ms against the peers"}
    for key, name in plots.items():
        lines += [f"### {titles[key]}", "", f"![{titles[key]}]({name})", ""]
    lines += ["## Commands", "",
              "Run from the repository root (`python` is the interpreter that ran the "
              f"benchmarks: `{sys.executable}`); JSON results and logs are in this folder.",
              "", "```sh", *commands, "```", "", "## Notes", ""]
    if quick:
        notes = [f"Skipped in quick mode: {why}." for why in QUICK_SKIPPED.values()] + notes
    notes = notes or ["None."]
    lines += [f"- {n}" for n in notes] + [""]
    path = out_dir / REPORT_NAME
    path.write_text("\n".join(lines))
    return path


def run(output_dir=DEFAULT_OUTPUT_DIR, quick=False, benchmarks_dir=None):
    """Runs the benchmarks and writes `output_dir/report.md`.

    Args:
        output_dir: str or path. Folder for report.md, the PNGs, every
            benchmark's JSON and log. Created if missing. Defaults to
            `"bench-report"`.
        quick: bool. Small sizes (about a minute on 2 cores; the data
            benchmark is skipped). Defaults to `False` (about 10 minutes).
        benchmarks_dir: `None` or path of the checkout's `benchmarks/`.
            Defaults to `None`: the folder next to the package.

    Returns:
        The `pathlib.Path` of report.md.

    Raises:
        BenchError: the benchmarks folder or a script is missing, or a
            benchmark failed (its name, command and output's tail).
    """
    bench_dir = find_benchmarks_dir(benchmarks_dir)
    out_dir = pathlib.Path(output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log(f"keras-rec-emb bench ({'quick' if quick else 'full'}): scripts in {bench_dir}, "
        f"report in {out_dir}")
    results, commands, notes = _run_all(bench_dir, out_dir, quick)
    rows = table_rows(results)
    stored = stored_scale_result(bench_dir)
    if stored is not None:
        rows.extend(_storage_scale_rows(stored))
        notes.append(f"The `storage.py --scale` rows are the stored result "
                     f"`benchmarks/{STORED_SCALE_JSON}` of {stored['date']} (not rerun).")
    distributed = stored_distributed_result(bench_dir)
    if "distributed" not in results and distributed is not None:
        rows.extend(_distributed_rows(distributed, stored=True))
        notes.append(f"The `distributed.py` rows are the stored result "
                     f"`benchmarks/{STORED_DISTRIBUTED_JSON}` of {distributed['date']} "
                     f"(not rerun: `--quick` leaves out the cluster start-ups).")
    group = stored_distributed_result(bench_dir, STORED_DISTRIBUTED_GROUP_JSON)
    if group is not None:
        rows.extend(_distributed_rows(group, stored=True))
        notes.append(f"The `distributed.py --group` rows are the stored result "
                     f"`benchmarks/{STORED_DISTRIBUTED_GROUP_JSON}` of {group['date']} "
                     "(not rerun: cluster start-ups take minutes).")
    distributed_ps = stored_distributed_ps_result(bench_dir)
    if distributed_ps is not None:
        rows.extend(_distributed_ps_rows(distributed_ps))
        notes.append(f"The `distributed.py --ps` rows are the stored result "
                     f"`benchmarks/{STORED_DISTRIBUTED_PS_JSON}` of {distributed_ps['date']} "
                     "(not rerun: cluster start-ups take minutes).")
    plots = make_plots(results, out_dir)
    path = write_report(out_dir, quick, _machine(bench_dir), rows, plots, commands,
                        notes, time.perf_counter() - start,
                        stored_peers=stored_peers_result(bench_dir))
    log(f"wrote {path} ({time.perf_counter() - start:.0f} s in all)")
    return path


# -- Command line ----------------------------------------------------------------------

def add_arguments(parser):
    """Adds `bench`'s options to an argparse parser (or subparser)."""
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help="folder for report.md, plots, JSON and logs "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, about a minute; skips the data benchmark")
    parser.add_argument("--benchmarks-dir", default=None,
                        help="the checkout's benchmarks/ folder (default: the folder "
                             "of this report.py)")
    return parser


def command(args):
    """Runs `bench` for parsed arguments; returns the exit status (errors go
    to stderr as one clear message, without a traceback)."""
    try:
        path = run(args.output_dir, quick=args.quick, benchmarks_dir=args.benchmarks_dir)
    except BenchError as e:
        print(f"keras-rec-emb bench: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv=None, prog=None):
    """Parses `argv` (default: the command line) and runs `bench`; returns
    the exit status. `prog` names the command in help and errors."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    return command(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
