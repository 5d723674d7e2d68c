"""Lookups per second of existing keys: keras_rec_emb's table vs the baselines.

Three paths read the same rows for the same batch of keys, side by side in
one process:

* ``dense_gather``: ``tf.gather`` on a dense ``tf.Variable`` holding the rows
  at positions 0..N-1, given the batch keys' positions (precomputed outside
  the timing). The hardware bound: no hashing at all.
* ``mutable_hash_table``: ``tf.lookup.experimental.MutableHashTable`` from key
  to row position, then ``tf.gather`` on the same dense variable. The stock
  TensorFlow way to serve dynamic ids.
* ``ours``: ``EmbeddingTable.lookup(keys, insert=False)``, the inference
  lookup.

``ours_insert`` (``lookup(keys, insert=True)``, the training path) is timed
for reference only: the table already holds every key, so it does not grow.

Data: N distinct random 63-bit keys (not 0..N-1) with random float32 rows; a
batch of B ids drawn from a Zipf distribution (numpy, ``a`` = --zipf-a,
truncated to N by redrawing larger values) over the key ranks, mapped to keys
through a random permutation so the hot keys are spread over the table.

Timing: each path is one ``tf.function`` that looks up the whole batch and
returns the [B, dim] rows (everything is on the CPU and eager calls are
synchronous, so the call returns once the rows are written; no device-to-host
copy for any path). After --warmup calls, the paths are called round-robin
--reps times and each path's median wall time is reported as lookups/s = B /
median (the JSON also keeps every time and the minimum). Outside the timing,
every path's rows are checked to equal the dense gather's.

Threads: TensorFlow's intra-op pool (which our op splits its work over) can
only be sized before the runtime starts, so each --threads setting runs in a
fresh subprocess of this script; 1 means one thread (intra- and inter-op
pools of size 1), 0 means TensorFlow's default (all cores). The parent prints
one table row per (dim, threads) and writes everything to --json, with the
machine (CPU model and count, memory) and the TensorFlow/Keras versions.

Targets (from the issues): ours >= 0.8x dense_gather (issue 19) and >= 5x
mutable_hash_table.

Run from the repository root:

    PYTHONPATH=. .venv/bin/python benchmarks/lookup.py               # 10M rows
    PYTHONPATH=. .venv/bin/python benchmarks/lookup.py --rows 200000 --batch 50000

Memory: per dim a worker holds the numpy rows, the dense variable and our
table (whose arenas round up, ~4.5 GB for 10M x 64); peak RSS is about 12 GB
at 10M x 64. One dim is freed before the next is built. The full default run
takes about 2 minutes (mostly setup) on 2 cores.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

from _machine import machine_info

TARGET_VS_DENSE = 0.8  # issue 19, item 4 (was 0.5)
TARGET_VS_MHT = 5.0
PATHS = ("dense_gather", "mutable_hash_table", "ours", "ours_insert")
IMPORT_CHUNK_ROWS = 1 << 20
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lookup.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="keys in the table")
    p.add_argument("--batch", type=int, default=1_000_000, help="ids per lookup")
    p.add_argument("--dims", default="16,64", help="comma-separated row widths")
    p.add_argument("--threads", default="1,0",
                   help="comma-separated intra-op thread counts; 0 = all cores")
    p.add_argument("--reps", type=int, default=10, help="timed calls per path")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per path")
    p.add_argument("--zipf-a", type=float, default=1.1, help="Zipf exponent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=DEFAULT_JSON, help="where to write results")
    # Internal: run one thread setting in this process (see run_worker).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dims = [int(d) for d in args.dims.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    return args


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# -- Data ----------------------------------------------------------------------

def make_keys(rng, n):
    """n distinct random positive 63-bit int64 keys."""
    draws = rng.integers(1, np.iinfo(np.int64).max, size=n + n // 100 + 16,
                         dtype=np.int64)
    keys = np.unique(draws)[:n]
    assert keys.size == n, "too many duplicate random keys"
    rng.shuffle(keys)
    return keys


def zipf_positions(rng, n, size, a):
    """`size` row positions in [0, n) whose ranks follow Zipf(a) truncated to
    n; rank r is row perm[r - 1] of a random permutation."""
    ranks = np.empty(0, np.int64)
    while ranks.size < size:
        draw = rng.zipf(a, size)
        ranks = np.concatenate([ranks, draw[draw <= n]])
    return rng.permutation(n)[ranks[:size] - 1]


# -- Paths -----------------------------------------------------------------------

def build_table(dim, keys, values):
    """Our table with the given rows, imported in chunks to bound memory."""
    table = EmbeddingTable(dim, "int64", np.zeros((1, dim), np.float32))
    for start in range(0, keys.size, IMPORT_CHUNK_ROWS):
        end = start + IMPORT_CHUNK_ROWS
        table.import_({"keys": keys[start:end], "values": values[start:end]},
                      clear=start == 0)
    assert table.size() == keys.size
    return table


def build_mutable_hash_table(keys):
    """MutableHashTable from key to its row position in the dense variable."""
    mht = tf.lookup.experimental.MutableHashTable(
        key_dtype=tf.int64, value_dtype=tf.int64, default_value=-1)
    mht.insert(tf.constant(keys), tf.range(keys.size, dtype=tf.int64))
    return mht


def make_path_fns(dense, mht, table):
    """One tf.function per path, each taking its batch input."""
    return {
        "dense_gather": tf.function(lambda positions: tf.gather(dense, positions)),
        "mutable_hash_table": tf.function(
            lambda keys: tf.gather(dense, mht.lookup(keys))),
        "ours": tf.function(lambda keys: table.lookup(keys, insert=False)),
        "ours_insert": tf.function(lambda keys: table.lookup(keys, insert=True)),
    }


def time_paths(fns, inputs, warmup, reps):
    """Per path, wall seconds of `reps` calls made round-robin after warm-up."""
    for name, fn in fns.items():
        for _ in range(warmup):
            fn(inputs[name])
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(inputs[name])
            times[name].append(time.perf_counter() - start)
    return times


def check_paths(fns, inputs):
    """Every inference path returns exactly the dense gather's rows."""
    expected = fns["dense_gather"](inputs["dense_gather"]).numpy()
    for name in ("mutable_hash_table", "ours"):
        got = fns[name](inputs[name]).numpy()
        if not np.array_equal(got, expected):
            raise AssertionError(f"{name} rows differ from the dense gather")


