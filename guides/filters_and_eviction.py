"""
Title: Feature filters and eviction
Author: keras_rec_emb authors
Description: Keep rare ids out of the table with a counter or counting Bloom
filter, and drop stale or weak ids with global-step and L2-weight eviction.
"""

"""
## Why filter and evict?

In click logs most ids are rare: a long tail of items, users and crosses
seen once or twice. Their embeddings barely train, invite overfitting and
still cost a row (plus optimizer slots) each. And on a stream that never
ends, ids stop appearing while the table keeps their rows forever.

`EmbeddingVariableOption` (DeepRec's EmbeddingVariable options) addresses both:

* **Feature filters** admit an id only once training has seen it
  `filter_freq` times. Until then it reads `default_value_no_permission`
  (0.0 by default) and its gradients are dropped.
  * `CounterFilter` counts exactly: every id gets an index entry and a count,
    but no row.
  * `CBFFilter` counts in a counting Bloom filter: ids that are not admitted
    cost no table entry at all, only a share of the fixed-size counters. A
    false positive admits an id early.
* **Eviction** erases ids from the table (rows, slots, metadata):
  * `GlobalStepEvict(steps_to_live)`: ids not updated during the last
    `steps_to_live` optimizer steps.
  * `L2WeightEvict(l2_weight_threshold)`: ids whose embedding is small,
    `0.5 * sum(row**2) < l2_weight_threshold` (DeepRec's rule).

  As in DeepRec, eviction runs whenever the model or a checkpoint is saved;
  here also on `layer.evict()` and from
  `keras_rec_emb.callbacks.EvictionCallback` during `model.fit`.

Set `KRE_GUIDE_SMALL=1` to run on less data (CI does).
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 20_000 if SMALL else 200_000
BATCH = 256
keras.utils.set_random_seed(42)
rng = np.random.default_rng(0)

"""
## A click stream where most ids are rare

Each example is one item id and a click. Item popularity follows a Zipf law,
so a few items make up much of the traffic and most items appear once; ids
are scattered over a space of `10**15`. Clicks depend on a hidden property of
the item (the parity of its rank), which the model can only learn for items
it sees often.
"""


def click_stream(rows, rng):
    ranks = rng.zipf(1.2, rows)
    items = ranks * 7_919_000_000_003 % 10**15
    clicks = (rng.random(rows) < np.where(ranks % 2 == 0, 0.3, 0.05)).astype("float32")
    return items, clicks


items, clicks = click_stream(ROWS, rng)
ids, counts = np.unique(items, return_counts=True)
count_of = dict(zip(ids.tolist(), counts.tolist()))
print(f"{ROWS} clicks, {ids.size} distinct items, "
      f"{np.mean(counts == 1):.0%} of them seen once, "
      f"{np.mean(counts >= 3):.0%} seen 3 times or more")
assert np.mean(counts == 1) > 0.5  # most ids are rare

"""
## CounterFilter: admit ids seen `filter_freq` times

