"""One worker of a MultiWorkerMirroredStrategy cluster (TF_CONFIG set by
test_mwms_group.py), or with no TF_CONFIG the one-process reference: a
GroupEmbedding over three tables of two widths (one shared by two
features; multi-id features padded with -1; a counter filter), Adam,
`model.fit` on global batches. The lookups of all three tables travel in
one exchange. Writes OUT/{w<task>|one}.npz (every table part, the dense
kernel, the predictions). With `separate`, the same tables as separate
`EmbeddingVariable` layers of the Functional model, one per feature (the
shared table's features as one layer of 6 ids): one model call looks them
up together.

    mwms_group_run.py OUT [separate]
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import table_arrays

BATCH, STEPS = 12, 4


def build():
    init = keras.initializers.RandomUniform(-1, 1, seed=7)
    a = kre.layers.TableConfig("a", 4, initializer=init, combiner="sum")
    b = kre.layers.TableConfig("b", 6, initializer=init, combiner="mean", ev_option=(
        kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(filter_freq=2))))
    c = kre.layers.TableConfig("c", 4, initializer=init, combiner="sqrtn")
    features = {"f0": kre.layers.FeatureConfig("f0", a), "f1": kre.layers.FeatureConfig("f1", a),
                "f2": kre.layers.FeatureConfig("f2", b), "f3": kre.layers.FeatureConfig("f3", c)}
    inputs = {n: keras.Input((3,), dtype="int64", name=n) for n in features}
    group = kre.layers.GroupEmbedding(features, output_mode="concat", name="group")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=3),
                               name="dense")
    model = keras.Model(inputs, dense(group(inputs)))
    model.compile(optimizer=kre.optimizers.Adam(0.05), loss="mse")
    return model


def build_separate():
    init = keras.initializers.RandomUniform(-1, 1, seed=7)
    inputs = {f"f{j}": keras.Input((3,), dtype="int64", name=f"f{j}") for j in range(4)}
    a = kre.layers.EmbeddingVariable(4, initializer=init, combiner="sum",
                                     prune_invalid_ids=True, name="a")
    b = kre.layers.EmbeddingVariable(6, initializer=init, combiner="mean", prune_invalid_ids=True,
                                     name="b", ev_option=kre.EmbeddingVariableOption(
                                         filter_option=kre.CounterFilter(filter_freq=2)))
    c = kre.layers.EmbeddingVariable(4, initializer=init, combiner="sqrtn",
                                     prune_invalid_ids=True, name="c")
    merged = keras.layers.Concatenate()([a(inputs["f0"]), b(inputs["f2"]), c(inputs["f3"])])
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=3),
                               name="dense")
    model = keras.Model(inputs, dense(merged))
    model.compile(optimizer=kre.optimizers.Adam(0.05), loss="mse")
    return model


def data():
    rng = np.random.default_rng(11)
    x = {f"f{j}": np.where(rng.random((BATCH * STEPS, 3)) < 0.3, -1,
                           rng.integers(0, 30, (BATCH * STEPS, 3))) for j in range(4)}
    return x, rng.random((BATCH * STEPS, 1)).astype(np.float32)


def train(model):
    x, y = data()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    out = {}
    tables = ([model.get_layer(n) for n in ("a", "b", "c")] if SEPARATE
              else model.get_layer("group").tables)
    for table in tables:
        for key, value in table_arrays(table).items():
            out[f"{table.name}_{key}"] = value
    out["kernel"] = model.get_layer("dense").get_weights()[0]
    out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    return out


SEPARATE = sys.argv[2:] == ["separate"]


def main():
    folder = sys.argv[1]
    make = build_separate if SEPARATE else build
    if "TF_CONFIG" not in os.environ:
        np.savez(os.path.join(folder, "one.npz"), **train(make()))
        return
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(os.path.join(folder, f"w{task}.npz"), **train(model))


if __name__ == "__main__":
    main()
