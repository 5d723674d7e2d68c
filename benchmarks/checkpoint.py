"""Full vs incremental checkpoints of one table (issue 16, item 5).

A model with one `EmbeddingVariable(dim)` (Adagrad: one slot) holds --rows
keys. Measured side by side in one process: a full checkpoint
(`IncrementalCheckpointer.save_full`, every row) against an incremental one
after 1% and 10% of the rows changed (trained), in time and bytes; and the
restore time of one full checkpoint + 10 incremental links against one
full. Target: incremental <= 0.1x of full at 1%.

Run from the repository root (the issue's size is --rows 10000000, ~3 GB):

    .venv/bin/python benchmarks/checkpoint.py                  # 1M rows
    .venv/bin/python benchmarks/checkpoint.py --rows 10000000

Writes --json (default benchmarks/checkpoint.json).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np

import keras_rec_emb as kre

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_info


def build(rows, dim):
    ids = keras.Input((1,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(dim, combiner="sum", name="ev")
    model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.train_on_batch(np.zeros((1, 1), np.int64), np.zeros((1, 1)))
    keys = np.arange(rows, dtype=np.int64)
    ev.table.import_({"keys": keys, "values": np.ones((rows, dim), np.float32),
                      "slots": {"accumulator": np.full((rows, dim), 0.1, np.float32)}})
    return model, ev


def touch(model, rows, share, rng, batch=65536):
    keys = rng.choice(rows, int(rows * share), replace=False).astype(np.int64)
    for i in range(0, len(keys), batch):
        k = keys[i:i + batch, None]
        model.train_on_batch(k, np.ones((len(k), 1)))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "checkpoint.json"))
    args = p.parse_args()
    rng = np.random.default_rng(0)
    model, ev = build(args.rows, args.dim)
    work = tempfile.mkdtemp(prefix="kre-bench-ckpt-")
    results = {"rows": args.rows, "dim": args.dim, "machine": machine_info()}
    try:
        ckpt = kre.IncrementalCheckpointer(model, work, keep=100)
        # Untimed first save: the checkpointer finds the tables' SavedModel
        # export order once (it traces the model's functions, ~0.3 s), then
        # reuses it; the timed saves are the steady state of online training.
        ckpt.save_full()
        full, t_full = timed(ckpt.save_full)
        results["full"] = {"seconds": t_full, "bytes": os.path.getsize(full)}
        for share in (0.01, 0.10):
            touch(model, args.rows, share, rng)
            inc, t_inc = timed(ckpt.save_incremental)
            b = os.path.getsize(inc)
            results[f"incremental_{share:.0%}"] = {
                "seconds": t_inc, "bytes": b, "time_ratio": t_inc / t_full,
                "bytes_ratio": b / results["full"]["bytes"]}
        # Restore: one full + 10 links (1% each) vs one full.
        chain_dir = os.path.join(work, "chain")
        chain = kre.IncrementalCheckpointer(model, chain_dir, keep=100)
        chain.save_full()
        for _ in range(10):
            touch(model, args.rows, 0.01, rng)
            chain.save_incremental()
        one_dir = os.path.join(work, "one")
        kre.IncrementalCheckpointer(model, one_dir).save_full()
        _, t_chain = timed(kre.IncrementalCheckpointer(model, chain_dir).restore)
        _, t_one = timed(kre.IncrementalCheckpointer(model, one_dir).restore)
        results["restore"] = {"full_plus_10_seconds": t_chain, "full_seconds": t_one,
                              "ratio": t_chain / t_one}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'':24}{'seconds':>10}{'MB':>10}{'time x full':>13}{'bytes x full':>14}")
    print(f"{'full save':24}{results['full']['seconds']:10.3f}"
          f"{results['full']['bytes'] / 2**20:10.1f}{1:13.3f}{1:14.3f}")
    for share in ("1%", "10%"):
        r = results[f"incremental_{share}"]
        print(f"{'incremental, ' + share + ' changed':24}{r['seconds']:10.3f}"
              f"{r['bytes'] / 2**20:10.1f}{r['time_ratio']:13.3f}{r['bytes_ratio']:14.3f}")
    r = results["restore"]
    print(f"restore full + 10 increments: {r['full_plus_10_seconds']:.3f} s, one full: "
          f"{r['full_seconds']:.3f} s, ratio {r['ratio']:.2f}x")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
