"""HashStrings: string ids hashed to int64 keys as DeepRec's string EV does
(`tf.strings.to_hash_bucket_fast(s, 2**63 - 1)`, `''` missing: no row, no
gradient), in every input form, every model form, saved, exported and
served by stock TensorFlow."""

import os
import subprocess
import sys

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb._farmhash import hash_buckets
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding, HashStrings
from tests import _hash_strings_cases as hash_cases
from tests._model_forms import (FORMS, ChainModel, assert_state_equal, id_layers,
                                model_in_form, state)

INT64_MAX = 2**63 - 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

rng = np.random.default_rng(3)
# Criteo-like categories: 8 hex digits, some of them missing ('').
VOCAB = np.array([f"{v:08x}" for v in rng.integers(0, 2**32, size=30)], dtype=object)


def criteo_strings(shape, missing=0.3, seed=0):
    r = np.random.default_rng(seed)
    values = VOCAB[r.integers(0, len(VOCAB), size=shape)]
    values[r.random(shape) < missing] = ""
    return values.astype(bytes)


def reference_keys(strings):
    """The keys computed directly with TensorFlow's op, DeepRec's rule."""
    return tf.strings.to_hash_bucket_fast(tf.constant(strings, tf.string), INT64_MAX).numpy()


def reference_ragged(strings):
    """[B, L] strings as [B, None] keys with '' dropped, row by row."""
    keys = reference_keys(strings)
    rows = [[k for s, k in zip(srow, krow) if s != b""] for srow, krow in zip(strings, keys)]
    return tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1, inner_shape=())


# -- the hash and the missing id -------------------------------------------------
def test_dense_drop_gives_deeprec_keys_without_missing():
    strings = criteo_strings((64, 5))
    got = HashStrings()(tf.constant(strings))
    want = reference_ragged(strings)
    assert isinstance(got, tf.RaggedTensor) and got.dtype == tf.int64
    np.testing.assert_array_equal(got.row_splits.numpy(), want.row_splits.numpy())
    np.testing.assert_array_equal(got.values.numpy(), want.values.numpy())
    np.testing.assert_array_equal(got.row_lengths().numpy(), (strings != b"").sum(1))
    assert (got.values.numpy() >= 0).all()
    assert reference_keys([b""])[0] not in got.values.numpy()  # '' is no key


def test_one_string_per_example_gives_rows_of_zero_or_one_key():
    strings = criteo_strings((40,), seed=1)
    got = HashStrings()(tf.constant(strings))
    assert got.shape.rank == 2
    np.testing.assert_array_equal(got.row_lengths().numpy(), strings != b"")
    np.testing.assert_array_equal(got.values.numpy(),
                                  reference_keys(strings[strings != b""]))


def test_pad_keeps_the_shape_with_minus_one():
    strings = criteo_strings((16, 3, 4), seed=2)
    got = HashStrings(missing="pad")(tf.constant(strings)).numpy()
    want = np.where(strings == b"", -1, reference_keys(strings))
    np.testing.assert_array_equal(got, want)


def test_ragged_and_sparse_strings():
    rows = [[b"a", b"", b"b"], [], [b""], [b"c"]]
    ragged = tf.ragged.constant(rows)
    got = HashStrings()(ragged)
    assert got.to_list() == [[int(k) for k in reference_keys([s for s in r if s])]
                             for r in rows]
    padded = HashStrings(missing="pad")(ragged)
    assert padded.to_list() == [[-1 if s == b"" else int(reference_keys([s])[0]) for s in r]
                                for r in rows]
    sparse = ragged.to_sparse()
    got = HashStrings()(sparse)
    keep = tf.not_equal(sparse.values, "").numpy()
    np.testing.assert_array_equal(got.indices.numpy(), sparse.indices.numpy()[keep])
    np.testing.assert_array_equal(got.values.numpy(),
                                  reference_keys(sparse.values.numpy()[keep]))
    padded = HashStrings(missing="pad")(sparse)
    np.testing.assert_array_equal(padded.indices.numpy(), sparse.indices.numpy())
    np.testing.assert_array_equal(
        padded.values.numpy(),
        np.where(keep, reference_keys(sparse.values.numpy()), -1))


