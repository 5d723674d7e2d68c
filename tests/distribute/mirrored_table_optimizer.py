"""A table with its own optimizer (Adam on a learning-rate schedule) beside
the model's Adagrad, in one process and under MirroredStrategy with N
logical CPU devices (the table sharded over the replicas); prints the
largest differences of the rows, slots and dense kernel as JSON. Run by
test_table_optimizer_mirrored.py in a subprocess (logical devices must be
set before TensorFlow initializes).

    mirrored_table_optimizer.py N
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

N = int(sys.argv[1])
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * N)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_rec_emb as kre  # noqa: E402


def build():
    ids = keras.Input((3,), dtype="int64")
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.5, 0.1])
    emb = kre.layers.EmbeddingVariable(
        4, combiner="mean", name="emb", optimizer=kre.optimizers.Adam(schedule),
        initializer=keras.initializers.RandomUniform(-1, 1, seed=7))(ids)
    model = keras.Model(ids, keras.layers.Dense(1, kernel_initializer="ones", name="dense")(emb))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def run(model):
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 40, (64, 3)), rng.random((64, 1)).astype("float32")
    model.fit(x, y, batch_size=8 * N, shuffle=False, verbose=0)
    data = model.get_layer("emb").export()
    order = np.argsort(data["keys"])
    return {"values": data["values"][order], "kernel": model.get_layer("dense").get_weights()[0],
            **{f"slot_{k}": v[order] for k, v in data["slots"].items()}}


one = run(build())
with tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(N)]).scope():
    many = run(build())
print(json.dumps({"slots": sorted(k for k in one if k.startswith("slot_")),
                  "moved": float(np.abs(one["values"]).max()),
                  **{k: float(np.abs(one[k] - many[k]).max()) for k in one}}))
