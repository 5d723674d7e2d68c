"""Files are untrusted input: crafted, truncated and bit-flipped checkpoints
and `.keras` files, Parquet files that change while they are read, and
saves killed midway. Each gets a clear error (never a crash, never a
silently wrong table); a failed restore leaves the table exactly as before.
Cases that could crash run in child processes (tests/_isolated.py)."""

import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from tests._isolated import run_cases

CKPT_PRELUDE = """
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

def make_table():
    t = EmbeddingTable(4, "int64", np.arange(8, dtype=np.float32).reshape(2, 4), num_shards=4)
    t.lookup(tf.constant([1, 2, 3], tf.int64), insert=True)
    t.add_slot("m", init=0.5)
    return t

def snapshot(t):
    e = t.export()
    return {k: (v if k != "slots" else {s: np.array(x) for s, x in v.items()}) for k, v in e.items()}

def same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        if k == "slots":
            assert sorted(a[k]) == sorted(b[k]), (a[k].keys(), b[k].keys())
            for s in a[k]:
                np.testing.assert_array_equal(a[k][s], b[k][s])
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)

import tempfile
_src = make_table()
_dir = tempfile.mkdtemp()
GOOD = tf.train.Checkpoint(table=_src).write(os.path.join(_dir, "good"))
_reader = tf.train.load_checkpoint(GOOD)
PARTS = {k: _reader.get_tensor(k) for k in _reader.get_variable_to_shape_map()}

def crafted(**changes):
    '''A copy of GOOD with table parts replaced (np arrays; None removes).'''
    parts = dict(PARTS)
    for name, value in changes.items():
        key = "table/.ATTRIBUTES/" + name
        if value is None:
            parts.pop(key)
        else:
            parts[key] = value
    prefix = os.path.join(tempfile.mkdtemp(), "crafted")
    names = sorted(parts)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(parts[n]) for n in names])
    return prefix

def restore_fails_cleanly(prefix):
    '''Restores `prefix` into a table with other contents: the restore must
    fail, and the table must be exactly as before and still work.'''
    t = make_table()
    t.lookup(tf.constant([7], tf.int64), insert=True)
    before = snapshot(t)
    try:
        tf.train.Checkpoint(table=t).read(prefix).expect_partial()
    except (tf.errors.InvalidArgumentError, tf.errors.ResourceExhaustedError,
            tf.errors.NotFoundError, ValueError) as e:
        error = e
    else:
        raise AssertionError("the crafted checkpoint was restored")
    same(before, snapshot(t))
    t.lookup(tf.constant([100, 101], tf.int64), insert=True)  # new ids still insert
    assert t.size() == 6
    d = tempfile.mkdtemp()
    tf.train.Checkpoint(table=t).write(os.path.join(d, "after"))  # saving still works
    raise error
"""

