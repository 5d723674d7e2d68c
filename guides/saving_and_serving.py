"""
Title: Saving, checkpointing and serving models with embedding tables
Author: keras_rec_emb authors
Description: `.keras` files, weights, `tf.train.Checkpoint`, atomic saves,
inspecting and stripping tables, and SavedModel export for serving.
"""

"""
## What is saved

An `EmbeddingVariable` table is not a fixed-shape tensor, so it saves its own
parts, in DeepRec's export format: `keys`, `values`, `freqs`, `versions`,
the optimizer `slot:*` rows in the same key order, the EV-initializer matrix
(`default_values`, so ids first seen after a reload start from the same
rows), and with an admission filter `keys_filtered` / `freqs_filtered` /
`versions_filtered` (and a Bloom filter's counters). Every way of saving
below carries all of it.

Set `KRE_GUIDE_SMALL=1` to run on less data (CI does).
"""

import os
import subprocess
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 2_000 if SMALL else 50_000
workdir = tempfile.mkdtemp()
keras.utils.set_random_seed(7)
rng = np.random.default_rng(7)


def make_model():
    ids = keras.Input((4,), dtype="int64", name="ids")
    option = kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(2),
                                         evict_option=kre.GlobalStepEvict(10_000))
    emb = kre.layers.EmbeddingVariable(8, combiner="mean", ev_option=option, name="items")(ids)
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(16, "relu")(emb))
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.AdagradDecay(0.1), loss="binary_crossentropy")
    return model


x = rng.zipf(1.3, (ROWS, 4)) % 100_000 * 1_000_003
y = (x[:, 0] % 3 == 0).astype("float32")
model = make_model()
model.fit(x, y, batch_size=128, epochs=1, verbose=0)
table = model.get_layer("items")
print("admitted ids:", table.table_size(), "counted, not admitted:",
      table.table.stats()["filtered"])
assert table.table.stats()["filtered"] > 0  # one-off ids wait for a second sighting

"""
## `.keras` files

`model.save` / `keras.saving.load_model` round-trip the tables, their
slots, counts and versions, and the optimizer: the reloaded model predicts
identically and keeps training identically. Keras's `model.save` truncates
the target before writing; `keras_rec_emb.save_model` writes to a temporary
file and renames it, so a failed save leaves the previous file intact.
"""

path = os.path.join(workdir, "model.keras")
kre.save_model(model, path)
reloaded = keras.saving.load_model(path)
probe = x[:256]
np.testing.assert_array_equal(model.predict(probe, verbose=0), reloaded.predict(probe, verbose=0))
more = rng.zipf(1.3, (512, 4)) % 100_000 * 1_000_003
for m in (model, reloaded):
    m.fit(more, (more[:, 0] % 3 == 0).astype("float32"), batch_size=128, shuffle=False,
          verbose=0)
np.testing.assert_array_equal(model.predict(probe, verbose=0), reloaded.predict(probe, verbose=0))
print("reloaded model predicts, and keeps training, identically")

"""
## Checkpoints during training

`tf.train.Checkpoint` saves the same parts (DeepRec names them
`NAME-keys`, `NAME-values`, ...; here they live under the layer's table).
Saving evicts stale ids first when an eviction option is set, as DeepRec
does.
"""

ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
ckpt_path = ckpt.save(os.path.join(workdir, "ckpt", "step"))
parts = sorted(name.rsplit("/", 1)[-1] for name, _ in tf.train.list_variables(ckpt_path)
               if "/table/.ATTRIBUTES/" in name)
print("checkpoint parts of the table:", parts)
assert {"keys", "values", "freqs", "versions", "keys_filtered"} <= set(parts)
fresh = make_model()
fresh.optimizer.build(fresh.trainable_variables)
tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(ckpt_path)
np.testing.assert_array_equal(fresh.predict(probe, verbose=0), model.predict(probe, verbose=0))

"""
## Inspecting and stripping for serving

`keras-rec-emb inspect` prints each table's size, filtered count, memory and
first rows. Serving needs no filter counts: `keras-rec-emb strip-filtered`
writes a copy without them (DeepRec ships the same tool).
"""

env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
cli = [sys.executable, "-m", "keras_rec_emb.cli"]
print(subprocess.run(cli + ["inspect", path, "--rows", "2"], env=env, check=True,
                     capture_output=True, text=True).stdout)
served_path = os.path.join(workdir, "serving.keras")
subprocess.run(cli + ["strip-filtered", path, served_path], env=env, check=True,
               capture_output=True)
stripped = keras.saving.load_model(served_path)
assert stripped.get_layer("items").table.stats()["filtered"] == 0
np.testing.assert_array_equal(stripped.predict(probe, verbose=0),  # same as the file it came from
                              keras.saving.load_model(path).predict(probe, verbose=0))
print("stripped copy:", os.path.getsize(served_path), "bytes, was", os.path.getsize(path))

"""
## SavedModel for serving

`model.export` writes a SavedModel whose `serve` function looks ids up
without inserting them (unseen ids read their initial row, or
`default_value_no_permission` under a filter). The process that loads it
needs this package's ops: `import keras_rec_emb` first, then
`tf.saved_model.load` (or TF Serving with the ops library loaded).
"""

export_dir = os.path.join(workdir, "export")
model.export(export_dir, verbose=False)
script = f"""
import numpy as np, tensorflow as tf
import keras_rec_emb  # registers the ops
served = tf.saved_model.load({export_dir!r})
print(served.serve(tf.constant(np.load({os.path.join(workdir, 'probe.npy')!r}))).numpy().ravel()[:4])
"""
np.save(os.path.join(workdir, "probe.npy"), probe)
out = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                     text=True).stdout
print("served in a fresh process:", out.strip())
expected = model.predict(probe, verbose=0).ravel()[:4]
np.testing.assert_allclose(np.array(out.strip().strip("[]").split(), float), expected, rtol=1e-5)

"""
## A SavedModel that needs only TensorFlow

`keras_rec_emb.export_for_serving` writes a SavedModel that stock
TensorFlow (and TF Serving) loads without this package: each table becomes
a `tf.lookup.experimental.MutableHashTable` from key to row number plus a
dense matrix of the admitted rows, and fused group lookups become stock
gathers and segment sums. Unseen ids read their initializer row (or the
no-permission value under a filter), as in `model.predict`. The served
tables are frozen (no inserts or counts); the export is atomic.
"""

plain_dir = os.path.join(workdir, "export_plain")
kre.export_for_serving(model, plain_dir)
script = f"""
import sys, numpy as np, tensorflow as tf
served = tf.saved_model.load({plain_dir!r})  # no keras_rec_emb import
print(served.serve(tf.constant(np.load({os.path.join(workdir, 'probe.npy')!r}))).numpy().ravel()[:4])
assert not any(m.startswith("keras_rec_emb") for m in sys.modules)
"""
out = subprocess.run([sys.executable, "-c", script], env=dict(env, PYTHONPATH=""), check=True,
                     capture_output=True, text=True, cwd="/").stdout
print("served by stock TensorFlow:", out.strip())
np.testing.assert_allclose(np.array(out.strip().strip("[]").split(), float), expected, rtol=1e-5)
