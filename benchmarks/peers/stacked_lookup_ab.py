"""A/B in one process: GroupEmbedding's inference lookup of the peer
workload's stacked `[batch, F, L]` ids through `KRE>StackedPooledLookup`
(the layer's default for L > 1) vs the group lookup's pooled path
(`KRE>UnstackKeptIds` + `KRE>GroupLookup`, what it ran before: the same
split and lookup called as ops). The tables are filled by one training lookup
of each of the workload's batches, then both `tf.function`s are checked to
give bit-identical outputs on every batch and timed in interleaved rounds
(the order flips every round) of REPS calls over the batches. Prints wall
and CPU ms per call per path, the per-round ratio old / new (> 1: the new
op is faster) as median (min-max), and JSON.

    .venv/bin/python benchmarks/peers/stacked_lookup_ab.py [VARIANT [THREADS \
        [REPS [ROUNDS [DATA_DIR]]]]]

VARIANT `multi` (1-5 ids a row, the default) or `single`; DATA_DIR holds the
workload written by run.py (`--data-dir`; default /tmp/h19b/peers/peers-data).
"""

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ab

variant, threads, reps, rounds, data_dir = _ab.arguments(
    ("variant", str, "multi"), ("threads", int, 1), ("reps", int, 64), ("rounds", int, 10),
    ("data_dir", str, _ab.DATA_DIR))
tf = _ab.tensorflow(threads)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_rec_emb as kre  # noqa: E402
import protocol  # noqa: E402
import workload  # noqa: E402
from keras_rec_emb.backend.tensorflow import ops as _ops  # noqa: E402
from keras_rec_emb.backend.tensorflow.ids import FlatIds  # noqa: E402

ids, _, meta = workload.load(data_dir, variant)
F, dim = meta["features"], meta["dim"]
init = keras.initializers.RandomUniform(-0.05, 0.05, seed=0)
group = kre.layers.GroupEmbedding({f"f{j}": kre.layers.FeatureSpec(
    kre.layers.EmbeddingVariable(dim, initializer=init, name=f"t{j}"), combiner="sum")
    for j in range(F)}, output_mode="concat")
batches = protocol.lookup_batches(tf, ids, meta)
for b in batches:
    group(b, training=True)

tables = [group.tables[s.table] for s in group.features.values()]


def old(x):  # the split into each feature's kept ids, then the group lookup
    values, splits = _ops.unstack_kept_ids(x)
    return kre.ops.group_embedding_lookup_sparse(
        tables, [FlatIds(v, s, True) for v, s in zip(values, splits)], "sum", concat=True)


paths = {"new": tf.function(lambda x: group(x, training=False)), "old": tf.function(old)}
for name, fn in paths.items():
    ops = {op.type for op in fn.get_concrete_function(batches[0]).graph.get_operations()}
    print(name, sorted(o for o in ops if o.startswith("KRE>")))
for b in batches:
    if not np.array_equal(paths["new"](b).numpy(), paths["old"](b).numpy()):
        sys.exit("the two paths differ")

wall, cpu = _ab.interleaved(paths, batches, rounds, reps)
ratios = [o / n for o, n in zip(wall["old"], wall["new"])]
cpu_ratios = [o / n for o, n in zip(cpu["old"], cpu["new"])]
result = {
    "variant": variant, "threads": threads, "reps": reps, "rounds": rounds,
    "wall_ms": {n: statistics.median(v) for n, v in wall.items()},
    "cpu_ms": {n: statistics.median(v) for n, v in cpu.items()},
    "old_over_new_wall": [statistics.median(ratios), min(ratios), max(ratios)],
    "old_over_new_cpu": [statistics.median(cpu_ratios), min(cpu_ratios), max(cpu_ratios)],
}
for n in paths:
    print(f"{n}: {result['wall_ms'][n]:.3f} wall-ms, {result['cpu_ms'][n]:.3f} CPU-ms a call")
print("old / new, wall: %.3f (%.3f-%.3f); CPU: %.3f (%.3f-%.3f)"
      % (*result["old_over_new_wall"], *result["old_over_new_cpu"]))
print(json.dumps(result))
