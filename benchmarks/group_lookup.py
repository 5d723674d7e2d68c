"""Forward lookup only: the fused group lookup op vs separate per-table lookups.

The demo's tables (`keras_rec_emb.cli.build_model`: --features tables of dim
--dim, each with a CounterFilter(2) and GlobalStepEvict) are filled ("trained")
by training lookups of --rows rows of `keras_rec_emb.data.synthetic_ctr`
ids, then, in one process and alternating call by call:

* ``fused``: `keras_rec_emb.ops.group_embedding_lookup` over all tables,
  `training=True` (one `KRE>GroupLookup` op);
* ``separate``: one `EmbeddingVariable` table lookup per feature,
  `insert=True` (one `KRE>TableLookup` op each),

each wrapped in a `tf.function`, over --batch rows per feature. Before timing
both paths are checked to give the same rows. Reported: median ms per call
per path and the ratio fused/separate (< 1: fused is faster), per round and
overall (--rounds rounds of --reps calls each).

    .venv/bin/python benchmarks/group_lookup.py
    .venv/bin/python benchmarks/group_lookup.py --rows 100000 --reps 20

Writes benchmarks/group_lookup.json or --json.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_rec_emb as kre  # noqa: E402

from _machine import machine_info  # noqa: E402  (run as a script)

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_lookup.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=300_000, help="rows used to fill the tables")
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--reps", type=int, default=30, help="timed calls per path per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-filter", action="store_true", help="tables without filter/evict")
    p.add_argument("--only", choices=("fused", "separate"), help="time one path (profiling)")
    p.add_argument("--json", default=DEFAULT_JSON)
    return p.parse_args(argv)


def build_tables(opts):
    option = None
    if not opts.no_filter:
        option = kre.EmbeddingVariableOption(
            filter_option=kre.CounterFilter(2),
            evict_option=kre.GlobalStepEvict(steps_to_live=4000))
    layers = [kre.layers.EmbeddingVariable(opts.dim, name=f"emb_{f}", ev_option=option)
              for f in range(opts.features)]
    for layer in layers:
        layer.build()
    return layers


def main(argv=None):
    opts = parse_args(argv)
    cols = kre.data.synthetic_ctr(opts.rows, num_categorical=opts.features, seed=0)
    ids = [cols[f"C{f + 1}"] for f in range(opts.features)]
    layers = build_tables(opts)
    tables = [layer.table for layer in layers]

    @tf.function
    def fused(batch):
        return kre.ops.group_embedding_lookup(layers, batch, training=True)

    @tf.function
    def separate(batch):
        return [t.lookup(x, insert=True) for t, x in zip(tables, batch)]

    batches = [[tf.constant(c[b:b + opts.batch]) for c in ids]
               for b in range(0, opts.rows - opts.batch + 1, opts.batch)]
    t0 = time.perf_counter()
    for batch in batches:  # fill: every id counted (twice: past the filter)
        separate(batch)
        separate(batch)
    print(f"filled {opts.features} tables from {len(batches)} batches in "
          f"{time.perf_counter() - t0:.1f} s; sizes {[t.size() for t in tables[:4]]} ...",
          flush=True)
    for a, b in zip(fused(batches[0]), separate(batches[0])):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    paths = {"fused": fused, "separate": separate}
    if opts.only:
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(opts.reps):
            paths[opts.only](batches[i % len(batches)])
        print(f"{opts.only}: {1e3 * (time.perf_counter() - t0) / opts.reps:.2f} ms per call, "
              f"{1e3 * (time.process_time() - c0) / opts.reps:.2f} ms CPU")
        return
    rounds = []
    for r in range(opts.rounds):
        times = {name: [] for name in paths}
        for i in range(opts.reps):
            batch = batches[(r * opts.reps + i) % len(batches)]
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn(batch)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        rounds.append({"median_s": med, "ratio_fused_over_separate":
                       med["fused"] / med["separate"]})
        print(f"round {r}: fused {1e3 * med['fused']:.2f} ms, separate "
              f"{1e3 * med['separate']:.2f} ms, fused/separate = "
              f"{med['fused'] / med['separate']:.2f}", flush=True)
    ratios = [x["ratio_fused_over_separate"] for x in rounds]
    report = {"config": vars(opts) | {"json": None}, "machine": machine_info(),
              "rounds": rounds, "ratio_fused_over_separate_median": statistics.median(ratios)}
    print(json.dumps({"ratio_fused_over_separate": [round(x, 3) for x in ratios],
                      "median": round(statistics.median(ratios), 3)}))
    with open(opts.json, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