N = 3
CRAFTED = [
    ("slot_width_2_40", "slot_widths=np.array([2**40], np.int64), "
                        "slot_values=np.zeros((3, 0), np.float32)", "slot_widths"),
    ("slot_width_2_40_no_rows", "slot_widths=np.array([2**40], np.int64), "
     "slot_values=np.zeros((0, 0), np.float32), keys=np.zeros(0, np.int64), "
     "values=np.zeros((0, 4), np.float32), freqs=np.zeros(0, np.int64), "
     "versions=np.zeros(0, np.int64)", "slot_widths"),
    ("duplicate_keys", "keys=np.array([1, 2, 1], np.int64)", "twice"),
    ("duplicate_slots", "slot_names=np.array([b'm', b'm']), "
     "slot_widths=np.array([4, 4], np.int64), slot_values=np.zeros((3, 8), np.float32)",
     "twice"),
    ("negative_freqs", "freqs=np.array([1, -5, 1], np.int64)", "freqs"),
    ("negative_filtered_freqs", "keys_filtered=np.array([9], np.int64), "
     "freqs_filtered=np.array([-1], np.int64), versions_filtered=np.array([0], np.int64)",
     "freqs_filtered"),
    ("duplicate_filtered_keys", "keys_filtered=np.array([9, 9], np.int64), "
     "freqs_filtered=np.array([1, 1], np.int64), versions_filtered=np.array([0, 0], np.int64)",
     "twice"),
    ("values_wrong_width", "values=np.zeros((3, 5), np.float32)", "dim 5"),
    ("values_wrong_rows", "values=np.zeros((2, 4), np.float32)", "values"),
    ("freqs_wrong_length", "freqs=np.zeros(7, np.int64)", "freqs"),
    ("values_nan", "values=np.full((3, 4), np.nan, np.float32)", "finite"),
    ("slot_values_inf", "slot_values=np.full((3, 4), np.inf, np.float32)", "finite"),
    ("default_values_wrong_dim", "default_values=np.zeros((2, 3), np.float32)",
     "default_values"),
    ("slot_width_zero", "slot_widths=np.array([0], np.int64), "
     "slot_values=np.zeros((3, 0), np.float32)", "slot_widths"),
    ("slot_width_negative", "slot_widths=np.array([-4], np.int64)", "slot_widths"),
    ("slot_width_mismatch_table", "slot_widths=np.array([2], np.int64), "
     "slot_values=np.zeros((3, 2), np.float32)", "width"),
    ("empty_slot_name", "slot_names=np.array([b''])", "empty"),
    ("bloom_wrong_size", "bloom=np.zeros(5, np.uint8)", "bloom"),
    ("keys_wrong_dtype", "keys=np.array([1, 2, 3], np.int32)", "dtype"),
    ("keys_matrix", "keys=np.array([[1, 2, 3]], np.int64)", "keys"),
    ("missing_values", "values=None", "values"),
]


@pytest.fixture(scope="module")
def crafted_results():
    cases = [(name, f"restore_fails_cleanly(crafted({changes}))")
             for name, changes, _ in CRAFTED]
    cases.append(("good_checkpoint_restores",
                  "t = make_table(); t.lookup(tf.constant([7], tf.int64), insert=True)\n"
                  "tf.train.Checkpoint(table=t).read(GOOD)\n"
                  "same(snapshot(_src), snapshot(t))"))
    return run_cases(cases, prelude=CKPT_PRELUDE)


