"""
Title: Quick start with EmbeddingVariable
Author: keras_rec_emb authors
Description: Dynamic embedding tables that grow as new ids arrive, trained
with `model.fit`, saved with `model.save`, served as a SavedModel.
"""

"""
## Why a hash table?

A `keras.layers.Embedding` needs a vocabulary size up front: ids must be
`0..vocab-1`. Recommendation data has billions of ids (user ids, item ids,
hashed crosses) and new ones every hour. Hashing them into a fixed range
makes distinct ids collide; a huge range wastes memory.

`keras_rec_emb.layers.EmbeddingVariable` (DeepRec's EmbeddingVariable) keeps a
collision-free hash table instead: any int64 id works, and memory grows with
the number of distinct ids actually seen.

When the environment variable `KRE_GUIDE_SMALL=1` is set, this guide runs on
less data (CI runs it that way).
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 4_000 if SMALL else 100_000
keras.utils.set_random_seed(42)

"""
## Data: users and items with ids anywhere in int64

Each example is a (user id, item id, 3 recent item ids) tuple and a click.
Ids are drawn from a space of `10**15`, far beyond any vocabulary.
"""

rng = np.random.default_rng(0)
users = rng.integers(0, 2_000, ROWS) * 7_919_000_000_003 % 10**15
items = rng.zipf(1.3, ROWS) % 50_000 * 104_729_000_001 % 10**15
history = rng.zipf(1.3, (ROWS, 3)) % 50_000 * 104_729_000_001 % 10**15
# A hidden preference: users like items whose id parity matches theirs.
clicks = ((users % 2) == (items % 2)).astype("float32")

"""
## A model with EmbeddingVariable layers

`EmbeddingVariable(dim)` takes integer ids of any shape and returns
`ids.shape + (dim,)`. With a `combiner` (`"sum"`, `"mean"`, `"sqrtn"`) it
combines the last axis, so a list of ids becomes one vector. Ragged and sparse
ids work the same way.
"""

user_in = keras.Input((), dtype="int64", name="user")
item_in = keras.Input((), dtype="int64", name="item")
hist_in = keras.Input((3,), dtype="int64", name="history")

user_vec = kre.layers.EmbeddingVariable(16, name="user_emb")(user_in)
# Frequencies and versions cost 16 bytes per id, so a table keeps them only
# when a filter or eviction needs them, or when asked (`track_meta=True`).
item_table = kre.layers.EmbeddingVariable(
    16, name="item_emb", ev_option=kre.EmbeddingVariableOption(track_meta=True))
item_vec = item_table(item_in)
hist_vec = item_table(hist_in)  # one table serves two features
hist_vec = keras.layers.GlobalAveragePooling1D()(hist_vec)

x = keras.layers.Concatenate()([user_vec * item_vec, user_vec, item_vec, hist_vec])
x = keras.layers.Dense(32, activation="relu")(x)
out = keras.layers.Dense(1, activation="sigmoid")(x)
model = keras.Model([user_in, item_in, hist_in], out)

"""
## Train with a table-aware optimizer

Tables are updated by the optimizers of `keras_rec_emb.optimizers` (`SGD`,
`Adagrad`, `Adam`, `Ftrl`): they take the same arguments as Keras's, update
dense weights exactly as Keras does, and update each table with one fused
sparse kernel. (A stock `keras.optimizers.Adam` refuses a table with an error
that names this fix.)
"""

model.compile(optimizer=kre.optimizers.Adam(0.01), loss="binary_crossentropy",
              metrics=[keras.metrics.AUC(name="auc")])
inputs = {"user": users, "item": items, "history": history}
EPOCHS = 2 if SMALL else 3
model.fit(inputs, clicks, batch_size=256, epochs=EPOCHS,
          validation_split=0.1, verbose=2)

"""
## The tables grew with the data

`table_size()` counts distinct ids seen in training (validation batches are
inference: they do not insert); `export()` returns every row with its key,
frequency (lookups in training), version (last optimizer step that updated it)
and optimizer slots, in DeepRec's export format. Frequencies and versions are
tracked only where asked (`track_meta=True`, as for the item table here) or
needed by a filter or eviction; elsewhere they read 0.
"""

train = slice(0, int(ROWS * 0.9))  # validation_split holds out the last 10%
train_users = len(np.unique(users[train]))
train_items = len(np.unique(np.concatenate([items[train], history[train].ravel()])))
print("users in table:", model.get_layer("user_emb").table_size(),
      "distinct in training data:", train_users)
print("items in table:", item_table.table_size(), "distinct in training data:", train_items)
assert model.get_layer("user_emb").table_size() == train_users
assert item_table.table_size() == train_items
data = item_table.export()
print("export parts:", sorted(data), "slots:", sorted(data["slots"]))
hot = np.argmax(data["freqs"])
print(f"most frequent item id {data['keys'][hot]} seen {data['freqs'][hot]} times, "
      f"last updated at step {data['versions'][hot]}")
# Every training lookup counts: the item and history columns, every epoch.
in_train = np.concatenate([items[train], history[train].ravel()])
assert data["freqs"][hot] == EPOCHS * np.sum(in_train == data["keys"][hot])
assert 0 < data["versions"][hot] <= model.optimizer.iterations
# (user_emb has no track_meta: its frequencies and versions read 0.)

"""
## Inference does not grow the tables

In `predict` (and any call with `training=False`) an unseen id reads its
initial row and is not inserted.
"""

before = item_table.table_size()
new_items = rng.integers(10**15, 2 * 10**15, 8)
model.predict({"user": users[:8], "item": new_items, "history": history[:8]}, verbose=0)
assert item_table.table_size() == before

"""
## Save, reload, keep training

`model.save` stores every row, the optimizer slots, frequencies, versions and
the initializer matrix, so a reloaded model predicts identically and keeps
training identically. `kre.save_model` does the same atomically (the previous
file survives a failed save).
"""

workdir = tempfile.mkdtemp()
path = os.path.join(workdir, "ctr.keras")
kre.save_model(model, path)
reloaded = keras.saving.load_model(path)
probe = {k: v[:256] for k, v in inputs.items()}
np.testing.assert_array_equal(model.predict(probe, verbose=0), reloaded.predict(probe, verbose=0))
print("reloaded model predicts identically")

"""
`tf.train.Checkpoint(model=model, optimizer=model.optimizer)` works too, for
training loops that checkpoint every N steps.

## Export for serving

`model.export` writes a SavedModel. Loading it needs the ops of this package:
`import keras_rec_emb` before `tf.saved_model.load` (or in the serving
process).

Under Keras's JAX backend `model.export` cannot carry the tables (it converts
the model with `jax2tf`, which refuses their XLA custom calls):
`kre.export_for_serving` writes the stock-TensorFlow SavedModel instead (under
either backend; TensorFlow must be installed for that step).
"""

serving_dir = os.path.join(workdir, "serving")
if keras.config.backend() == "jax":
    kre.export_for_serving(model, serving_dir)
else:
    model.export(serving_dir, verbose=False)
served = tf.saved_model.load(serving_dir)
outputs = served.serve([tf.constant(probe["user"]), tf.constant(probe["item"]),
                        tf.constant(probe["history"])])
np.testing.assert_allclose(outputs.numpy(), model.predict(probe, verbose=0), rtol=1e-6)
print("SavedModel serves the same predictions")
