"""
Title: A DLRM-style model with GroupEmbedding
Author: keras_rec_emb authors
Description: 26 categorical features embedded by one fused lookup op, 13
dense features through an MLP, and DLRM's pairwise dot-product interaction,
trained with `model.fit` on synthetic Criteo-like data.
"""

"""
## Why group the lookups?

A click-through-rate model such as DLRM embeds tens to hundreds of sparse
features. With one embedding layer per feature, every training step runs a
lookup, a combine and their gradients per feature: hundreds of small ops.
`keras_rec_emb.layers.GroupEmbedding` (DeepRec's Group Embedding) runs all of
them in one C++ op forward and one backward, whatever the number of
features, and hands each table a deduplicated sparse gradient.

When the environment variable `KRE_GUIDE_SMALL=1` is set, this guide runs on
less data (CI runs it that way).
"""

import os
import tempfile

import keras
import numpy as np

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 4_096 if SMALL else 200_000
NUM_DENSE, NUM_SPARSE, DIM = 13, 26, 8
keras.utils.set_random_seed(42)

"""
## Synthetic Criteo-like data

13 dense features (log-normal counts) and 26 categorical features. Ids are
hashed 64-bit values (so no vocabulary is needed) drawn from Zipf
distributions; each categorical feature has 1 to 3 ids per example, padded
with -1 (GroupEmbedding drops ids < 0). The label depends on a few hidden
"good" ids and on one dense feature.
"""

rng = np.random.default_rng(0)
dense = np.log1p(rng.lognormal(0, 1, (ROWS, NUM_DENSE))).astype("float32")
sparse = {}
logit = dense[:, 0] - 1.0
for f in range(NUM_SPARSE):
    ranks = rng.zipf(1.3, (ROWS, 3)) % 10_000
    ids = (ranks * 2_654_435_761 + f) % 10**12
    lengths = rng.integers(1, 4, ROWS)
    ids[np.arange(3)[None, :] >= lengths[:, None]] = -1
    sparse[f"C{f + 1}"] = ids
    if f < 4:
        logit += 1.5 * (ranks[:, 0] % 3 == 0)
labels = (rng.random(ROWS) < 1 / (1 + np.exp(-logit))).astype("float32")
x = {"dense": dense, **sparse}

"""
## The model

One `EmbeddingVariable` table per categorical feature, all in one
`GroupEmbedding` (`output_mode="dict"`). A `FeatureSpec` says which table a
feature reads and how its ids combine; one table may serve several features.
"""

group = kre.layers.GroupEmbedding(
    {name: kre.layers.FeatureSpec({"embedding_dim": DIM}, combiner="sum")
     for name in sparse},
    name="sparse_embeddings",
)

inputs = {"dense": keras.Input((NUM_DENSE,), name="dense")}
for name in sparse:
    inputs[name] = keras.Input((3,), dtype="int64", name=name)

bottom = keras.Sequential([keras.layers.Dense(32, activation="relu"),
                           keras.layers.Dense(DIM, activation="relu")], name="bottom_mlp")
dense_vec = bottom(inputs["dense"])
embedded = group({name: inputs[name] for name in sparse})

"""
DLRM's interaction: stack the dense vector and the 26 embeddings into
`[batch, 27, DIM]`, take all pairwise dot products, keep the upper triangle.
"""


@keras.saving.register_keras_serializable(package="guide")
class DotInteraction(keras.layers.Layer):
    """Pairwise dot products of feature vectors (upper triangle)."""

    def call(self, vectors):
        stacked = keras.ops.stack(vectors, axis=1)
        dots = keras.ops.matmul(stacked, keras.ops.transpose(stacked, (0, 2, 1)))
        n = len(vectors)
        rows, cols = np.triu_indices(n, k=1)
        flat = keras.ops.reshape(dots, (-1, n * n))
        return keras.ops.take(flat, rows * n + cols, axis=1)


interaction = DotInteraction()([dense_vec] + [embedded[name] for name in sparse])
top = keras.layers.Concatenate()([dense_vec, interaction])
top = keras.layers.Dense(64, activation="relu")(top)
output = keras.layers.Dense(1, activation="sigmoid")(top)
model = keras.Model(inputs, output)

"""
## Training

Our optimizers update the dense weights exactly as Keras does and each
table with one fused sparse kernel.
"""

model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="binary_crossentropy",
              metrics=[keras.metrics.AUC(name="auc")])
history = model.fit(x, labels, batch_size=256, epochs=2 if SMALL else 3,
                    validation_split=0.1, verbose=2)
print("tables:", {t.name: t.table_size() for t in group.tables[:3]}, "...")

"""
## Saving and reloading

`model.save` keeps every table row; the reloaded model predicts the same.
"""

path = os.path.join(tempfile.mkdtemp(), "dlrm.keras")
model.save(path)
reloaded = keras.saving.load_model(path)
sample = {k: v[:512] for k, v in x.items()}
np.testing.assert_allclose(reloaded.predict(sample, verbose=0),
                           model.predict(sample, verbose=0), rtol=1e-5, atol=1e-6)
print("reloaded predictions match")
