"""Forward lookup only: the fused group lookup op vs separate per-table lookups.

The demo's tables (`keras_rec_emb.cli.build_model`: --features tables of dim
--dim, each with a CounterFilter(2) and GlobalStepEvict) are filled ("trained")
by training lookups of --rows rows of `keras_rec_emb.data.synthetic_ctr`
ids, then, in one process and alternating call by call:

* ``fused``: `keras_rec_emb.ops.group_embedding_lookup` over all tables,
  `training=True` (one `KRE>GroupLookup` op);
* ``separate``: one `EmbeddingVariable` table lookup per feature,
  `insert=True` (one `KRE>TableLookup` op each),

each wrapped in a `tf.function`, over --batch rows per feature. With
--ids-per-row 1-5 every row holds 1 to 5 ids (a `tf.RaggedTensor`, drawn from
the same columns) summed per row: the fused op combines them itself, the
separate path calls each table's `EmbeddingVariable(combiner="sum")` layer.
With --inference both paths are inference lookups (`training=False`,
`insert=False`); ``fused`` then reads each table's only feature by the op's
pooled path (no dedupe; csrc/kernels/group_forward.cc states the rule).
With --concat both paths return one `[batch, features * dim]` tensor (the
fused op writes it in place; the separate rows go through `tf.concat`).
Before timing
both paths are checked to give the same rows. Reported: median ms per call
per path and the ratio fused/separate (< 1: fused is faster), per round and
overall (--rounds rounds of --reps calls each).

    .venv/bin/python benchmarks/group_lookup.py
    .venv/bin/python benchmarks/group_lookup.py --rows 100000 --reps 20
    .venv/bin/python benchmarks/group_lookup.py --ids-per-row 1-5 --concat

Writes benchmarks/group_lookup.json or --json.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

from _machine import machine_info, median_range, write_json_report

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_lookup.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=300_000, help="rows used to fill the tables")
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--reps", type=int, default=30, help="timed calls per path per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ids-per-row", default="1", help="ids per row: 1 or a range LO-HI")
    p.add_argument("--concat", action="store_true", help="one concatenated output")
    p.add_argument("--inference", action="store_true",
                   help="inference lookups (no insert) instead of training lookups")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TF's default)")
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
    layers = [kre.layers.EmbeddingVariable(opts.dim, name=f"emb_{f}", ev_option=option,
                                           combiner=None if opts.lengths is None else "sum")
              for f in range(opts.features)]
    for layer in layers:
        layer.build()
    return layers


def ids_per_row(text):
    """None for one id per row, else the (lo, hi) range of ids per row."""
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise SystemExit(f"--ids-per-row must be N or LO-HI with 1 <= LO <= HI; got {text!r}")
    return None if hi == 1 else (lo, hi)


def make_batches(opts, ids):
    """Per batch, one id tensor per feature: [batch] ids, or ragged rows of
    lo..hi consecutive ids of the column."""
    if opts.lengths is None:
        return [[tf.constant(c[b:b + opts.batch]) for c in ids]
                for b in range(0, opts.rows - opts.batch + 1, opts.batch)]
    rng = np.random.default_rng(1)
    lo, hi = opts.lengths
    per_batch = opts.batch * hi
    batches = []
    for b in range(0, opts.rows - per_batch + 1, per_batch):
        lengths = rng.integers(lo, hi + 1, opts.batch)
        batches.append([tf.RaggedTensor.from_row_lengths(
            c[b:b + int(lengths.sum())], lengths) for c in ids])
    return batches


def main(argv=None):
    opts = parse_args(argv)
    opts.lengths = ids_per_row(opts.ids_per_row)
    if opts.threads:
        tf.config.threading.set_intra_op_parallelism_threads(opts.threads)
    cols = kre.data.synthetic_ctr(opts.rows, num_categorical=opts.features, seed=0)
    ids = [cols[f"C{f + 1}"] for f in range(opts.features)]
    layers = build_tables(opts)
    tables = [layer.table for layer in layers]
    n = len(layers)
    train = not opts.inference

    @tf.function
    def fused(batch):
        if opts.lengths is None and not opts.concat:
            return kre.ops.group_embedding_lookup(layers, batch, training=train)
        out = kre.ops.group_embedding_lookup_sparse(
            layers, [x if opts.lengths else x[:, None] for x in batch], ["sum"] * n,
            training=train, concat=opts.concat)
        return [out] if opts.concat else out

    @tf.function
    def separate(batch):
        if opts.lengths is None:
            out = [t.lookup(x, insert=train) for t, x in zip(tables, batch)]
        else:
            out = [layer(x, training=train) for layer, x in zip(layers, batch)]
        return [tf.concat(out, -1)] if opts.concat else out

    @tf.function
    def fill(batch):  # training lookups: every id counted
        if opts.lengths is None:
            return [t.lookup(x, insert=True) for t, x in zip(tables, batch)]
        return [t.lookup(x.values, insert=True) for t, x in zip(tables, batch)]

    batches = make_batches(opts, ids)
    t0 = time.perf_counter()
    for batch in batches:  # fill: every id counted (twice: past the filter)
        fill(batch)
        fill(batch)
    print(f"filled {opts.features} tables from {len(batches)} batches in "
          f"{time.perf_counter() - t0:.1f} s; sizes {[t.size() for t in tables[:4]]} ...",
          flush=True)
    for a, b in zip(fused(batches[0]), separate(batches[0])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)
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
        cpu = {name: [] for name in paths}
        for i in range(opts.reps):
            batch = batches[(r * opts.reps + i) % len(batches)]
            for name, fn in paths.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn(batch)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        med = {name: statistics.median(t) for name, t in times.items()}
        med_cpu = {name: statistics.median(t) for name, t in cpu.items()}
        rounds.append({"median_s": med, "median_cpu_s": med_cpu,
                       "ratio_fused_over_separate": med["fused"] / med["separate"],
                       "cpu_ratio_fused_over_separate": med_cpu["fused"] / med_cpu["separate"]})
        print(f"round {r}: " + ", ".join(
            f"{name} {1e3 * med[name]:.2f} ms ({1e3 * med_cpu[name]:.2f} CPU)" for name in paths)
            + f"; fused/separate = {med['fused'] / med['separate']:.2f}", flush=True)
    summary = {}
    for key in ("ratio_fused_over_separate", "cpu_ratio_fused_over_separate"):
        values = [x[key] for x in rounds if key in x]
        if values:
            summary[key] = median_range(values)
    report = {"config": vars(opts) | {"json": None, "lengths": None}, "machine": machine_info(),
              "rounds": rounds, "summary": summary,
              "ratio_fused_over_separate_median": summary["ratio_fused_over_separate"]["median"]}
    print(json.dumps({k: {m: round(x, 3) for m, x in v.items()} for k, v in summary.items()}))
    write_json_report(opts.json, report)


if __name__ == "__main__":
    main()
