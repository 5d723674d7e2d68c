"""Code written for the TensorFlow backend runs unchanged under
KERAS_BACKEND=jax: `export()` returns the same parts, int64 ids keep their
value in JAX's 64-bit mode, and `save_model` / `load_model` work."""

import os
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest

import keras_rec_emb as kre

DIM = 4
# The parts of the TensorFlow layer's export() (keras_rec_emb/backend/tensorflow/variables.py's
# ARRAY_PARTS plus `slots`).
TENSORFLOW_EXPORT = ["bloom", "default_values", "freqs", "freqs_filtered", "keys",
                     "keys_filtered", "slots", "values", "versions", "versions_filtered"]


def _model(ids, layer, optimizer):
    inp = keras.Input((ids.shape[1],), dtype=ids.dtype.name, name="ids")
    model = keras.Model(inp, keras.layers.Dense(1)(layer(inp)))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_export_has_the_tensorflow_layers_parts_and_named_slots():
    ids = np.array([[1, 2], [2, 3], [3, 1], [5, 5]], np.int32)
    layer = kre.layers.EmbeddingVariable(DIM, combiner="sum")
    model = _model(ids, layer, kre.optimizers.Adam(0.01))
    model.fit(ids, np.ones((4, 1)), batch_size=2, verbose=0)
    e = layer.export()
    assert sorted(e) == TENSORFLOW_EXPORT
    assert sorted(e["keys"].tolist()) == [1, 2, 3, 5]
    assert sorted(e["slots"]) == ["momentum", "velocity"]
    for slot in e["slots"].values():
        assert slot.shape == (4, DIM)
    # Adam's second moment of a trained id is g**2-weighted: positive.
    assert (e["slots"]["velocity"] > 0).all()
    assert e["default_values"].shape == (layer.default_value_dim, DIM)
    # What export() gives, import_() takes back (as under TensorFlow).
    twin = kre.layers.EmbeddingVariable(DIM, combiner="sum")
    twin.build()
    twin.import_(e)
    again = twin.export()
    order, order2 = np.argsort(e["keys"]), np.argsort(again["keys"])
    for name in ("keys", "values", "freqs", "versions"):
        np.testing.assert_array_equal(again[name][order2], e[name][order], err_msg=name)
    for name in e["slots"]:
        np.testing.assert_array_equal(again["slots"][name][order2], e["slots"][name][order])


def test_key_dtype_defaults_to_the_widest_int_jax_holds():
    # Importing keras_rec_emb turned JAX's 64-bit mode on (JAX_ENABLE_X64 unset).
    assert jax.config.jax_enable_x64
    assert kre.layers.EmbeddingVariable(DIM).key_dtype == "int64"
    with jax.enable_x64(False):
        assert kre.layers.EmbeddingVariable(DIM).key_dtype == "int32"
    # An explicit key_dtype stays.
    assert kre.layers.EmbeddingVariable(DIM, key_dtype="int32").key_dtype == "int32"


def test_int64_ids_beyond_int32_keep_their_value_in_64_bit_mode():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, (64, 2)) * 7_919_000_000_003 % 10**15
    with jax.enable_x64(True):
        layer = kre.layers.EmbeddingVariable(DIM, combiner="mean")
        model = _model(ids, layer, kre.optimizers.Adagrad(0.1))
        model.fit(ids, np.ones((64, 1)), batch_size=16, verbose=0)
        e = layer.export()
    assert e["keys"].dtype == np.int64
    np.testing.assert_array_equal(np.sort(e["keys"]), np.unique(ids))
    assert np.unique(ids).max() > 2**31  # the test's ids do not fit int32


def test_save_model_and_load_model_round_trip(tmp_path):
    assert {"save_model", "load_model"} <= set(kre.__all__)
    ids = np.array([[1, 2], [2, 3], [7, 1]], np.int32)
    layer = kre.layers.EmbeddingVariable(DIM, combiner="sum", name="emb")
    model = _model(ids, layer, kre.optimizers.Adagrad(0.1))
    model.fit(ids, np.ones((3, 1)), verbose=0)
    path = tmp_path / "model.keras"
    kre.save_model(model, path)
    loaded = kre.load_model(path)
    np.testing.assert_array_equal(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0))
    assert sorted(loaded.get_layer("emb").export()["keys"].tolist()) == [1, 2, 3, 7]
    # The previous file survives a failed save.
    before = path.read_bytes()
    with pytest.raises(ValueError, match="must end in `.keras`"):
        kre.save_model(model, tmp_path / "model.h5")
    assert path.read_bytes() == before
    (tmp_path / "broken.keras").write_bytes(before[: len(before) // 2])
    with pytest.raises(ValueError, match="broken.keras exists but is not a valid .keras file"):
        kre.load_model(tmp_path / "broken.keras")


@pytest.mark.parametrize("setting, want", [(None, True), ("0", False), ("1", True)])
def test_importing_the_package_turns_on_64_bit_ids_unless_the_environment_says(setting, want):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("JAX_ENABLE_X64", None)
    if setting is not None:
        env["JAX_ENABLE_X64"] = setting
    code = ("import numpy as np, keras, keras_rec_emb, jax\n"
            "x = keras.ops.convert_to_tensor(np.array([2**40 + 3]))\n"
            "print(jax.config.jax_enable_x64, x.dtype, int(x[0]) == 2**40 + 3)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    enabled, dtype, kept = run.stdout.split()[-3:]
    assert enabled == str(want)
    assert (dtype, kept) == (("int64", "True") if want else ("int32", "False"))