def bench_dim(dim, keys, positions, mht, rng, opts):
    """Builds the dense variable and our table for `dim`, checks and times
    every path; everything of this dim is freed on return."""
    t0 = time.perf_counter()
    values = rng.random((keys.size, dim), dtype=np.float32)
    dense = tf.Variable(values)
    t1 = time.perf_counter()
    table = build_table(dim, keys, values)
    t2 = time.perf_counter()
    del values
    log(f"  dim {dim}: dense variable {t1 - t0:.1f}s, our import {t2 - t1:.1f}s")

    batch_keys = tf.constant(keys[positions])
    inputs = {"dense_gather": tf.constant(positions), "mutable_hash_table": batch_keys,
              "ours": batch_keys, "ours_insert": batch_keys}
    fns = make_path_fns(dense, mht, table)
    check_paths(fns, inputs)
    times = time_paths(fns, inputs, opts.warmup, opts.reps)
    assert table.size() == keys.size, "insert=True of existing keys grew the table"

    paths = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        paths[name] = {"median_s": median, "min_s": min(ts),
                       "lookups_per_s": positions.size / median, "times_s": ts}
    return {
        "dim": dim,
        "setup_s": {"dense_variable": t1 - t0, "our_import": t2 - t1},
        "our_memory_bytes": table.memory_bytes(),
        "paths": paths,
        **ratios(paths),
    }


def ratios(paths):
    ours = paths["ours"]["lookups_per_s"]
    vs_dense = ours / paths["dense_gather"]["lookups_per_s"]
    vs_mht = ours / paths["mutable_hash_table"]["lookups_per_s"]
    return {"ours_vs_dense_gather": vs_dense, "ours_vs_mutable_hash_table": vs_mht,
            "meets_dense_target": vs_dense >= TARGET_VS_DENSE,
            "meets_mht_target": vs_mht >= TARGET_VS_MHT}


# -- Processes ---------------------------------------------------------------------

