"""
Title: One script for both Keras backends
Author: keras_rec_emb authors
Description: String ids hashed as DeepRec does, keras-rs style table
configs, a sequence feature, DeepRec's AdamAsync under mixed precision,
Parquet input, incremental checkpoints, table statistics in TensorBoard and
a stock-TensorFlow export of a subclassed model: the same file under
`KERAS_BACKEND=tensorflow`, `KERAS_BACKEND=jax`, or a `keras.json` that
names either.
"""

"""
## The backend is Keras's

The package reads the backend the way Keras does (`KERAS_BACKEND`, else the
`"backend"` of `~/.keras/keras.json`), and every class below is the same
class under both. Two things differ by nature, and the script says where:
JAX arrays hold no strings, so string ids are hashed on the host before the
model; and a SavedModel is TensorFlow's format, so under JAX
`export_for_serving` writes it in a TensorFlow child process.

When the environment variable `KRE_GUIDE_SMALL=1` is set, this guide runs on
less data (CI runs it that way).
"""

import os
import tempfile

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 512 if SMALL else 8192
BATCH = 64
work = tempfile.mkdtemp(prefix="kre-both-")
print("backend:", keras.config.backend())

"""
## Data: string ids hashed to table keys, written to Parquet

`HashStrings` gives the keys DeepRec's string tables use (TensorFlow's
`to_hash_bucket_fast`, FarmHash Fingerprint64), bit for bit under both
backends. It runs here, before the model, on NumPy strings.
"""

rng = np.random.default_rng(0)
users = np.array([f"user-{u:x}" for u in rng.integers(0, 300, ROWS)])
items = np.array([f"item-{i:x}" for i in rng.integers(0, 1000, ROWS)])
# A variable-length history of item keys per row (a Parquet list column).
history = [rng.integers(0, 10**12, size=n) for n in rng.integers(1, 6, ROWS)]
labels = (rng.random(ROWS) < 0.3).astype(np.float32)

hash_strings = kre.layers.HashStrings(missing="pad")  # the input's shape; '' would be -1
table = pa.table({
    "user": keras.ops.convert_to_numpy(hash_strings(users)),
    "item": keras.ops.convert_to_numpy(hash_strings(items)),
    "history": pa.array(history, type=pa.list_(pa.int64())),
    "label": labels,
})
pq.write_table(table, os.path.join(work, "clicks.parquet"), row_group_size=ROWS // 4)
print("distinct user keys:", len(np.unique(table["user"].to_numpy())))

"""
## The model: configs, a sequence feature, a custom layer, a subclassed model

`TableConfig` / `FeatureConfig` (keras-rs's style) declare the user and item
tables, the item table with its own optimizer. The history is a sequence
feature of a `GroupEmbedding`, its rows clipped to `max_norm`: `[batch, L,
dim]`, with zero rows past each history's end (L is the longest history of
the batch under TensorFlow, the padded width under JAX), summed here.
"""

keras.mixed_precision.set_global_policy("mixed_float16")

item_table = kre.layers.TableConfig(
    "item", embedding_dim=8, optimizer=kre.optimizers.Adagrad(0.05))
user_table = kre.layers.TableConfig("user", embedding_dim=8)


@keras.saving.register_keras_serializable(package="guide")
class Tower(keras.layers.Layer):
    """A custom layer: the export must carry it to TensorFlow."""

    def __init__(self, units=16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu", name="hidden")
        self.out = keras.layers.Dense(1, activation="sigmoid", dtype="float32", name="out")

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="guide")
class Ranker(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = kre.layers.GroupEmbedding({
            "user": kre.layers.FeatureConfig("user", user_table),
            "item": kre.layers.FeatureConfig("item", item_table),
        })
        self.sequence = kre.layers.GroupEmbedding({"history": kre.layers.FeatureSpec(
            {"embedding_dim": 8, "name": "history"}, sequence=True, max_norm=1.0)})
        self.tower = Tower(name="tower")

    def call(self, inputs):
        rows = self.embed({"user": inputs["user"], "item": inputs["item"]})
        history = keras.ops.sum(self.sequence({"history": inputs["history"]})["history"], axis=1)
        x = keras.ops.concatenate([rows["user"], rows["item"], history], axis=-1)
        return self.tower(x)


# Named layers: a checkpoint restores into a model whose variables have the same paths.
model = Ranker(name="ranker")
model.compile(optimizer=kre.optimizers.AdamAsync(0.01), loss="binary_crossentropy")
print("optimizer:", type(model.optimizer).__name__)  # LossScaleOptimizer: mixed precision

"""
## Training from Parquet with incremental checkpoints and TensorBoard

`ParquetDataset` is a `tf.data.Dataset` under TensorFlow and a Keras data
adapter of NumPy batches under JAX (no TensorFlow needed). The checkpoint
callback writes a full checkpoint, then deltas of the rows that changed.
"""

dataset = kre.data.ParquetDataset(os.path.join(work, "clicks.parquet"), batch_size=BATCH,
                                  drop_remainder=True)
dataset = dataset.map(lambda batch: (
    {k: batch[k] for k in ("user", "item", "history")}, batch["label"]))
checkpoints = os.path.join(work, "checkpoints")
model.fit(dataset, epochs=2, verbose=0, callbacks=[
    kre.callbacks.CheckpointCallback(checkpoints, full_every_steps=1000,
                                     incremental_every_steps=2),
    kre.callbacks.TableStats(every_n_steps=4, log_dir=os.path.join(work, "tensorboard")),
])
print("checkpoint files:", len([f for f in os.listdir(checkpoints) if f.endswith(".npz")]))
print("tensorboard event files:", len(os.listdir(os.path.join(work, "tensorboard"))))

"""
## Restore, then serve with stock TensorFlow

A fresh model restores the newest full checkpoint and its chain of deltas;
`export_for_serving` writes a SavedModel that needs TensorFlow only.
"""

fresh = Ranker(name="ranker")
fresh.compile(optimizer=kre.optimizers.AdamAsync(0.01), loss="binary_crossentropy")
batch = next(iter(dataset))[0]
fresh(batch)  # builds the tables
kre.IncrementalCheckpointer(fresh, checkpoints).restore()
same = np.allclose(np.asarray(fresh.predict(batch, verbose=0)),
                   np.asarray(model.predict(batch, verbose=0)), atol=1e-3)
print("restored model predicts the same:", same)

path = kre.export_for_serving(model, os.path.join(work, "serving"))
print("exported:", os.path.exists(os.path.join(path, "saved_model.pb")))
keras.mixed_precision.set_global_policy("float32")
