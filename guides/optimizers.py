"""
Title: Choosing an optimizer for sparse models
Author: keras_rec_emb authors
Description: Adagrad, AdagradDecay, Adam, AdamAsync and AdamW on a click
stream whose preferences drift, with loss curves side by side.
"""

"""
## The optimizers

Every optimizer in `keras_rec_emb.optimizers` updates dense weights,
`keras.layers.Embedding` and embedding tables (`EmbeddingVariable`) in one
`model.fit`; tables are updated by one fused kernel per step, on the rows of
the batch only.

* **Adagrad**: the classic for sparse features. Each row's step shrinks as its
  accumulated squared gradient grows, which suits rare ids. On a stream that
  never ends, the accumulators grow without bound and learning stops.
* **AdagradDecay** (DeepRec): Adagrad whose accumulators are multiplied by
  `accumulator_decay_rate` once per `accumulator_decay_step` global steps,
  never below `initial_accumulator_value`. The choice for long-running online
  training: the model keeps adapting.
* **Adam**: Keras's Adam; bias correction from the global step. A row seen for
  the first time late in training gets the step size of a late step.
* **AdamAsync** (DeepRec): Adam whose bias-correction powers live per table
  row, so a new id's first updates are corrected as first updates. With
  `apply_sparse_rmsprop=True`, sparse rows use RMSProp.
* **AdamW**: Adam with decoupled weight decay; for sparse features only the
  rows in the batch decay, so rare ids are not shrunk while absent.

Set `KRE_GUIDE_SMALL=1` to run on less data (CI does).
"""

import os

import keras
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 20_000 if SMALL else 200_000
BATCH = 256

"""
## A drifting click stream

Users and items have hidden preferences; halfway through the stream, the
preferences of half the items flip, as tastes change. The stream is read
once, in order, like online training.
"""

rng = np.random.default_rng(0)
users = rng.zipf(1.2, ROWS) % 5_000 * 1_000_003
items = rng.zipf(1.2, ROWS) % 20_000 * 999_983
item_pref = np.where((items // 999_983) % 2 == 0, 1.0, -1.0)
flip = (np.arange(ROWS) > ROWS // 2) & ((items // 999_983) % 4 == 0)
item_pref = np.where(flip, -item_pref, item_pref)
user_pref = np.where((users // 1_000_003) % 3 == 0, 1.0, -1.0)
logit = 1.5 * user_pref * item_pref
clicks = (rng.random(ROWS) < 1 / (1 + np.exp(-logit))).astype("float32")
inputs = {"user": users, "item": items}


def make_model(optimizer):
    keras.utils.set_random_seed(1)
    user = keras.Input((), dtype="int64", name="user")
    item = keras.Input((), dtype="int64", name="item")
    u = kre.layers.EmbeddingVariable(8, name="user_emb")(user)
    i = kre.layers.EmbeddingVariable(8, name="item_emb")(item)
    x = keras.layers.Concatenate()([u * i, u, i])
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(16, "relu")(x))
    model = keras.Model([user, item], out)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    return model


class BatchLoss(keras.callbacks.Callback):
    """Records the loss of every batch (the running mean Keras reports is
    reset each epoch; here the stream is one epoch)."""

    def on_train_begin(self, logs=None):
        self.losses, self._last = [], 0.0

    def on_train_batch_end(self, batch, logs=None):
        mean = logs["loss"]  # running mean over the batches so far
        self.losses.append(mean * (batch + 1) - self._last)
        self._last = mean * (batch + 1)


"""
## Train the same model with each optimizer
"""

optimizers = {
    # A small initial (floor) accumulator: hot rows' accumulators then grow
    # far beyond it, which is where Adagrad slows down and decay matters.
    "Adagrad": kre.optimizers.Adagrad(0.05, initial_accumulator_value=1e-3),
    "AdagradDecay": kre.optimizers.AdagradDecay(
        0.05, initial_accumulator_value=1e-3,
        accumulator_decay_step=ROWS // BATCH // 16, accumulator_decay_rate=0.5),
    "Adam": kre.optimizers.Adam(0.005),
    "AdamAsync": kre.optimizers.AdamAsync(0.005),
    "AdamW": kre.optimizers.AdamW(weight_decay=0.01, learning_rate=0.005),
}
curves = {}
for name, optimizer in optimizers.items():
    recorder = BatchLoss()
    make_model(optimizer).fit(inputs, clicks, batch_size=BATCH, epochs=1, shuffle=False,
                              verbose=0, callbacks=[recorder])
    curves[name] = np.array(recorder.losses)
    late = curves[name][len(curves[name]) // 2:]
    print(f"{name:13s} mean loss, first half {curves[name][:len(late)].mean():.4f}, "
          f"after the drift {late.mean():.4f}")

"""
## Loss curves side by side

A moving average over 20 batches; the dashed line marks the drift.
"""

fig, ax = plt.subplots(figsize=(8, 4.5))
for name, losses in curves.items():
    smooth = np.convolve(losses, np.ones(20) / 20, mode="valid")
    ax.plot(smooth, label=name)
ax.axvline(ROWS // 2 // BATCH, color="gray", linestyle="--")
ax.set_xlabel("batch")
ax.set_ylabel("log loss")
ax.set_title("Online training on a drifting click stream")
ax.legend()
fig.tight_layout()
fig.savefig("optimizers_loss.png", dpi=100)
print("wrote", os.path.abspath("optimizers_loss.png"))
assert all(np.isfinite(c).all() for c in curves.values())

"""
## Reading the curves

Compare Adagrad with AdagradDecay after the drift: with the same learning
rate, decayed accumulators leave hot rows a larger step, so AdagradDecay
re-learns the flipped items faster; the gap grows with the length of the
stream. AdamW matches Adam here because the decay touches only the rows of
each batch and the rates are small; it matters for long-lived rare ids.
AdamAsync differs from Adam in how new ids start: each row's bias correction
counts that row's own updates.
"""
