"""Forward+backward time of 26 sparse features: one fused group vs separate lookups.

Three paths embed the same Criteo-like batch (26 features, each with its own
table of dim 16; batch 4096; 1-5 ids per row; ids Zipf-distributed over
--vocab values), side by side in one process:

* ``group``: ``keras_rec_emb.ops.group_embedding_lookup_sparse`` over the 26
  ``EmbeddingVariable`` tables, combiner "sum": one forward op and one
  backward op for all features.
* ``separate``: the same 26 ``EmbeddingVariable`` layers (combiner "sum")
  called one by one on their ragged ids: per feature a lookup, a segment sum
  and their gradients.
* ``keras_hashing``: per feature ``keras.layers.Hashing(--bins)`` then a
  ``keras.layers.Embedding(--bins, 16)`` gather and a segment sum (the stock
  Keras way for open-vocabulary ids).

Each path is one ``tf.function`` that runs the forward pass with
``training=True`` (tables insert unseen ids), a loss (sum of squares of all
outputs) and ``GradientTape.gradient`` with respect to every table/variable,
returning the gradients (no optimizer step: that is the same per-table kernel
for ``group`` and ``separate``). Tables are warmed with every batch first, so
no path grows them while timed. After --warmup calls, the paths are called
round-robin --reps times over --batches pre-built batches; the median wall
time per step is reported, with ratios ``separate / group`` and
``keras_hashing / group`` (target: separate / group >= 1.5). Before timing,
the ``group`` and ``separate`` outputs are checked to be equal.

Run from the repository root (not run in CI):

    .venv/bin/python benchmarks/group_embedding.py
    .venv/bin/python benchmarks/group_embedding.py --reps 10 --batch 1024

Writes benchmarks/group_embedding.json (config, machine, times, ratios).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

from _machine import machine_info, write_json_report

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_embedding.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=1_000_000, help="distinct ids per feature")
    p.add_argument("--bins", type=int, default=100_000, help="Hashing bins (keras path)")
    p.add_argument("--zipf-a", type=float, default=1.2)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=DEFAULT_JSON)
    return p.parse_args(argv)


def make_batch(rng, opts):
    out = []
    for f in range(opts.features):
        lengths = rng.integers(1, 6, opts.batch)
        ranks = rng.zipf(opts.zipf_a, lengths.sum())
        ranks = np.where(ranks > opts.vocab, rng.integers(1, opts.vocab, ranks.shape), ranks)
        ids = (ranks * 2_654_435_761 + f * 1_000_003) % (2**40)  # spread, per feature
        out.append(tf.RaggedTensor.from_row_lengths(tf.constant(ids, tf.int64),
                                                    tf.constant(lengths, tf.int64)))
    return out


def build_paths(opts):
    tables = [kre.layers.EmbeddingVariable(opts.dim, combiner="sum", name=f"ev_{f}")
              for f in range(opts.features)]
    hashers = [keras.layers.Hashing(opts.bins) for _ in range(opts.features)]
    embs = [keras.layers.Embedding(opts.bins, opts.dim) for _ in range(opts.features)]
    for layer in tables + embs:
        layer.build()
    table_vars = [t.table.variable for t in tables]
    emb_vars = [e.embeddings for e in embs]

    def loss_of(outs):
        return tf.add_n([tf.reduce_sum(o * o) for o in outs])

    @tf.function(reduce_retracing=True)
    def group(ids):
        with tf.GradientTape() as tape:
            outs = kre.ops.group_embedding_lookup_sparse(
                tables, ids, ["sum"] * len(ids), training=True)
            loss = loss_of(outs)
        return outs, tape.gradient(loss, table_vars)

    @tf.function(reduce_retracing=True)
    def separate(ids):
        with tf.GradientTape() as tape:
            outs = [t(x, training=True) for t, x in zip(tables, ids)]
            loss = loss_of(outs)
        return outs, tape.gradient(loss, table_vars)

    @tf.function(reduce_retracing=True)
    def keras_hashing(ids):
        with tf.GradientTape() as tape:
            outs = []
            for h, e, x in zip(hashers, embs, ids):
                rows = e(h(x.values))
                outs.append(tf.math.segment_sum(rows, x.value_rowids()))
            loss = loss_of(outs)
        return outs, tape.gradient(loss, emb_vars)

    return {"group": group, "separate": separate, "keras_hashing": keras_hashing}


def materialize(result):
    outs, grads = result
    # Eager results are ready when returned (CPU); touch one value of each.
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            _ = g.values.shape
    return outs


def main(argv=None):
    opts = parse_args(argv)
    rng = np.random.default_rng(opts.seed)
    keras.utils.set_random_seed(opts.seed)
    print(f"building {opts.batches} batches of {opts.features} features x {opts.batch} rows ...",
          flush=True)
    batches = [make_batch(rng, opts) for _ in range(opts.batches)]
    paths = build_paths(opts)
    for b in batches:  # warm the tables: every id inserted before timing
        paths["group"](b)
    g_out, _ = paths["group"](batches[0])
    s_out, _ = paths["separate"](batches[0])
    for a, b in zip(g_out, s_out):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    times = {name: [] for name in paths}
    for name, fn in paths.items():
        for i in range(opts.warmup):
            materialize(fn(batches[i % len(batches)]))
    for r in range(opts.reps):
        for name, fn in paths.items():
            b = batches[r % len(batches)]
            t0 = time.perf_counter()
            materialize(fn(b))
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratios = {"separate_over_group": med["separate"] / med["group"],
              "keras_hashing_over_group": med["keras_hashing"] / med["group"]}
    print(f"\n{'path':<15}{'median ms':>12}{'min ms':>10}{'x group':>10}")
    for name in paths:
        print(f"{name:<15}{1e3 * med[name]:>12.2f}{1e3 * min(times[name]):>10.2f}"
              f"{med[name] / med['group']:>10.2f}")
    print(f"\nseparate / group = {ratios['separate_over_group']:.2f}x (target >= 1.5x); "
          f"keras_hashing / group = {ratios['keras_hashing_over_group']:.2f}x")
    write_json_report(opts.json, dict(config=vars(opts) | {"json": None}, machine=machine_info(),
                                      median_s=med, times_s=times, ratios=ratios))


if __name__ == "__main__":
    main()
