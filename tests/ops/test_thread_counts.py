"""The TensorFlow ops split their units (tables, shards, id ranges) over the
intra-op pool, each thread taking the next unit: whatever the pool's size,
a GroupEmbedding's training (lookup, backward, the fused update) gives the
same outputs, rows and slots, bit for bit, and so does its inference
lookup. (The output's gradient is a fixed tensor: Keras's dense layers and
reductions sum in an order that depends on the pool's size.) Each thread count runs in a child
process, as the pool's size is fixed once TensorFlow starts."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[1]))
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
import keras_rec_emb as kre

F, B, L, DIM = 8, 2048, 5, 8
rng = np.random.default_rng(0)
specs = {f"f{j}": kre.layers.FeatureSpec(kre.layers.EmbeddingVariable(
    DIM, initializer=keras.initializers.RandomUniform(-0.1, 0.1, seed=j), name=f"t{j}"),
    combiner="sum") for j in range(F)}
group = kre.layers.GroupEmbedding(specs, output_mode="concat")
opt = kre.optimizers.Adagrad(learning_rate=0.1)

@tf.function
def step(ids, g):
    with tf.GradientTape() as tape:
        out = group(ids, training=True)
        loss = tf.reduce_sum(out * g)  # d loss / d out = g, exactly
    variables = group.trainable_variables
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return out

outs = []
ids = rng.zipf(1.2, size=(B, F, L)) % 50000
ids[rng.random((B, F, L)) < 0.4] = -1  # 1-5 ids a row, padded with -1
ids[:, :, 0] = np.abs(ids[:, :, 0])
for s in range(4):  # the same ids each step: the outputs change as the tables train
    g = rng.normal(size=(B, F * DIM)).astype("float32")
    outs.append(step(tf.constant(ids, tf.int64), tf.constant(g)).numpy())
out = {"outputs": [o.tobytes().hex() for o in outs]}
# The inference lookup of stacked ids (KRE>StackedPooledLookup: its split of
# the ids per feature and its pooling also go over the pool).
out["inference"] = tf.function(lambda x: group(x, training=False))(
    tf.constant(ids, tf.int64)).numpy().tobytes().hex()
for j in range(F):
    got = specs[f"f{j}"].table.table.export()
    order = np.argsort(got["keys"])
    out[f"t{j}"] = [np.ascontiguousarray(np.asarray(got[part])[order]).tobytes().hex()
                    for part in ("keys", "values")] + [
        np.ascontiguousarray(np.asarray(got["slots"]["accumulator"])[order]).tobytes().hex()]
print("RESULT " + json.dumps(out))
"""


def _run(threads):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(threads)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_group_training_is_bit_identical_at_1_2_and_5_threads():
    one, two, five = _run(1), _run(2), _run(5)
    assert len(one) == 10 and all(np.isfinite(np.frombuffer(bytes.fromhex(v), np.float32)).all()
                                 for v in one["outputs"])
    # The tables trained: each step's output differs from the one before.
    assert len(set(one["outputs"])) == 4
    for name in one:
        assert two[name] == one[name], name
        assert five[name] == one[name], name