# -- no row, no gradient -----------------------------------------------------------
def test_training_on_strings_equals_training_on_reference_keys():
    """The string model's table, frequencies and dense weights equal those of
    the same model fed the reference keys ('' dropped by hand): a missing
    string reads no row, inserts none and gets no gradient."""
    strings = criteo_strings((96, 5), seed=4)
    y = rng.random((96, 1)).astype(np.float32)

    def model(string_input):
        keras.utils.set_random_seed(7)
        if string_input:
            inp = keras.Input((5,), dtype="string")
            x = HashStrings()(inp)
        else:
            inp = keras.Input((None,), dtype="int64", ragged=True)
            x = inp
        ev = EmbeddingVariable(4, combiner="mean", name="ev",
                               ev_option=kre.EmbeddingVariableOption(track_meta=True))
        out = keras.layers.Dense(1, name="head")(ev(x))
        m = keras.Model(inp, out)
        m.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
        return m

    ours, ref = model(True), model(False)
    keys = reference_ragged(strings)
    ours.fit(tf.data.Dataset.from_tensor_slices((strings, y)).batch(32), epochs=2, shuffle=False, verbose=0)
    ref.fit(tf.data.Dataset.from_tensor_slices((keys, y)).batch(32), epochs=2, shuffle=False, verbose=0)
    assert_state_equal(state(ours), state(ref))
    table = ours.get_layer("ev").export()
    assert sorted(table["keys"]) == sorted(set(reference_keys(strings[strings != b""])))
    # Each key counted once per (non-missing) occurrence, two epochs.
    counts = dict(zip(*np.unique(reference_keys(strings[strings != b""]), return_counts=True)))
    assert {int(k): int(f) for k, f in zip(table["keys"], table["freqs"])} == \
        {int(k): 2 * int(c) for k, c in counts.items()}
    # An example whose strings are all missing embeds as zeros.
    empty = tf.constant([[b""] * 5])
    np.testing.assert_array_equal(
        ours.get_layer("ev")(HashStrings()(empty)).numpy(), np.zeros((1, 4), np.float32))


def test_group_embedding_stacked_ids_with_pad_equal_reference_ids():
    strings = criteo_strings((32, 3), seed=5)
    features = {f"f{j}": FeatureSpec({"embedding_dim": 4, "name": f"t{j}"}, combiner="sum")
                for j in range(3)}

    def group():
        keras.utils.set_random_seed(9)
        return GroupEmbedding(dict(features), output_mode="concat", name="group")

    ours, ref = group(), group()
    got = ours(HashStrings(missing="pad")(tf.constant(strings)), training=True)
    ids = np.where(strings == b"", -1, reference_keys(strings))
    want = ref(tf.constant(ids), training=True)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    # Missing: no key inserted (-1 is padding to GroupEmbedding).
    for j in range(3):
        table = ours.tables[j].export()["keys"]
        assert sorted(table) == sorted(set(ids[:, j][ids[:, j] >= 0]))


# -- model forms, saving, export, serving ---------------------------------------------
X = criteo_strings((96, 4), seed=6)
Y = rng.random((96, 1)).astype(np.float32)


def _layers():
    return [HashStrings(name="hash"),
            EmbeddingVariable(4, combiner="mean", name="ev"),
            keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1)]