def worker(opts):
    """Measures every dim with opts.threads[0] threads; writes JSON to opts.json."""
    # Must precede the first TF op, which starts the runtime and its pools.
    threads = opts.threads[0]
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)

    rng = np.random.default_rng(opts.seed)
    t0 = time.perf_counter()
    keys = make_keys(rng, opts.rows)
    positions = zipf_positions(rng, opts.rows, opts.batch, opts.zipf_a)
    t1 = time.perf_counter()
    mht = build_mutable_hash_table(keys)
    t2 = time.perf_counter()
    log(f"threads={threads}: keys and batch {t1 - t0:.1f}s, "
        f"MutableHashTable insert {t2 - t1:.1f}s")

    results = []
    for dim in opts.dims:
        results.append({"threads": threads,
                        **bench_dim(dim, keys, positions, mht, rng, opts)})
        gc.collect()
    out = {
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "unique_ids_in_batch": int(np.unique(positions).size),
        "setup_s": {"keys_and_batch": t1 - t0, "mutable_hash_table_insert": t2 - t1},
        "results": results,
    }
    with open(opts.json, "w") as f:
        json.dump(out, f)


def run_worker(threads, opts):
    """Runs one thread setting in a fresh process and returns its results."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "worker.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               "--rows", str(opts.rows), "--batch", str(opts.batch),
               "--dims", ",".join(map(str, opts.dims)), "--threads", str(threads),
               "--reps", str(opts.reps), "--warmup", str(opts.warmup),
               "--zipf-a", str(opts.zipf_a), "--seed", str(opts.seed), "--json", path]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        subprocess.run(cmd, check=True, env=env)
        with open(path) as f:
            return json.load(f)


# -- Report --------------------------------------------------------------------------

def print_report(config, workers):
    head = (f"{'dim':>4} {'threads':>8} | {'dense_gather':>12} {'MutableHT':>12} "
            f"{'ours':>12} | {'ours/dense':>10} {'ours/MHT':>9} | {'ours_insert':>12}")
    print(f"\nLookups/s (M), {config['rows']:,} keys, batch {config['batch']:,} "
          f"Zipf(a={config['zipf_a']}) ids, median of {config['reps']}")
    print(head)
    print("-" * len(head))
    for w in workers:
        label = "all" if w["requested_threads"] == 0 else str(w["requested_threads"])
        for r in w["results"]:
            m = {name: r["paths"][name]["lookups_per_s"] / 1e6 for name in PATHS}
            print(f"{r['dim']:>4} {label:>8} | {m['dense_gather']:>12.1f} "
                  f"{m['mutable_hash_table']:>12.1f} {m['ours']:>12.1f} | "
                  f"{r['ours_vs_dense_gather']:>9.2f}x {r['ours_vs_mutable_hash_table']:>8.1f}x"
                  f" | {m['ours_insert']:>12.1f}")
    print()
    for w in workers:
        label = "all" if w["requested_threads"] == 0 else str(w["requested_threads"])
        for r in w["results"]:
            print(f"dim {r['dim']}, threads {label}: ours/dense_gather "
                  f"{r['ours_vs_dense_gather']:.2f}x (target >= {TARGET_VS_DENSE}x: "
                  f"{'met' if r['meets_dense_target'] else 'NOT met'}), "
                  f"ours/MutableHashTable {r['ours_vs_mutable_hash_table']:.1f}x "
                  f"(target >= {TARGET_VS_MHT:.0f}x: "
                  f"{'met' if r['meets_mht_target'] else 'NOT met'})")


def main(argv=None):
    opts = parse_args(argv)
    if opts.worker:
        worker(opts)
        return
    workers = []
    for threads in opts.threads:
        workers.append({"requested_threads": threads, **run_worker(threads, opts)})
    config = {"rows": opts.rows, "batch": opts.batch, "dims": opts.dims,
              "zipf_a": opts.zipf_a, "reps": opts.reps, "warmup": opts.warmup,
              "seed": opts.seed}
    print_report(config, workers)
    report = {"benchmark": "lookup", "config": config, "machine": machine_info(),
              "targets": {"ours_vs_dense_gather": TARGET_VS_DENSE,
                          "ours_vs_mutable_hash_table": TARGET_VS_MHT},
              "workers": workers}
    with open(opts.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {opts.json}")


if __name__ == "__main__":
    main()
