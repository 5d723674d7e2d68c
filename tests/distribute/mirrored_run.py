"""Trains one small model in one process and under MirroredStrategy with N
logical CPU devices (tables sharded over the replicas), same global batch;
writes both results to OUT.npz. Run by test_mirrored.py in a subprocess
(logical devices must be set before TensorFlow initializes).

    mirrored_run.py N OPTIMIZER OUT.npz [group]

With `group` the table is read through a GroupEmbedding (one feature, the
same mean) instead of calling the EmbeddingVariable.
"""

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import compile_mse, table_arrays  # noqa: E402

DIM, BATCH, STEPS, IDS = 4, 8 * N, 4, 3
GROUP = len(sys.argv) > 4 and sys.argv[4] == "group"


def data():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 40, size=(BATCH * STEPS, IDS)).astype(np.int64)
    y = rng.uniform(size=(BATCH * STEPS, 1)).astype(np.float32)
    return ids, y


def build(optimizer):
    ids = keras.Input(shape=(IDS,), dtype="int64")
    table = kre.layers.EmbeddingVariable(
        DIM, combiner="mean", name="emb",
        initializer=keras.initializers.RandomUniform(-1, 1, seed=7),
        ev_option=kre.EmbeddingVariableOption(track_meta=True))
    if GROUP:  # the same lookup and mean through a GroupEmbedding
        emb = kre.layers.GroupEmbedding(
            {"f": kre.layers.FeatureSpec(table, combiner="mean")}, output_mode="concat",
            name="group")({"f": ids})
    else:
        emb = table(ids)
    return compile_mse(ids, keras.layers.Dense(1, name="dense")(emb), optimizer)


def emb_table(model):
    """The model's table (read directly or through the GroupEmbedding)."""
    names = [layer.name for layer in model.layers]
    layer = model.get_layer("emb") if "emb" in names else model.get_layer("group").tables[0]
    return layer.table


def train(model, dense_init):
    model.get_layer("dense").set_weights(dense_init)
    ids, y = data()
    model.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    table = emb_table(model)
    out = table_arrays(table)
    out["kernel"], out["bias"] = [np.asarray(w) for w in model.get_layer("dense").get_weights()]
    out["predict"] = model.predict(ids[:BATCH], verbose=0)
    return out, table


def main():
    optimizer, path = sys.argv[2], sys.argv[3]
    rng = np.random.default_rng(1)
    dense_init = [rng.normal(size=(DIM, 1)).astype(np.float32), np.zeros(1, np.float32)]
    one, _ = train(build(optimizer), dense_init)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(N)])
    with strategy.scope():
        model = build(optimizer)
    many, table = train(model, dense_init)
    result = {f"one_{k}": v for k, v in one.items()}
    result.update({f"many_{k}": v for k, v in many.items()})
    result["predict_ids"] = data()[0][:BATCH]
    result["shard_sizes"] = np.array([s.size() for s in table.shards])
    result["shard_devices"] = np.array([s.device for s in table.shards])
    np.savez(path, **result)
    model.save(os.path.join(os.path.dirname(path), f"mirrored_{N}_{optimizer}.keras"))


if __name__ == "__main__":
    main()
