"""
Title: String ids: Criteo-style hex categories from Parquet
Author: keras_rec_emb contributors
Date created: 2026/11/28
Last modified: 2026/11/28
Description: Hash string categories to table keys as DeepRec does, '' and nulls as missing, and serve raw strings.
Accelerator: None
"""

"""
## Introduction

Real click logs keep their categorical features as strings: Criteo's 26
categorical columns are 8-digit hex values, and many are empty. DeepRec's
string embedding variables hash each string with
`tf.strings.to_hash_bucket_fast(s, 2**63 - 1)` and treat the empty string as
missing: no row is read or inserted for it and it gets no gradient.

`keras_rec_emb.layers.HashStrings` does exactly that in front of
`EmbeddingVariable` or `GroupEmbedding`. (`keras.layers.Hashing(num_bins,
mask_value="")` would shift every id by one and make `''` a key.) Its op is
stock TensorFlow, so an exported model serves raw strings.

This guide writes a small Criteo-like Parquet file, reads its string
columns with `ParquetDataset` (nulls read as `''`), trains two models on it
and serves one from a SavedModel in a process that never imports this
package. Set `KRE_GUIDE_SMALL=1` for a quick run.
"""

"""
## Setup
"""

import json
import os
import subprocess
import sys
import tempfile

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.data import ParquetDataset

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 4_000 if SMALL else 100_000
NUM_CAT = 4
keras.utils.set_random_seed(42)
workdir = tempfile.mkdtemp()

"""
## A Criteo-like file

Four categorical columns `C1..C4` of hex strings; about 20% of the values
are null (written as Parquet nulls) and a few are empty strings. The label
depends on `C1` and `C2`.
"""

rng = np.random.default_rng(0)
vocab = [np.array([f"{v:08x}" for v in rng.integers(0, 2**32, size=200)])
         for _ in range(NUM_CAT)]
codes = rng.integers(0, 200, size=(ROWS, NUM_CAT))
columns = {}
for j in range(NUM_CAT):
    values = vocab[j][codes[:, j]].astype(object)
    values[rng.random(ROWS) < 0.2] = None
    values[rng.random(ROWS) < 0.02] = ""
    columns[f"C{j + 1}"] = pa.array(values.tolist(), pa.string())
logits = np.where(codes[:, 0] % 2 == 0, 1.0, -1.0) + np.where(codes[:, 1] % 3 == 0, 1.5, -0.5)
columns["label"] = pa.array((logits + rng.normal(0, 0.5, ROWS) > 0).astype(np.float32))
path = os.path.join(workdir, "criteo.parquet")
pq.write_table(pa.table(columns), path, row_group_size=ROWS // 4)

"""
`ParquetDataset` reads string columns as `tf.string`; nulls read as `''`.
"""

dataset = ParquetDataset(path, batch_size=256)
batch = next(iter(dataset))
print(batch["C1"][:5])
print("missing in the first batch:", int(tf.reduce_sum(tf.cast(batch["C1"] == "", tf.int32))))

"""
## The hash, checked against DeepRec's rule

A `[batch]` string column becomes `[batch, None]` ragged keys: one key per
present string, none for a missing one.
"""

hashed = kre.layers.HashStrings()(batch["C1"][:5])
print(hashed)
present = tf.boolean_mask(batch["C1"][:5], batch["C1"][:5] != "")
np.testing.assert_array_equal(hashed.flat_values.numpy(),
                              tf.strings.to_hash_bucket_fast(present, 2**63 - 1).numpy())

"""
## One EmbeddingVariable per column

Each column gets its own table; a `combiner` pools the (zero or one) key of
each row, so a missing value embeds as zeros.
"""

names = [f"C{j + 1}" for j in range(NUM_CAT)]


def features(batch):
    return {n: batch[n] for n in names}, batch["label"]


inputs = {n: keras.Input((), dtype="string", name=n) for n in names}
embedded = [kre.layers.EmbeddingVariable(8, combiner="sum", name=f"ev_{n}")(
    kre.layers.HashStrings(name=f"hash_{n}")(inputs[n])) for n in names]
hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()(embedded))
model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
model.compile(kre.optimizers.Adam(0.01), "binary_crossentropy", metrics=["auc"])
history = model.fit(dataset.map(features), epochs=4 if SMALL else 3, verbose=2)

"""
The tables hold one key per distinct present string, never one for `''`.
"""

ev = model.get_layer("ev_C1")
keys = set(ev.export()["keys"].tolist())
empty_key = int(tf.strings.to_hash_bucket_fast([""], 2**63 - 1)[0])
print("C1 table size:", ev.table_size(), "'' is a key:", empty_key in keys)
assert empty_key not in keys

"""
## All columns in one GroupEmbedding

`GroupEmbedding` takes all its features' ids as one `[batch, F]` tensor and
drops ids `< 0` as padding. `HashStrings(missing="pad")` keeps the shape and
writes `-1` for a missing string: one hash op, one fused lookup.
"""


def stacked(batch):
    return tf.stack([batch[n] for n in names], axis=1), batch["label"]


specs = {n: kre.layers.FeatureSpec({"embedding_dim": 8, "name": f"t_{n}"}, combiner="sum")
         for n in names}
strings_in = keras.Input((NUM_CAT,), dtype="string", name="categories")
keys_in = kre.layers.HashStrings(missing="pad", name="hash")(strings_in)
group = kre.layers.GroupEmbedding(specs, output_mode="concat", name="group")(keys_in)
hidden = keras.layers.Dense(16, activation="relu")(group)
grouped = keras.Model(strings_in, keras.layers.Dense(1, activation="sigmoid")(hidden))
grouped.compile(kre.optimizers.Adam(0.01), "binary_crossentropy", metrics=["auc"])
grouped.fit(dataset.map(stacked), epochs=4 if SMALL else 3, verbose=2)

"""
## Serving raw strings with TensorFlow alone

`export_for_serving` writes a SavedModel of stock ops: the hash, hash tables
and gathers. A fresh process loads it without `keras_rec_emb` and feeds it
strings, unseen and missing ones included.
"""

serving_path = kre.export_for_serving(grouped, os.path.join(workdir, "serving"))
requests = np.array([[vocab[j][k] for j in range(NUM_CAT)] for k in range(3)]
                    + [["", "", "", ""], ["ffffffff", "", "0", "x"]])
np.save(os.path.join(workdir, "requests.npy"), requests)
code = (
    "import sys, numpy as np, tensorflow as tf\n"
    "m = tf.saved_model.load(sys.argv[1])\n"
    "x = tf.constant(np.load(sys.argv[2]))\n"
    "print(m.serve(x).numpy().ravel().tolist(), 'keras_rec_emb' in sys.modules)\n")
served = subprocess.run([sys.executable, "-c", code, serving_path,
                         os.path.join(workdir, "requests.npy")],
                        capture_output=True, text=True, timeout=300, check=True)
print(served.stdout)
scores, imported = served.stdout.rsplit(" ", 1)
assert imported.strip() == "False"
np.testing.assert_allclose(json.loads(scores), grouped.predict(tf.constant(requests), verbose=0).ravel(),
                           rtol=1e-5, atol=1e-6)