def make(form):
    model = model_in_form(form, _layers(), (4,), "string")
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def _data(x=X, y=Y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(32)


@pytest.mark.parametrize("form", FORMS)
def test_keras_round_trip_in_every_model_form(tmp_path, form):
    model = make(form)
    model.fit(_data(), epochs=2, shuffle=False, verbose=0)
    before = state(model)
    (ev,) = id_layers(model)
    assert sorted(ev.export()["keys"]) == sorted(set(reference_keys(X[X != b""])))
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    assert any(isinstance(layer, HashStrings) for layer in
               (loaded.chain if isinstance(loaded, ChainModel) else loaded.layers))
    assert_state_equal(before, state(loaded))
    xs = tf.constant(X)
    np.testing.assert_array_equal(model.predict(xs, verbose=0), loaded.predict(xs, verbose=0))
    for m in (model, loaded):
        m.fit(_data(X[::-1]), epochs=1, shuffle=False, verbose=0)
    assert_state_equal(state(model), state(loaded))


def _serve(path, strings):
    """Runs the SavedModel at `path` on `strings` in a fresh process that
    does not import keras_rec_emb; returns its predictions and whether
    keras_rec_emb was imported."""
    code = (
        "import sys, numpy as np, tensorflow as tf\n"
        "m = tf.saved_model.load(sys.argv[1])\n"
        "x = tf.constant(np.load(sys.argv[2], allow_pickle=False))\n"
        "np.save(sys.argv[3], m.serve(x).numpy())\n"
        "print('keras_rec_emb' in sys.modules)\n")
    np.save(os.path.join(path, "..", "x.npy"), strings.astype(str))
    out = os.path.join(path, "..", "y.npy")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", code, path,
                             os.path.join(path, "..", "x.npy"), out],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out), result.stdout.strip() == "True"


@pytest.mark.parametrize("form", ["functional", "subclassed"])
def test_export_and_export_for_serving_serve_raw_strings(tmp_path, form):
    model = make(form)
    model.fit(_data(), epochs=1, shuffle=False, verbose=0)
    # Strings never seen and rows all missing too.
    x = np.concatenate([X[:8], criteo_strings((4, 4), missing=0.0, seed=99),
                        np.full((2, 4), b"")])
    expect = model.predict(tf.constant(x), verbose=0)
    signature = [tf.TensorSpec((None, 4), tf.string)] if form == "subclassed" else None
    stock = str(tmp_path / "stock")
    kre.export_for_serving(model, stock, input_signature=signature)
    got, imported = _serve(stock, x)
    assert not imported
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)
    exported = str(tmp_path / "exported")
    model.export(exported, input_signature=signature, verbose=False)
    # Served with the package (its ops): loaded here, from the files alone.
    served = tf.saved_model.load(exported)
    got = served.serve(tf.constant(x.astype(str))).numpy()
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)


def test_parquet_string_column_with_nulls(tmp_path):
    """A Parquet string column (nulls included) fed to the layer: nulls read
    as '' and are missing."""
    values = [f"{v:08x}" for v in rng.integers(0, 2**32, size=20)]
    column = [values[i % 7] if i % 5 else None for i in range(40)]
    labels = np.arange(40, dtype=np.float32) % 2
    path = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"C1": pa.array(column, pa.string()), "label": labels}), path,
                   row_group_size=10)
    inp = keras.Input((), dtype="string", name="C1")
    ev = EmbeddingVariable(4, combiner="sum", name="ev")
    model = keras.Model({"C1": inp}, keras.layers.Dense(1)(ev(HashStrings()(inp))))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    ds = kre.data.ParquetDataset(path, batch_size=10).map(
        lambda d: ({"C1": d["C1"]}, d["label"]))
    model.fit(ds, epochs=1, shuffle=False, verbose=0)
    present = [c.encode() for c in column if c is not None]
    assert sorted(ev.export()["keys"]) == sorted(set(reference_keys(present)))
    assert ev.export()["keys"].size == 7


# -- bad input (config, registration: tests/layers/test_hash_strings_api.py) -------
def test_bad_input():
    with pytest.raises(ValueError, match=r"`missing` must be one of \('drop', 'pad'\)\. "
                                         r"Received: missing='skip'"):
        HashStrings(missing="skip")
    with pytest.raises(TypeError, match=r"HashStrings 'h' expects string ids.*int64"):
        HashStrings(name="h")(tf.constant([[1, 2]], tf.int64))
    with pytest.raises(TypeError, match=r"expects string ids.*float32"):
        HashStrings()(keras.Input((2,), dtype="float32"))
    with pytest.raises(ValueError, match=r"missing='drop'.*Received rank 3.*missing='pad'"):
        HashStrings()(tf.constant([[["a"]]]))
    with pytest.raises(ValueError, match=r"Received rank 0"):
        HashStrings()(tf.constant("a"))
    with pytest.raises(ValueError, match=r"ragged strings of shape \[batch, None\]"):
        HashStrings()(tf.ragged.constant([[["a"]]]))


