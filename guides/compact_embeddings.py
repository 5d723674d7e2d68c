"""
Title: Compact embeddings: MultiHashEmbedding and AdaptiveEmbedding
Author: keras_rec_emb authors
Description: Two ways to embed millions of ids in far fewer parameters than
one row per id, compared with a full EmbeddingVariable on synthetic clicks.
"""

"""
## One row per id is not always affordable

`EmbeddingVariable` gives every id its own row: no collisions, but memory
grows with the number of distinct ids. Two layers trade a little accuracy
for much less memory:

* `MultiHashEmbedding` (DeepRec's Multi-Hash Variable, the
  quotient-remainder trick of "Compositional Embeddings Using Complementary
  Partitions"): id `x` in `[0, N)` is the pair `(x // m, x mod m)` and its
  embedding combines one row of a `ceil(N / m)`-row table with one of an
  `m`-row table. With `m = ceil(sqrt(N))`, a million ids need 2,000 rows,
  and no two ids share both rows.
* `AdaptiveEmbedding` (DeepRec's Adaptive Embedding): rare ids share a small
  hashed table; an id seen `promote_threshold` times in training is promoted
  to its own EmbeddingVariable row, starting from what it learnt in the
  shared table.

When the environment variable `KRE_GUIDE_SMALL=1` is set, this guide runs on
less data (CI runs it that way).
"""

import os
import time

import keras
import numpy as np

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 30_000 if SMALL else 400_000
N_USERS = 20_000 if SMALL else 200_000
N_ITEMS = 20_000 if SMALL else 200_000
DIM = 16
keras.utils.set_random_seed(7)

"""
## Data: long-tailed users and items

Ids follow a Zipf law, as in real logs: a few ids are very frequent, most
are rare. Each user and item has a hidden taste; a click is likelier when
both tastes are high.
"""

rng = np.random.default_rng(0)
users = (rng.zipf(1.3, ROWS) - 1) % N_USERS
items = (rng.zipf(1.3, ROWS) - 1) % N_ITEMS
user_taste = rng.normal(size=N_USERS)
item_taste = rng.normal(size=N_ITEMS)
logit = 1.5 * (user_taste[users] + item_taste[items])
clicks = (rng.random(ROWS) < 1 / (1 + np.exp(-logit))).astype("float32")
split = int(ROWS * 0.8)
train = {"user": users[:split], "item": items[:split]}
test = {"user": users[split:], "item": items[split:]}
print(f"{len(np.unique(users[:split]))} users and {len(np.unique(items[:split]))} "
      "items in the training data")

"""
## Three models that differ only in their embedding layers

`make_embedding(name)` returns the layer for one feature; the rest of the
model is shared.
"""


def build(make_embedding):
    user_in = keras.Input((), dtype="int64", name="user")
    item_in = keras.Input((), dtype="int64", name="item")
    u = make_embedding("user_emb", N_USERS)(user_in)
    i = make_embedding("item_emb", N_ITEMS)(item_in)
    x = keras.layers.Concatenate()([u, i, u * i])
    x = keras.layers.Dense(16, activation="relu")(x)
    out = keras.layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model([user_in, item_in], out)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


CANDIDATES = {
    # One row per id (the reference).
    "EmbeddingVariable": lambda name, n: kre.layers.EmbeddingVariable(DIM, name=name),
    # Quotient-remainder: ceil(n / m) + m rows, m = ceil(sqrt(n)).
    "MultiHashEmbedding": lambda name, n: kre.layers.MultiHashEmbedding(
        n, DIM, complementary_strategy="Q-R", operation="add", name=name),
    # A shared table of n / 20 rows plus EV rows for ids seen 5 times.
    "AdaptiveEmbedding": lambda name, n: kre.layers.AdaptiveEmbedding(
        DIM, hash_bucket_size=n // 20, promote_threshold=5, name=name),
}

"""
## Counting parameters

A Keras weight counts its rows; an EmbeddingVariable counts the ids it
admitted; an AdaptiveEmbedding counts its shared rows plus its promoted
ids.
"""


def embedding_rows(layer):
    if isinstance(layer, kre.layers.EmbeddingVariable):
        return layer.table_size()
    if isinstance(layer, kre.layers.MultiHashEmbedding):
        return sum(layer.partition_sizes)
    return layer.hash_bucket_size + layer.promoted_ids().size


"""
## Train and compare

Each model trains for two epochs; AUC is measured on held-out clicks.
"""

results = []
for name, make in CANDIDATES.items():
    model = build(make)
    start = time.time()
    model.fit(train, clicks[:split], batch_size=512, epochs=2, verbose=0)
    seconds = time.time() - start
    auc = model.evaluate(test, clicks[split:], batch_size=2048, verbose=0,
                         return_dict=True)["auc"]
    rows = sum(embedding_rows(model.get_layer(f)) for f in ("user_emb", "item_emb"))
    results.append((name, rows, rows * DIM, auc, seconds))

print(f"\n{'embedding':<20} {'rows':>9} {'parameters':>11} {'test AUC':>9} {'train s':>8}")
for name, rows, params, auc, seconds in results:
    print(f"{name:<20} {rows:>9,} {params:>11,} {auc:>9.4f} {seconds:>8.1f}")

full = results[0][2]
for name, _, params, auc, _ in results[1:]:
    print(f"{name}: {params / full:.1%} of the full table's parameters, "
          f"AUC {auc - results[0][3]:+.4f}")
    assert params < full

"""
The multi-hash tables are sized by the id *range* (`sqrt` of it, twice),
the adaptive one by the shared table plus the ids that proved frequent, and
the full EmbeddingVariable by every distinct id seen.

## Inspecting promotion

`promotion_state()` returns the promoted ids with their frequencies and the
ids still counting towards `promote_threshold`. `model.save` keeps all of
it, so training resumes where it stopped.
"""

adaptive = build(CANDIDATES["AdaptiveEmbedding"])
adaptive.fit(train, clicks[:split], batch_size=512, epochs=1, verbose=0)
state = adaptive.get_layer("item_emb").promotion_state()
print(f"{state['promoted_ids'].size} items promoted (seen >= 5 times), "
      f"{state['counting_ids'].size} still in the shared table")
top = np.argsort(state["promoted_freqs"])[::-1][:3]
print("most frequent:", dict(zip(state["promoted_ids"][top].tolist(),
                                 state["promoted_freqs"][top].tolist())))

"""
## Routing by hand

An explicit mask (1 = own row, 0 = shared table) overrides the frequency
rule, as DeepRec's `adaptive_mask_tensors`: in training an id masked 1 gets
an EV row copied from its shared row.
"""

layer = kre.layers.AdaptiveEmbedding(4, hash_bucket_size=10)
ids = np.array([3, 4, 5])
layer(ids, adaptive_mask=np.array([1, 0, 1]), training=True)
print("promoted by the mask:", layer.promoted_ids())

"""
## Choosing

* `MultiHashEmbedding` when ids live in a known range `[0, N)` (or can be
  hashed into one) and memory must be fixed in advance: `O(sqrt(N))` rows
  (`O(N ** (1/k))` with `complementary_strategy="generalized_QR"` or
  `"CRT"` and `k` tables) and any Keras optimizer.
* `AdaptiveEmbedding` when a long tail of ids is rare: they share rows, and
  the frequent ones get their own, grown as data arrives.
"""
