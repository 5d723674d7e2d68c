"""HashStrings under Keras's JAX backend: TensorFlow's keys to the bit
(against keys stored under TensorFlow), hashed on the host in NumPy; ragged
forms and a place inside a model refused clearly (the errors for bad input,
the same under both backends: tests/layers/test_hash_strings_api.py)."""

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding, HashStrings
from tests import _hash_strings_cases as cases
from tests._doctest_examples import assert_examples_run

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_keys_equal_tensorflows_stored_keys():
    strings, want = cases.load()
    for inputs in (strings, np.array(strings, dtype=object)):
        got = HashStrings(missing="pad")(inputs)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got, np.where(want == want[0], -1, want))
        assert strings[0] == b"" and (got == -1).sum() == 1
    # NumPy's fixed-width arrays: bytes (NumPy drops trailing NULs) and str.
    plain = [i for i, s in enumerate(strings) if s and s[-1:] != b"\0"]
    fixed = np.array([strings[i] for i in plain])
    np.testing.assert_array_equal(HashStrings(missing="pad")(fixed), want[plain])
    text = [i for i in plain if _utf8(strings[i]) is not None]
    assert len(text) > 90  # unicode and Criteo hex
    unicode = np.array([strings[i].decode("utf-8") for i in text])
    assert unicode.dtype.kind == "U"
    np.testing.assert_array_equal(HashStrings(missing="pad")(unicode), want[text])
    np.testing.assert_array_equal(HashStrings(missing="pad")(unicode.tolist()), want[text])


def _utf8(data):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_pad_keeps_any_shape_with_minus_one_for_the_empty_string():
    strings, want = cases.load()
    lookup = dict(zip(strings, want.tolist()))
    ascii_ = [s for s in strings if s and s.isascii() and s[-1:] != b"\0"][:23] + [b""]
    grid = np.array(ascii_ * 2, dtype=object).reshape(2, 3, 8)
    got = HashStrings(missing="pad")(grid)
    assert got.shape == (2, 3, 8)
    np.testing.assert_array_equal(
        got, np.vectorize(lambda s: -1 if s == b"" else lookup[s], otypes=[np.int64])(grid))
    mixed = [["", b""], ["", "a"]]  # '' and b'' are both missing
    assert HashStrings(missing="pad")(mixed)[:, 0].tolist() == [-1, -1]
    assert HashStrings(missing="pad")(np.array(["", "x"]))[0] == -1
    assert HashStrings(missing="pad")(np.array("x")).shape == ()


def test_ragged_forms_are_refused_naming_pad():
    for make, received in [(lambda: HashStrings(name="h")(np.array([["a", ""]])),
                            "missing='drop'"),
                           (lambda: HashStrings(name="h", missing="pad")([["a"], ["b", "c"]]),
                            "rows of different lengths")]:
        with pytest.raises(ValueError, match=r"HashStrings 'h' under Keras's JAX backend returns "
                           r"dense keys.*Use missing='pad'.*prune_invalid_ids=True.*Received: "
                           + received):
            make()


def test_inside_a_model_is_refused_naming_the_alternative():
    message = (r"HashStrings '.*' cannot be part of a model under Keras's JAX backend: JAX "
               r"arrays hold no strings.*before the model.*HashStrings\(missing='pad'\)"
               r".*Received: a symbolic input \(KerasTensor\) of dtype string")
    with pytest.raises(ValueError, match=message):
        HashStrings()(keras.Input((2,), dtype="string"))
    with pytest.raises(ValueError, match=message):
        keras.Sequential([keras.Input((2,), dtype="string"), HashStrings(missing="pad")])
    # Without keras.Input, a Sequential builds for strings (ids_input_dtype).
    model = keras.Sequential([HashStrings(missing="pad"), EmbeddingVariable(4, combiner="sum")])
    with pytest.raises(ValueError, match=message):
        model.build((None, 2))


def _model():
    # Constant initial values: the two models start equal (keras.utils.
    # set_random_seed would import TensorFlow).
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(4, initializer=keras.initializers.Constant(0.25), combiner="mean",
                           prune_invalid_ids=True, name="ev")
    head = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(0.5), name="head")
    model = keras.Model(ids, head(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def test_pipeline_keys_train_and_save_as_the_tensorflow_keys_do(tmp_path):
    """Keys hashed before the model train exactly as the stored TensorFlow
    keys fed by hand; '' (-1) inserts no row; the model saves and reloads."""
    strings, want = cases.load()
    r = np.random.default_rng(5)
    pick = r.integers(0, 60, (48, 3))  # strings[0] is ''
    x = np.array(strings, dtype=object)[pick]
    y = r.random((48, 1)).astype(np.float32)
    ours, ref = _model(), _model()
    keys = HashStrings(missing="pad")(x)
    ours.fit(keys, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ref.fit(np.where(pick == 0, -1, want[pick]), y, batch_size=16, epochs=2, shuffle=False,
            verbose=0)
    table = ours.get_layer("ev").export()
    assert sorted(table["keys"].tolist()) == sorted(set(want[pick[pick > 0]].tolist()))
    np.testing.assert_array_equal(ours.predict(keys, verbose=0), ref.predict(keys, verbose=0))
    path = str(tmp_path / "m.keras")
    ours.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.predict(keys, verbose=0), ours.predict(keys, verbose=0))


def test_group_embedding_takes_the_padded_keys():
    strings, want = cases.load()
    pick = np.random.default_rng(6).integers(0, 40, (16, 3))
    features = {f"f{j}": FeatureSpec({"embedding_dim": 4, "name": f"t{j}"}, combiner="sum")
                for j in range(3)}
    group = GroupEmbedding(features, output_mode="concat")
    ids = keras.Input((3,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(group(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    keys = HashStrings(missing="pad")(np.array(strings, dtype=object)[pick])
    model.fit(keys, np.ones((16, 1)), batch_size=8, verbose=0)
    for j in range(3):
        column = pick[:, j]
        assert sorted(group.tables[j].export()["keys"].tolist()) == \
            sorted(set(want[column[column > 0]].tolist()))


def test_the_docstring_example_runs():
    assert_examples_run(HashStrings, "HashStrings")


_WITHOUT_TENSORFLOW = r"""
import sys
sys.modules["tensorflow"] = None  # `import tensorflow` fails: as if not installed
import numpy as np
import keras
import keras_rec_emb as kre
from tests import _event_files, _hash_strings_cases as cases

strings, want = cases.load()
keys = kre.layers.HashStrings(missing="pad")(strings)
np.testing.assert_array_equal(keys, np.where(want == want[0], -1, want))
ids = keras.Input((2,), dtype="int64")
ev = kre.layers.EmbeddingVariable(4, combiner="sum", prune_invalid_ids=True, name="ids")
model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
stats = kre.callbacks.TableStats(log_dir=sys.argv[1])
model.fit(keys[1:9].reshape(4, 2), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=[stats])
assert [(step, values["tables/ids_size"]) for step, values in
        _event_files.scalars(sys.argv[1])] == [(1, 4.0), (2, 8.0)]
print("ok", sorted(k for k in sys.modules if k.split(".")[0] == "tensorflow"))
"""


def test_hashing_and_tensorboard_scalars_need_no_tensorflow(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax")
    run = subprocess.run([sys.executable, "-c", _WITHOUT_TENSORFLOW, str(tmp_path / "tb")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().splitlines()[-1] == "ok ['tensorflow']"  # the blocked entry only
