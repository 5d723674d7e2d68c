"""Bytes per key of one EmbeddingVariable table against the row-data bound.

Issue 19, item 3: memory per key stays within 1.3x of
`4 * dim * (1 + slots) + 16` bytes (the float32 row, one float32 row per
optimizer slot, and 16 bytes for the key and its index entry).

One `keras_rec_emb.layers.EmbeddingVariable(dim)` is built, given `--slots`
optimizer slots of width dim (as `keras_rec_emb.optimizers.Adagrad` adds its
`accumulator`), and --keys distinct random 63-bit keys are inserted
(training lookups, in chunks of --chunk). Reported per (dim, slots): the
table's own `memory_bytes()` (index, row arenas, slots, metadata) over the
keys, the process RSS growth over the keys, and both over the bound.

Run from the repository root (10M keys at dim 16 need about 2.5 GB):

    .venv/bin/python benchmarks/memory_per_key.py                    # 10M keys, dim 16, slots 0 and 1
    .venv/bin/python benchmarks/memory_per_key.py --keys 1000000 --dims 16,64

Writes --json (default benchmarks/memory_per_key.json).
"""

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_info

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from protocol import rss_bytes

TARGET = 1.3
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_per_key.json")


def bound(dim, slots):
    return 4 * dim * (1 + slots) + 16


def measure(keys, dim, slots, chunk):
    gc.collect()
    rss0 = rss_bytes()
    layer = kre.layers.EmbeddingVariable(dim, name=f"mem_{dim}_{slots}")
    layer.build()
    for s in range(slots):
        layer.table.add_slot(f"slot{s}", 0.1)
    t0 = time.perf_counter()
    for i in range(0, len(keys), chunk):
        layer.table.lookup(tf.constant(keys[i:i + chunk]), insert=True)
    elapsed = time.perf_counter() - t0
    size = layer.table.size()
    table_bytes = layer.table.memory_bytes()
    growth = rss_bytes() - rss0
    b = bound(dim, slots)
    result = {"dim": dim, "slots": slots, "keys": int(size), "insert_s": elapsed,
              "bound_bytes_per_key": b, "table_bytes": int(table_bytes),
              "table_bytes_per_key": table_bytes / size, "rss_growth_bytes": int(growth),
              "rss_bytes_per_key": growth / size,
              "table_over_bound": table_bytes / size / b, "rss_over_bound": growth / size / b}
    del layer
    gc.collect()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--dims", default="16")
    p.add_argument("--slots", default="0,1")
    p.add_argument("--chunk", type=int, default=1_000_000)
    p.add_argument("--json", default=DEFAULT_JSON)
    opts = p.parse_args(argv)
    if opts.keys <= 0 or opts.chunk <= 0:
        p.error(f"--keys and --chunk must be positive, got {opts.keys}, {opts.chunk}")
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 2**63 - 1, opts.keys, dtype=np.int64))
    rng.shuffle(keys)
    results = []
    for dim in (int(d) for d in opts.dims.split(",")):
        for slots in (int(s) for s in opts.slots.split(",")):
            r = measure(keys, dim, slots, opts.chunk)
            results.append(r)
            print(f"dim {dim:>3} slots {slots}: {r['keys']:,} keys, table "
                  f"{r['table_bytes_per_key']:.1f} B/key, RSS {r['rss_bytes_per_key']:.1f} "
                  f"B/key, bound {r['bound_bytes_per_key']} B/key -> table "
                  f"{r['table_over_bound']:.2f}x, RSS {r['rss_over_bound']:.2f}x "
                  f"(target <= {TARGET}x)", flush=True)
    report = {"benchmark": "memory_per_key", "config": vars(opts), "machine": machine_info(),
              "target_over_bound": TARGET, "results": results}
    with open(opts.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {opts.json}")


if __name__ == "__main__":
    main()
