"""Training steps/s of a file-tier table (cache of 10% of its rows) vs DRAM.

Issue 14, item 6. One model, built twice side by side in one process: ids
[--batch, --features] (Zipf(--zipf-a) draws over --vocab ids per feature,
each feature offset into its own id range) -> one
``keras_rec_emb.layers.EmbeddingVariable(--dim)`` (sum over features) ->
Dense(1), mean squared error, ``keras_rec_emb.optimizers.Adagrad`` (fused
sparse update, one slot). The tables differ only in their
``StorageOption``: DRAM, or FILE with a DRAM cache of --cache-fraction of
the table's row bytes (values + accumulator). --batches distinct batches
are made once; every model first trains over all of them (warm-up: every
id inserted), then the models take turns, --reps rounds of --steps steps
each; a model's steps/s is one over its median time per step.

Reported: steps/s of both and their ratio (target >= 0.5x), the cache hit
rate during the timed steps, bytes on disk per key against
``4 * dim * (1 + slots)``, the time of one snapshot, and the peak RSS of
the process (``ru_maxrss``, both models included).

Run from the repository root:

    .venv/bin/python benchmarks/storage.py                 # small default (~1 min)
    .venv/bin/python benchmarks/storage.py --vocab 4000000 --batches 200

Writes --json (default benchmarks/storage.json).
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_rec_emb as kre  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_info  # noqa: E402

TARGET_FILE_VS_DRAM = 0.5
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "storage.json")


def make_batches(opts):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(opts.batches):
        z = rng.zipf(opts.zipf_a, size=(opts.batch, opts.features)) % opts.vocab
        ids = z + np.arange(opts.features, dtype=np.int64) * opts.vocab
        y = rng.normal(size=(opts.batch, 1)).astype(np.float32)
        out.append((ids.astype(np.int64), y))
    return out


def build(opts, storage):
    keras.utils.set_random_seed(1)
    option = kre.EmbeddingVariableOption(storage_option=storage)
    ids = keras.Input((opts.features,), dtype="int64")
    emb = kre.layers.EmbeddingVariable(opts.dim, ev_option=option, combiner="sum",
                                       name="table")(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(emb))
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="mse")
    return model


def time_steps(model, batches, steps):
    times = []
    for i in range(steps):
        ids, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        model.train_on_batch(ids, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=200_000)
    p.add_argument("--zipf-a", type=float, default=1.1)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--storage-dir", default=None, help="folder for the file tier "
                   "(default: a temporary folder, removed afterwards)")
    p.add_argument("--json", default=DEFAULT_JSON)
    opts = p.parse_args(argv)
    batches = make_batches(opts)
    rows = len(np.unique(np.concatenate([b[0].ravel() for b in batches])))
    row_bytes = 4 * opts.dim * 2  # value + Adagrad accumulator
    cache_bytes = max(1, int(opts.cache_fraction * rows * row_bytes))
    folder = opts.storage_dir or tempfile.mkdtemp(prefix="kre-storage-bench-")
    try:
        models = {
            "dram": build(opts, None),
            "file": build(opts, kre.StorageOption("FILE", storage_path=folder,
                                                  storage_size=cache_bytes)),
        }
        for model in models.values():  # warm-up: every id inserted, functions traced
            for ids, y in batches:
                model.train_on_batch(ids, y)
        layer = models["file"].get_layer("table")
        before = layer.stats()
        per_step = {name: [] for name in models}
        for _ in range(opts.reps):
            for name, model in models.items():
                per_step[name].append(time_steps(model, batches, opts.steps))
        after = layer.stats()
        hits = after["cache_hits"] - before["cache_hits"]
        misses = after["cache_misses"] - before["cache_misses"]
        t0 = time.perf_counter()
        layer.snapshot()
        snapshot_s = time.perf_counter() - t0
        stats = layer.stats()
        steps_per_s = {n: 1.0 / statistics.median(v) for n, v in per_step.items()}
        ratio = steps_per_s["file"] / steps_per_s["dram"]
        bound = 4 * opts.dim * (1 + 1)
        report = {
            "benchmark": "storage", "config": vars(opts), "machine": machine_info(),
            "rows": int(stats["rows"]), "cache_bytes": cache_bytes,
            "cached_rows": int(stats["cached_rows"]),
            "steps_per_s": steps_per_s, "file_over_dram": ratio,
            "target_file_over_dram": TARGET_FILE_VS_DRAM,
            "cache_hit_rate": hits / max(1, hits + misses),
            "disk_bytes": int(stats["disk_bytes"]),
            "disk_bytes_per_key": stats["disk_bytes"] / max(1, stats["rows"]),
            "row_bound_bytes_per_key": bound,
            "disk_over_bound": stats["disk_bytes"] / max(1, stats["rows"]) / bound,
            "snapshot_s": snapshot_s,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    finally:
        if opts.storage_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{report['rows']:,} rows, dim {opts.dim} + Adagrad slot; cache {cache_bytes:,} "
          f"bytes ({opts.cache_fraction:.0%} of the rows)")
    print(f"steps/s  DRAM {steps_per_s['dram']:.2f}  FILE {steps_per_s['file']:.2f}  "
          f"-> FILE/DRAM {ratio:.2f}x (target >= {TARGET_FILE_VS_DRAM}x)")
    print(f"cache hit rate {report['cache_hit_rate']:.3f}; disk {report['disk_bytes_per_key']:.1f} "
          f"B/key vs 4*dim*(1+slots) = {bound} -> {report['disk_over_bound']:.2f}x; "
          f"snapshot {snapshot_s:.2f} s; peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB")
    with open(opts.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {opts.json}")


if __name__ == "__main__":
    main()