@pytest.mark.parametrize("name,changes,needle", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_checkpoint_fails_and_leaves_the_table_as_it_was(crafted_results, name,
                                                                  changes, needle):
    r = crafted_results[name]
    assert r["outcome"] == "error", r
    # An AssertionError would mean the table changed or the restore passed.
    assert r["type"] in ("InvalidArgumentError", "ResourceExhaustedError",
                         "NotFoundError", "ValueError"), r
    assert needle.lower() in r["message"].lower(), r["message"]


def test_the_untouched_checkpoint_restores(crafted_results):
    assert crafted_results["good_checkpoint_restores"]["outcome"] == "ok", \
        crafted_results["good_checkpoint_restores"]


KERAS_PRELUDE = """
import tempfile, zipfile
from keras_rec_emb.layers import EmbeddingVariable
keras.utils.set_random_seed(0)
ids = keras.Input((2,), dtype="int64")
ev = EmbeddingVariable(4, combiner="sum", name="ev")
model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
model.fit(np.arange(64).reshape(32, 2), np.ones((32, 1)), epochs=1, verbose=0)
_dir = tempfile.mkdtemp()
GOOD = os.path.join(_dir, "good.keras")
kre.save_model(model, GOOD)
DATA = open(GOOD, "rb").read()
WANT = ev.table.export()

def variant(data):
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    with open(path, "wb") as f:
        f.write(data)
    return path

def load_and_check(path):
    '''Loads a damaged file: an error is fine; a model that loads must hold
    exactly the saved table (anything else is a silently wrong table).'''
    m = keras.saving.load_model(path)
    (layer,) = [l for l in m.layers if isinstance(l, EmbeddingVariable)]
    got = layer.table.export()
    for k in ("keys", "values", "freqs", "versions"):
        np.testing.assert_array_equal(got[k], WANT[k], err_msg=k)
"""


def _keras_cases():
    rng = np.random.default_rng(18)
    cases = [("keras_intact", "load_and_check(GOOD)")]
    for frac in (0.1, 0.5, 0.9, 0.99):
        cases.append((f"keras_truncated_{frac}",
                      f"load_and_check(variant(DATA[:int(len(DATA) * {frac})]))"))
    for k in range(12):
        pos = float(rng.random())
        cases.append((f"keras_bitflip_{k}",
                      f"d = bytearray(DATA); i = int(len(d) * {pos}); d[i] ^= 0x10\n"
                      "load_and_check(variant(bytes(d)))"))
    return cases


def test_damaged_keras_files_never_crash_or_load_a_wrong_table():
    results = run_cases(_keras_cases(), prelude=KERAS_PRELUDE, timeout=300)
    assert results["keras_intact"]["outcome"] == "ok", results["keras_intact"]
    bad = {n: r for n, r in results.items()
           if r["outcome"] not in ("ok", "error") or r.get("type") == "AssertionError"}
    assert not bad, bad
    # A truncated file never loads.
    for n, r in results.items():
        if n.startswith("keras_truncated"):
            assert r["outcome"] == "error", (n, r)


PARQUET_CASES = [
    ("parquet_truncated_while_read", """
import tempfile
import pyarrow as pa, pyarrow.parquet as pq
path = os.path.join(tempfile.mkdtemp(), "t.parquet")
n = 400_000
pq.write_table(pa.table({"x": np.arange(n), "y": np.arange(n) * 2.0}), path,
               row_group_size=50_000)
ds = kre.data.ParquetDataset(path, batch_size=50_000)
it = iter(ds)
next(it)
with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 3)
for _ in it:
    pass
"""),
    ("parquet_rewritten_while_read", """
import tempfile
import pyarrow as pa, pyarrow.parquet as pq
path = os.path.join(tempfile.mkdtemp(), "t.parquet")
n = 400_000
pq.write_table(pa.table({"x": np.arange(n)}), path, row_group_size=50_000)
ds = kre.data.ParquetDataset(path, batch_size=50_000)
it = iter(ds)
next(it)
with open(path, "r+b") as f:
    f.seek(0)
    f.write(b"\\0" * (os.path.getsize(path) - 16))
for _ in it:
    pass
"""),
]


def test_parquet_changed_while_read_is_an_error_not_sigbus():
    results = run_cases(PARQUET_CASES)
    for name, r in results.items():
        assert r["outcome"] == "error", (name, r)


_SAVER = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, keras, tensorflow as tf
import keras_rec_emb as kre
ids = keras.Input((1,), dtype="int64")
ev = kre.layers.EmbeddingVariable(64, combiner="sum")
model = keras.Model(ids, ev(ids))
model(np.arange(100_000).reshape(-1, 1), training=True)
print("ready", flush=True)
while True:
    kre.save_model(model, sys.argv[1])
"""


def test_kill_9_during_save_leaves_no_stale_temporary_after_the_next_save(tmp_path):
    target = tmp_path / "model.keras"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    stale = set()
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(target)],
                                stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        tmps = []
        while not tmps and time.monotonic() < deadline:
            tmps = [p for p in os.listdir(tmp_path) if p.startswith(".tmp-kre-")]
            time.sleep(0.01)
        assert tmps, "the saver never started a save"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        stale.update(p for p in os.listdir(tmp_path) if p.startswith(".tmp-kre-"))
    assert stale  # the kills left temporaries behind
    # The next save, by another process than the killed ones (this one: the
    # temporaries name their writer's pid), removes them and writes the file.
    ids = keras.Input((1,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(64, combiner="sum")
    model = keras.Model(ids, ev(ids))
    model(np.arange(100_000).reshape(-1, 1), training=True)
    kre.save_model(model, str(target))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")] == []
    assert target.exists()


# -- a .keras file does not choose where file-tier tables write ----------------

def _file_tier_keras(tmp_path, storage_path):
    """A real .keras file of a trained file-tier model, its config then set
    to name `storage_path` (as a crafted file would)."""
    import json
    import zipfile

    opt = kre.EmbeddingVariableOption(num_shards=2, storage_option=kre.StorageOption(
        "FILE", storage_path=str(tmp_path / "trainer"), storage_size=4096))
    ids = keras.Input((2,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(4, combiner="sum", name="ev", ev_option=opt)
    model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.fit(np.arange(64).reshape(32, 2), np.ones((32, 1)), verbose=0)
    saved = str(tmp_path / "saved.keras")
    kre.save_model(model, saved)
    x = np.array([[1, 2], [5, 60]])
    expect = model.predict(x, verbose=0)
    del model, ev
    import gc

    gc.collect()  # the trainer's folder lock goes
    crafted = str(tmp_path / "crafted.keras")
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(crafted, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "config.json":
                text = data.decode()
                old = json.dumps(str(tmp_path / "trainer"))
                assert text.count(old) == 1
                data = text.replace(old, json.dumps(storage_path)).encode()
            dst.writestr(info, data)
    return crafted, x, expect


def _tree(folder):
    """Everything under `folder` but the trainer's table folder (whose
    working files go as the freed trainer's table is destroyed)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.relative_to(folder).parts[0] != "trainer")


def test_a_keras_file_naming_an_absolute_storage_path_writes_nothing_there(tmp_path):
    victim = tmp_path / "victim" / "tables"
    crafted, x, expect = _file_tier_keras(tmp_path, str(victim))
    before = _tree(tmp_path)
    with pytest.raises(ValueError) as info:
        keras.saving.load_model(crafted)
    message = str(info.value)
    assert "storage_path" in message and str(victim) in message, message
    assert "storage_root" in message, message  # the fix
    with pytest.raises(ValueError, match="storage_path"):
        kre.load_model(crafted)
    # A root elsewhere: the path lies outside it, refused too.
    root = tmp_path / "root"
    with pytest.raises(ValueError, match=f"outside the storage root '{root}'"):
        kre.load_model(crafted, storage_root=root)
    with pytest.raises(ValueError, match="storage_path"), kre.storage_root(root):
        keras.saving.load_model(crafted)
    assert not (tmp_path / "victim").exists()
    assert _tree(tmp_path) == before  # nothing created or cleared anywhere
    # The caller's root holds the path: it loads, tables in that folder.
    model = kre.load_model(crafted, storage_root=tmp_path / "victim")
    layer = model.get_layer("ev")
    assert layer.table.storage_dir == str(victim / "ev_embeddings")
    np.testing.assert_allclose(model.predict(x, verbose=0), expect, rtol=1e-6)


@pytest.mark.parametrize("storage_path", ["../../escaped", "tables/../../escaped"])
def test_a_relative_storage_path_that_climbs_out_of_the_root_is_refused(
        tmp_path, monkeypatch, storage_path):
    crafted, x, expect = _file_tier_keras(tmp_path, storage_path)
    root = tmp_path / "a" / "root"
    root.mkdir(parents=True)
    monkeypatch.chdir(root)  # without a root the current folder is the limit
    before = _tree(tmp_path)
    for load in (lambda: keras.saving.load_model(crafted),
                 lambda: kre.load_model(crafted, storage_root=root)):
        with pytest.raises(ValueError) as info:
            load()
        assert f"storage_path`={storage_path!r}" in str(info.value), info.value
    assert _tree(tmp_path) == before
    assert not (tmp_path / "a" / "escaped").exists() and not (tmp_path / "escaped").exists()
    # A relative path that stays inside is taken under the root.
    crafted, x, expect = _file_tier_keras(tmp_path, "tables")
    model = kre.load_model(crafted, storage_root=root)
    assert model.get_layer("ev").table.storage_dir == str(root / "tables" / "ev_embeddings")
    np.testing.assert_allclose(model.predict(x, verbose=0), expect, rtol=1e-6)


def test_a_symbolic_link_out_of_the_root_does_not_count_as_inside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside)
    crafted, _, _ = _file_tier_keras(tmp_path, str(root / "link" / "tables"))
    with pytest.raises(ValueError, match="outside the storage root"):
        kre.load_model(crafted, storage_root=root)
    assert os.listdir(outside) == []


def test_storage_root_arguments(tmp_path):
    with pytest.raises(TypeError, match="storage_root=3"):
        kre.load_model(str(tmp_path / "m.keras"), storage_root=3)
    with pytest.raises(TypeError, match="root=''"):
        kre.storage_root("")
    with kre.storage_root(tmp_path / "r") as root:
        with kre.storage_root("inner") as inner:
            assert inner == os.path.join(os.getcwd(), "inner")
        assert root == str(tmp_path / "r")
