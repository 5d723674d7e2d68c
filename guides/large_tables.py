"""
Title: Tables larger than memory: the file tier
Author: keras_rec_emb authors
Description: a table whose rows live in files behind a bounded DRAM cache,
trained with `model.fit`, snapshotted, restored, saved and inspected.
"""

"""
## The file tier

`StorageOption("FILE", storage_path=..., storage_size=...)` keeps a table's
rows (values and optimizer slots) in append-only segment files under
`storage_path/<table name>/` and holds only a cache of hot rows in DRAM
(`storage_size` bytes, CLOCK replacement; dirty rows are written back when
they leave the cache). The key index and per-key frequency/version stay in
DRAM. Everything else is as on a DRAM table: lookups, the fused optimizer
updates, filters, eviction, `export()`, `model.save`, `tf.train.Checkpoint`
and `export_for_serving` give the same numbers.

Set `KRE_GUIDE_SMALL=1` to run on less data (CI does).
"""

import gc
import os
import subprocess
import sys
import tempfile

import keras
import numpy as np

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 4_000 if SMALL else 200_000
VOCAB = 50_000 if SMALL else 5_000_000
workdir = tempfile.mkdtemp()
store = os.path.join(workdir, "store")
rng = np.random.default_rng(0)
ids = (rng.zipf(1.1, size=(ROWS, 8)) % VOCAB).astype(np.int64)
labels = rng.normal(size=(ROWS, 1)).astype(np.float32)

"""
## A model with a file-tier table

The cache below is 64 KiB: far smaller than the table it fronts.
"""

option = kre.EmbeddingVariableOption(
    storage_option=kre.StorageOption("FILE", storage_path=store, storage_size=64 << 10),
    num_shards=4)


def make_model():
    keras.utils.set_random_seed(7)
    inp = keras.Input((8,), dtype="int64", name="ids")
    emb = kre.layers.EmbeddingVariable(16, ev_option=option, combiner="mean",
                                       name="big")(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(emb))
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="mse")
    return model


model = make_model()
model.fit(ids, labels, batch_size=256, epochs=1, verbose=0)
layer = model.get_layer("big")
stats = layer.stats()
print(f"{stats['rows']:,} rows, {stats['cached_rows']:,} in the DRAM cache "
      f"({stats['cache_memory_bytes']:,} bytes), {stats['disk_bytes']:,} bytes on disk, "
      f"hit rate {stats['cache_hit_rate']:.2f}")
assert stats["cached_rows"] < stats["rows"]

"""
## Snapshots

`layer.snapshot()` makes the table durable without moving rows through
Python: dirty rows are written, the segment files are fsynced and
hard-linked into `snap-N/` with an index, and a manifest (`CURRENT`) is
replaced atomically. A process killed at any point (even `kill -9`) leaves
the previous snapshot intact; `restore_snapshot()` reads the latest one.
"""

print("snapshot", layer.snapshot(), "in", layer.storage_dir)
before = layer.export()
model.fit(ids, labels, batch_size=256, epochs=1, verbose=0)
print("restored", layer.restore_snapshot(), "keys")
after = layer.export()
order_a, order_b = np.argsort(before["keys"]), np.argsort(after["keys"])
assert np.array_equal(before["values"][order_a], after["values"][order_b])

"""
## Saving and inspecting

`model.save` writes the table's rows into the `.keras` file like any
table. A live table locks its folder, so the reloaded model below is made
after the original is gone (in another process, this is automatic).
The file names the table's folder, so loading it takes a storage root:
the folder under which the file may put its tables (`storage_root=` of
`kre.load_model`, or `with kre.storage_root(folder):` around
`keras.saving.load_model`). Without one, a `.keras` file naming an absolute
`storage_path` is refused: a model file from elsewhere does not choose
where this program creates and clears folders.
"""

path = os.path.join(workdir, "large.keras")
kre.save_model(model, path)
expect = model.predict(ids[:64], verbose=0)
del model, layer
gc.collect()
reloaded = kre.load_model(path, storage_root=workdir)
np.testing.assert_allclose(reloaded.predict(ids[:64], verbose=0), expect, rtol=1e-6)
del reloaded
gc.collect()
out = subprocess.run([sys.executable, "-m", "keras_rec_emb.cli", "inspect", path, "--rows", "2"],
                     capture_output=True, text=True)
print(out.stdout)
assert out.returncode == 0 and "file tier:" in out.stdout, out.stderr[-2000:]