@pytest.mark.parametrize("inputs, kind, shown", [
    (np.array([["68fd1e64", 7]], dtype=object), "int", "7"),
    ([["68fd1e64", 2.5]], "float", "2.5"),
    (np.array([["68fd1e64", None]], dtype=object), "NoneType", "None"),
    ([["68fd1e64"], ["a", np.int64(3)]], "int64", r"np\.int64\(3\)"),
], ids=["object-array-int", "list-float", "object-array-none", "ragged-list-int64"])
def test_mixed_elements_name_the_layer_the_argument_and_the_type(inputs, kind, shown):
    with pytest.raises(TypeError, match=rf"HashStrings 'h' takes string ids in `inputs`: every "
                                        rf"element a str or bytes.*Received an element of type "
                                        rf"{kind}: {shown}\."):
        HashStrings(name="h")(inputs)


def test_lists_and_object_arrays_of_strings_hash_as_tensors_do():
    strings = criteo_strings((8, 3)).astype(str)
    want = HashStrings(missing="pad")(tf.constant(strings)).numpy()
    for inputs in (strings.tolist(), strings.astype(object)):
        np.testing.assert_array_equal(HashStrings(missing="pad")(inputs).numpy(), want)
    got = HashStrings()([["a"], ["b", "", "c"]])  # rows of different lengths
    np.testing.assert_array_equal(got.row_lengths().numpy(), [1, 2])
    np.testing.assert_array_equal(got.values.numpy(), reference_keys([b"a", b"b", b"c"]))


# -- the NumPy FarmHash (the JAX backend's keys) and TensorFlow's op -------------------
def test_stored_keys_are_tensorflows():
    """tests/layers/data/hash_strings_keys.npz, the JAX backend's reference,
    holds TensorFlow's keys of its strings."""
    strings, keys = hash_cases.load()
    assert len(strings) > 300 and len(set(len(s) for s in strings)) > 200
    np.testing.assert_array_equal(reference_keys(strings), keys)


def test_numpy_farmhash_equals_tensorflows_op():
    r = np.random.default_rng(11)
    raw = [r.integers(0, 256, n, dtype=np.uint8).tobytes()
           for n in r.integers(0, 700, 3000).tolist()]
    np.testing.assert_array_equal(hash_buckets(raw), reference_keys(raw))
    np.testing.assert_array_equal(hash_buckets(np.array(raw, dtype=object)),
                                  reference_keys(raw))
    # NumPy's fixed-width arrays (trailing NULs dropped, as NumPy drops them
    # for TensorFlow too), ASCII and not.
    fixed = np.array(raw[:500]).reshape(50, 10)
    np.testing.assert_array_equal(hash_buckets(fixed), reference_keys(fixed))
    points = r.integers(0x20, 0x2FFFF, (400, 30))
    points[(points >= 0xD800) & (points < 0xE000)] = 0x41  # no surrogates: valid UTF-8
    text = np.array(["".join(map(chr, row[:n])) for row, n in
                     zip(points.tolist(), r.integers(0, 31, 400).tolist())])
    np.testing.assert_array_equal(hash_buckets(text), reference_keys(text))
    np.testing.assert_array_equal(hash_buckets(VOCAB.astype(str)), reference_keys(VOCAB))
    assert hash_buckets(np.zeros((0, 3), "S4")).shape == (0, 3)


def test_the_layer_gives_the_numpy_keys():
    strings = criteo_strings((16, 3), seed=8)
    got = HashStrings(missing="pad")(strings).numpy()
    np.testing.assert_array_equal(got, np.where(strings == b"", -1, hash_buckets(strings)))