One `EmbeddingVariable` with `CounterFilter(filter_freq=3)`: an id gets a row
on its third training lookup. `table_size()` counts admitted ids;
`table.stats()["filtered"]` counts ids that were seen but not admitted.
"""

FILTER_FREQ = 3


def ctr_model(ev_option, dim=8, initializer="truncated_normal", optimizer=None):
    """Item id -> EmbeddingVariable -> click probability."""
    item = keras.Input((), dtype="int64", name="item")
    emb = kre.layers.EmbeddingVariable(dim, initializer=initializer, ev_option=ev_option,
                                       name="item_emb")
    out = keras.layers.Dense(1, activation="sigmoid")(emb(item))
    model = keras.Model(item, out)
    model.compile(optimizer=optimizer or kre.optimizers.Adagrad(0.1),
                  loss="binary_crossentropy")
    return model


counter_option = kre.EmbeddingVariableOption(
    filter_option=kre.CounterFilter(filter_freq=FILTER_FREQ))
model = ctr_model(counter_option)
model.fit(items, clicks, batch_size=BATCH, epochs=1, verbose=2)
emb = model.get_layer("item_emb")

stats = emb.table.stats()
print(f"distinct ids seen: {ids.size}, admitted: {emb.table_size()}, "
      f"filtered (counted, no row): {stats['filtered']}")
assert emb.table_size() == np.sum(counts >= FILTER_FREQ)
assert stats["filtered"] == np.sum(counts < FILTER_FREQ)

"""
`export()` lists the filtered ids with their counts in `keys_filtered` and
`freqs_filtered` (admitted ids are in `keys`, with `freqs`). As in DeepRec,
an admitted id's frequency stays at `filter_freq`; pass
`EmbeddingVariableOption(record_freq=True)` to keep counting it.
"""


def filtered_counts(layer):
    """{id: count} of the ids a layer's filter has counted but not admitted."""
    data = layer.export()
    return dict(zip(data["keys_filtered"].tolist(), data["freqs_filtered"].tolist()))


data = emb.export()
assert all(count_of[k] == c for k, c in filtered_counts(emb).items())
assert all(min(count_of[k], FILTER_FREQ) == c
           for k, c in zip(data["keys"].tolist(), data["freqs"].tolist()))

"""
### A filtered id reads 0 and does not train

Take an id seen once. It reads `default_value_no_permission` (0.0). A
training step on it counts it (now 2) but drops its gradient: it still
reads 0 and has no row. The step that brings its count to `filter_freq`
admits it: it gets its initializer row and trains from then on.
"""

rare = next(k for k, c in filtered_counts(emb).items() if c == 1)
rare_batch = np.array([rare])


def embedding_of(layer, item_id):
    return keras.ops.convert_to_numpy(layer(np.array([item_id]), training=False))[0]


np.testing.assert_array_equal(embedding_of(emb, rare), np.zeros(8))
model.train_on_batch(rare_batch, np.ones((1, 1)))
np.testing.assert_array_equal(embedding_of(emb, rare), np.zeros(8))
count = filtered_counts(emb)[rare]
print(f"id {rare}: count {count}, still filtered, reads {embedding_of(emb, rare)[:3]}...")
assert count == 2

size_before = emb.table_size()
model.train_on_batch(rare_batch, np.ones((1, 1)))
# DeepRec's timing: the 3rd lookup admits the id (its row is created and
# this step's gradient trains it) but still reads the no-permission value;
# from the next lookup on it reads its row.
print(f"id {rare}: admitted by its 3rd lookup, now reads {embedding_of(emb, rare)[:3]}...")
assert emb.table_size() == size_before + 1
assert np.any(embedding_of(emb, rare) != 0)

"""
## CBFFilter: the same admission, less memory

A counter filter keeps an index entry and a count for every id it has seen,
so with a long tail most of its memory goes to ids that will never be
admitted. `CBFFilter` counts them in a counting Bloom filter instead, sized
for `max_element_size` distinct ids at a `false_positive_probability`
(`sizing()` gives counters, hashes and bytes per counter); `counter_type`
`"uint8"` is enough for a small `filter_freq` (counters saturate).

Below, three tables see the same training lookups (calling the layer with
`training=True`, as `model.fit` does): no filter, the counter filter and a
CBF with 1-byte counters. `table.stats()["memory_bytes"]` counts index,
rows, metadata and Bloom counters.
"""

cbf = kre.CBFFilter(FILTER_FREQ, max_element_size=int(ids.size),
                    false_positive_probability=0.01, counter_type="uint8")
print("CBF (counters, hashes, bytes per counter):", cbf.sizing())
layers = {name: kre.layers.EmbeddingVariable(
    8, ev_option=kre.EmbeddingVariableOption(filter_option=option))
    for name, option in [("none", None),
                         ("counter", kre.CounterFilter(FILTER_FREQ)),
                         ("cbf", cbf)]}
