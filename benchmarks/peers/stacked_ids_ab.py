"""A/B in one process: GroupEmbedding fed the peer workload's stacked
`[batch, F, L]` ids as they are (`group(x)`, one KRE>UnstackFeatureIds op)
vs the harness's former column form (F slices `x[:, j, :]`, or `x[:, j, 0]`
with one id, then a dict). Interleaved rounds; prints CPU ms per call
(`time.process_time`) per form and the per-round ratio's median and range.

    .venv/bin/python benchmarks/peers/stacked_ids_ab.py forward|fit VARIANT THREADS \
        [REPS [ROUNDS [DATA_DIR]]]

`forward`: the embedding part alone (training=False) in a tf.function;
`fit`: `train_on_batch` of the harness's model (GroupEmbedding concat ->
Dense(1, sigmoid), keras_rec_emb Adagrad). DATA_DIR holds the workload
written by run.py (default /tmp/h19b/peers/peers-data).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ab

mode, variant, threads, reps, rounds, data_dir = _ab.arguments(
    ("mode", str), ("variant", str), ("threads", int), ("reps", int, 30), ("rounds", int, 9),
    ("data_dir", str, _ab.DATA_DIR))
tf = _ab.tensorflow(threads)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_rec_emb as kre  # noqa: E402
import protocol  # noqa: E402
import workload  # noqa: E402

ids, labels, meta = workload.load(data_dir, variant)
F, dim, B = meta["features"], meta["dim"], meta["batch"]
multi = meta["max_ids"] > 1
nb = meta["batches"]
xs = protocol.lookup_batches(tf, ids, meta)
ys = [tf.constant(labels[i * B:(i + 1) * B].reshape(-1, 1)) for i in range(nb)]


def build(stacked):
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=0)

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.group = kre.layers.GroupEmbedding(
                {f"f{j}": kre.layers.FeatureSpec(kre.layers.EmbeddingVariable(
                    dim, initializer=init, name=f"t{j}"), combiner="sum") for j in range(F)},
                output_mode="concat")
            self.head = keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")

        def embed(self, x, training=None):
            if stacked:
                return self.group(x, training=training)
            cols = [x[:, j, :] if multi else x[:, j, 0] for j in range(F)]
            return self.group({f"f{j}": c for j, c in enumerate(cols)}, training=training)

        def call(self, x, training=None):
            return self.head(self.embed(x, training=training))

    m = Model()
    m(xs[0])  # build eagerly (EV tables draw their init rows)
    m.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    for x in xs:
        m.embed(x, training=True)  # insert every key
    return m


models = {"columns": build(False), "stacked": build(True)}
if mode == "forward":
    steps = {k: (lambda f: (lambda i: f(xs[i % nb])))(
        tf.function(lambda x, m=m: m.embed(x, training=False))) for k, m in models.items()}
    np.testing.assert_array_equal(steps["columns"](0).numpy(), steps["stacked"](0).numpy())
elif mode == "fit":
    steps = {k: (lambda m: (lambda i: m.train_on_batch(xs[i % nb], ys[i % nb])))(m)
             for k, m in models.items()}
else:
    raise SystemExit(f"mode must be forward or fit; got {mode!r}")
for step in steps.values():
    for i in range(nb):
        step(i)
_, res = _ab.interleaved(steps, range(nb), rounds, reps)
_ab.report({"mode": mode, "variant": variant, "threads": threads, "load": os.getloadavg()[0]},
           res, "cpu_ms", "stacked", "columns")