for start in range(0, ROWS, BATCH):
    for layer in layers.values():
        layer(items[start:start + BATCH], training=True)

for name, layer in layers.items():
    s = layer.table.stats()
    print(f"{name:>8}: admitted {s['size']:>6}, filtered {s['filtered']:>6}, "
          f"{s['memory_bytes'] / 1024:8.1f} KiB")
memory = {name: layer.table.memory_bytes() for name, layer in layers.items()}
admissible = np.sum(counts >= FILTER_FREQ)
assert layers["counter"].table_size() == admissible
# The CBF admits every id seen filter_freq times, plus a few false positives,
# and keeps nothing for the others but its counters.
assert admissible <= layers["cbf"].table_size() <= admissible + 0.01 * ids.size
assert layers["cbf"].table.stats()["filtered"] == 0
assert memory["cbf"] < memory["counter"] < memory["none"]

"""
With few frequent ids, the CBF wins. When many ids pass the threshold, the
counter filter's entries become rows anyway and the CBF's counters are pure
overhead; `benchmarks/filters.py` measures both filters' speed and memory.

## GlobalStepEvict: bound the table on a stream of new ids

A stream keeps bringing ids that are never seen again (new items, sessions).
Below, every batch holds 64 ids from a fixed hot set and 192 ids never seen
before. `GlobalStepEvict(steps_to_live=STEPS_TO_LIVE)` erases ids not updated
during the last `STEPS_TO_LIVE` optimizer steps; `EvictionCallback` runs it
every 10 steps and at the end of each epoch. A second model without eviction
trains on the same stream for comparison.
"""

HOT, NEW, STEPS_TO_LIVE = 64, 192, 5
STEPS, EPOCHS = (20, 3) if SMALL else (100, 5)
hot_ids = np.arange(HOT, dtype="int64") * 1_000_003


def drifting_stream():
    """Batch t: the hot ids plus NEW ids seen in no other batch."""
    def batch(t):
        new = 10**12 + t * NEW + tf.range(NEW, dtype=tf.int64)
        x = tf.concat([hot_ids, new], 0)
        return x, tf.cast(x % 3 == 0, tf.float32)[:, None]
    return tf.data.Dataset.counter().map(batch)


class TableSizes(keras.callbacks.Callback):
    """Records the table size at the end of each epoch (after eviction)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def on_epoch_end(self, epoch, logs=None):
        self.sizes.append(self.model.get_layer("item_emb").table_size())


def fit_stream(ev_option, callbacks):
    model = ctr_model(ev_option)
    sizes = TableSizes()
    model.fit(drifting_stream(), epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False,
              verbose=0, callbacks=callbacks + [sizes])
    return model, sizes.sizes


evicting_option = kre.EmbeddingVariableOption(
    evict_option=kre.GlobalStepEvict(steps_to_live=STEPS_TO_LIVE))
eviction = kre.callbacks.EvictionCallback(every_n_steps=10)
evicting, sizes = fit_stream(evicting_option, [eviction])
_, sizes_kept = fit_stream(kre.EmbeddingVariableOption(), [])
for epoch, (a, b) in enumerate(zip(sizes, sizes_kept)):
    print(f"epoch {epoch}: table size {a:>6} with eviction, {b:>6} without")
print(f"ids evicted during fit: {eviction.evicted}")

"""
After an eviction at step `s` the table holds only ids updated at steps
`s - STEPS_TO_LIVE .. s`: the hot ids and at most `STEPS_TO_LIVE + 1` batches
of new ids. Without eviction it holds every id ever seen.
"""

bound = HOT + (STEPS_TO_LIVE + 1) * NEW
assert all(size <= bound for size in sizes)
assert sizes_kept == [HOT + (e + 1) * STEPS * NEW for e in range(EPOCHS)]
assert np.isin(hot_ids, evicting.get_layer("item_emb").export()["keys"]).all()

"""
## L2WeightEvict: drop ids whose embedding stayed small

`L2WeightEvict(l2_weight_threshold)` erases ids whose row is small:
`0.5 * sum(row**2) < l2_weight_threshold` (DeepRec's rule, half the squared
L2 norm). With rows that start at zero and plain SGD, an id's
row grows with the gradient it receives, so ids seen once stay small. Here
we evict by hand with `layer.evict()` and check what went against the
exported rows.
"""

L2_THRESHOLD = 5e-7  # 0.5 * sum(row**2) < 5e-7: rows with an L2 norm below 1e-3
l2_option = kre.EmbeddingVariableOption(
    evict_option=kre.L2WeightEvict(l2_weight_threshold=L2_THRESHOLD))
l2_model = ctr_model(l2_option, initializer="zeros", optimizer=kre.optimizers.SGD(0.1))
l2_model.fit(items, clicks, batch_size=BATCH, epochs=1, verbose=0)
l2_emb = l2_model.get_layer("item_emb")

data = l2_emb.export()
half_sq = 0.5 * np.sum(np.square(data["values"]), axis=1)
weak = half_sq < L2_THRESHOLD
once, often = data["freqs"] == 1, data["freqs"] >= 100
print(f"below the threshold: {weak[once].mean():.0%} of ids seen once, "
      f"{weak[often].mean():.0%} of ids seen 100 times or more")
assert weak[once].mean() > 0.9 and weak[often].mean() < 0.5
size_before = l2_emb.table_size()
evicted = l2_emb.evict()
print(f"L2WeightEvict({L2_THRESHOLD}) evicted {evicted} of {size_before} ids")
assert evicted == np.sum(weak) > 0
assert l2_emb.table_size() == size_before - evicted
assert np.array_equal(np.sort(l2_emb.export()["keys"]), np.sort(data["keys"][~weak]))

"""
## Saving keeps the filter's counts

`model.save` (and `tf.train.Checkpoint`) saves the ids a filter has counted
but not admitted, with their counts (and a CBF's counters), so training
resumes where it stopped: an id seen twice before saving is admitted by its
first lookup after reloading.
"""

workdir = tempfile.mkdtemp()
path = os.path.join(workdir, "filtered.keras")
model.save(path)
reloaded = keras.saving.load_model(path).get_layer("item_emb")
saved, loaded = emb.export(), reloaded.export()
order_saved, order_loaded = np.argsort(saved["keys_filtered"]), np.argsort(loaded["keys_filtered"])
np.testing.assert_array_equal(saved["keys_filtered"][order_saved],
                              loaded["keys_filtered"][order_loaded])
np.testing.assert_array_equal(saved["freqs_filtered"][order_saved],
                              loaded["freqs_filtered"][order_loaded])
print(f"reloaded: {reloaded.table_size()} admitted ids, "
      f"{loaded['keys_filtered'].size} filtered ids with their counts")

seen_twice = loaded["keys_filtered"][loaded["freqs_filtered"] == FILTER_FREQ - 1][0]
size_before = reloaded.table_size()
reloaded(np.array([seen_twice]), training=True)
assert reloaded.table_size() == size_before + 1

"""
Filtered ids can be most of a table's entries. To save only admitted ids,
pass `EmbeddingVariableOption(save_filtered=False)` or set the environment
variable `KRE_EV_SAVE_FILTERED_FEATURES=false` (DeepRec's name) when
saving; a reloaded table then counts every filtered id from zero again.
"""

os.environ["KRE_EV_SAVE_FILTERED_FEATURES"] = "false"
try:
    model.save(path)
finally:
    del os.environ["KRE_EV_SAVE_FILTERED_FEATURES"]
stripped = keras.saving.load_model(path).get_layer("item_emb")
print(f"saved with KRE_EV_SAVE_FILTERED_FEATURES=false: {stripped.table_size()} "
      f"admitted ids, {stripped.export()['keys_filtered'].size} filtered ids")
assert stripped.table_size() == emb.table_size()
assert stripped.export()["keys_filtered"].size == 0
assert stripped.table.stats()["filtered"] == 0
