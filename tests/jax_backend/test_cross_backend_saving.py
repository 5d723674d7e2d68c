"""One `.keras` format for both backends: a model trained and saved under
TensorFlow (this process) loads under JAX (a child process) with the same
rows, slots, frequencies, versions, initializer matrix, optimizer state and
predictions, and trains on to the same numbers; and the reverse, where
`export_for_serving` of the model trained under JAX writes the
stock-TensorFlow SavedModel."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Ids -> EmbeddingVariable -> Flatten -> Dense(1), the same code under both
# backends but for the layer's constructor. The initializer is unseeded: a
# loaded layer draws another matrix, so the predictions for the unseen ids
# 40 and 41 match only if the saved matrix was restored.
_COMMON = """
import json
import numpy as np
import pytest
import keras
import keras_rec_emb as kre
DIM, FEATURES, DVD = 3, 2, 5
rng = np.random.default_rng(11)
ids = rng.integers(0, 11, size=(16, FEATURES)).astype(np.int32)
labels = rng.normal(size=(16, 1)).astype(np.float32)
more_ids = rng.integers(0, 14, size=(8, FEATURES)).astype(np.int32)
more_labels = rng.normal(size=(8, 1)).astype(np.float32)
queries = np.array([[0, 1], [2, 3], [40, 41]], np.int32)
def train(layer, model_optimizer):
    inputs = keras.Input(shape=(FEATURES,), dtype="int32")
    dense = keras.layers.Dense(1, name="dense")
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=model_optimizer, loss="mse")
    model.fit(ids, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model
def table_parts(parts):
    out = {name: np.asarray(parts[name]) for name in
           ("keys", "values", "freqs", "versions", "default_values")}
    out["accumulator"] = np.asarray(parts["slots"]["accumulator"])
    return out
def dense_state(model):
    # The model optimizer's variables as TensorFlow saves them: step,
    # learning rate, the Dense kernel's and bias's accumulators.
    out = {"kernel": model.get_layer("dense").get_weights()[0]}
    variables = [np.asarray(v) for v in model.optimizer.variables if np.size(v) > 0]
    out.update({f"optimizer_{i}": v for i, v in enumerate(variables)})
    return out
"""

_JAX = """
from keras_rec_emb.backend.jax import ffi
def parts_of(layer):
    return table_parts(ffi.export_parts(layer.handle, layer.key_dtype, layer.embedding_dim,
                                        [("accumulator", layer.embedding_dim)]))
def jax_layer(**kwargs):
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD), track_meta=True)
    return kre.layers.EmbeddingVariable(DIM, initializer="uniform", key_dtype="int32",
                                        ev_option=option, name="ev", **kwargs)
"""

# Loads the TensorFlow file (compiled), predicts, then trains on.
_JAX_LOADS = """
import sys
model = keras.saving.load_model(sys.argv[1])
layer = model.get_layer("ev")
with open(sys.argv[3], "w") as f:
    json.dump(layer.get_config(), f)
loaded = dict(parts_of(layer), predictions=model.predict(queries, verbose=0),
              iterations=int(layer.iterations.value), **dense_state(model))
model.fit(more_ids, more_labels, batch_size=4, shuffle=False, verbose=0)
trained = {f"trained_{k}": v for k, v in dict(parts_of(layer), **dense_state(model)).items()}
np.savez(sys.argv[2], **loaded, **trained)
"""

# The table has its own optimizer here (the layer's `optimizer=`).
_JAX_SAVES = """
import sys
layer = jax_layer(optimizer=kre.optimizers.Adagrad(0.1, initial_accumulator_value=0.2))
model = train(layer, kre.optimizers.SGD(0.05))
model.save(sys.argv[1])
np.savez(sys.argv[2], predictions=model.predict(queries, verbose=0), **parts_of(layer),
         **dense_state(model))
assert kre.export_for_serving(model, sys.argv[3]) == sys.argv[3]
"""

_TENSORFLOW = """
def tensorflow_layer(**kwargs):
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD), track_meta=True)
    return kre.layers.EmbeddingVariable(DIM, key_dtype="int32", initializer="uniform",
                                        ev_option=option, name="ev", **kwargs)
"""


def _run_jax(code, *args):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    # A script file, not `-c`: export_for_serving under JAX reads the
    # source of what __main__ defines.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(code)
    try:
        run = subprocess.run([sys.executable, script.name, *map(str, args)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=240)
    finally:
        os.unlink(script.name)
    assert run.returncode == 0, run.stderr[-4000:]


def _tensorflow():
    namespace = {}
    exec(_COMMON + _TENSORFLOW, namespace)
    return namespace


def _assert_same(got, want, prefix="", rtol=0.0, atol=0.0):
    """Equal tables (rows, slots, frequencies, versions, initializer)."""
    order_got, order_want = np.argsort(got[prefix + "keys"]), np.argsort(want["keys"])
    np.testing.assert_array_equal(got[prefix + "keys"][order_got], want["keys"][order_want])
    for name in ("freqs", "versions"):
        np.testing.assert_array_equal(got[prefix + name][order_got], want[name][order_want],
                                      err_msg=name)
    for name in ("values", "accumulator"):
        np.testing.assert_allclose(got[prefix + name][order_got], want[name][order_want],
                                   rtol=rtol, atol=atol, err_msg=name)
    np.testing.assert_array_equal(got[prefix + "default_values"], want["default_values"])


def test_a_model_saved_under_tensorflow_loads_and_trains_on_under_jax(tmp_path):
    """The table trained by the model's optimizer (model.compile)."""
    tf_side = _tensorflow()
    kre = tf_side["kre"]
    layer = tf_side["tensorflow_layer"]()
    model = tf_side["train"](layer, kre.optimizers.Adagrad(0.1, initial_accumulator_value=0.2))
    path = tmp_path / "tensorflow.keras"
    model.save(str(path))
    saved = dict(tf_side["table_parts"](layer.export()), **tf_side["dense_state"](model))
    predictions = model.predict(tf_side["queries"], verbose=0)
    assert len(saved["keys"]) > 5 and saved["versions"].max() == 7  # 8 steps
    _run_jax(_COMMON + _JAX + _JAX_LOADS, path, tmp_path / "loaded.npz",
             tmp_path / "config.json")
    got = dict(np.load(tmp_path / "loaded.npz"))
    _assert_same(got, saved)
    np.testing.assert_allclose(got["predictions"], predictions, rtol=1e-6, atol=1e-6)
    assert int(got["iterations"]) == 8  # the step after the last update
    for name in saved:
        if name.startswith("optimizer_") or name == "kernel":  # step, lr, accumulators
            np.testing.assert_array_equal(got[name], saved[name], err_msg=name)
    # The JAX layer writes back the config it read.
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        json.dumps(layer.get_config()))
    # One more epoch under each backend from the saved state: the same
    # numbers (slots, steps and the Dense weights' accumulators came across).
    model.fit(tf_side["more_ids"], tf_side["more_labels"], batch_size=4, shuffle=False,
              verbose=0)
    trained = dict(tf_side["table_parts"](layer.export()), **tf_side["dense_state"](model))
    _assert_same(got, trained, prefix="trained_", rtol=1e-5, atol=1e-6)
    for name in trained:
        if name.startswith("optimizer_") or name == "kernel":
            np.testing.assert_allclose(got["trained_" + name], trained[name], rtol=1e-5,
                                       atol=1e-6, err_msg=name)


def test_a_model_trained_under_jax_loads_and_serves_under_tensorflow(tmp_path):
    """The table trained by its own optimizer (`optimizer=`); the JAX child
    saves the model and exports it for serving (which runs a TensorFlow
    child of its own)."""
    import keras
    import tensorflow as tf

    path = tmp_path / "jax.keras"
    _run_jax(_COMMON + _JAX + _JAX_SAVES, path, tmp_path / "saved.npz", tmp_path / "serving")
    want = dict(np.load(tmp_path / "saved.npz"))
    assert len(want["keys"]) > 5 and want["versions"].max() == 7
    tf_side = _tensorflow()
    model = keras.saving.load_model(str(path))
    layer = model.get_layer("ev")
    kre = tf_side["kre"]
    assert isinstance(layer, kre.layers.EmbeddingVariable)
    assert type(layer.table_optimizer).__name__ == "Adagrad"
    assert isinstance(model.optimizer, kre.optimizers.SGD)
    _assert_same(tf_side["table_parts"](layer.export()), want)
    np.testing.assert_allclose(model.predict(tf_side["queries"], verbose=0), want["predictions"],
                               rtol=1e-6, atol=1e-6)
    state = tf_side["dense_state"](model)
    assert sorted(state) == sorted(k for k in want if k.startswith("optimizer_") or k == "kernel")
    for name, value in state.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    # The TensorFlow layer reads every argument the JAX layer wrote.
    with zipfile.ZipFile(path) as archive:
        saved = json.loads(archive.read("config.json"))
    entry = next(e for e in saved["config"]["layers"] if e["name"] == "ev")
    assert json.loads(json.dumps(layer.get_config())) == entry["config"]
    # The stock SavedModel serves the JAX model's predictions, unseen ids too.
    served = tf.saved_model.load(str(tmp_path / "serving"))
    np.testing.assert_allclose(served.serve(tf.constant(tf_side["queries"])).numpy(),
                               want["predictions"], rtol=1e-6, atol=1e-6)
    ops = {node.op for node in served.serve.get_concrete_function(
        tf.TensorSpec([None, 2], tf.int32)).graph.as_graph_def().node}
    assert not [op for op in ops if op.startswith("KRE")], ops


# A GroupEmbedding whose two features share one table, on stacked ids.
_GROUP = """
import sys
import numpy as np
import pytest
import keras
import keras_rec_emb as kre
ids = np.array([[[1, 4, -1], [4, 4, 2]], [[-1, -1, -1], [0, -1, 3]],
                [[2, 2, 2], [1, -1, -1]], [[5, 0, -1], [5, 1, 0]]], np.int32)
def group_model():
    table = kre.layers.EmbeddingVariable(3, key_dtype="int32", name="shared")
    # a reads id 7 where an example has no id; b clips its rows.
    group = kre.layers.GroupEmbedding({"a": kre.layers.FeatureSpec(table, "sum", default_id=7),
                                       "b": kre.layers.FeatureSpec(table, "mean", max_norm=0.05)},
                                      output_mode="concat", name="group")
    inputs = keras.Input(shape=(2, 3), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(group(inputs)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.fit(ids, np.arange(4.0)[:, None], batch_size=2, verbose=0)
    return model
"""

# Loads the TensorFlow file, saves what it read and the model again.
_GROUP_JAX = """
from keras_rec_emb.backend.jax import ffi
model = keras.saving.load_model(sys.argv[1])
table = model.get_layer("group").tables[0]
parts = ffi.export_parts(table.handle, "int32", 3, table._kre_slot_specs)
np.savez(sys.argv[2], predictions=model.predict(ids, verbose=0), keys=parts["keys"],
         values=parts["values"], freqs=parts["freqs"], versions=parts["versions"],
         accumulator=parts["slots"]["accumulator"])
model.save(sys.argv[3])
"""


def test_a_group_embedding_model_crosses_backends_both_ways(tmp_path):
    """Saved under TensorFlow, loaded under JAX (same rows, accumulators,
    frequencies, versions, predictions), saved again under JAX and loaded
    under TensorFlow: the same table and the TensorFlow layer's config."""
    import keras

    namespace = {}
    exec(_GROUP, namespace)
    model = namespace["group_model"]()
    path = tmp_path / "tensorflow.keras"
    model.save(str(path))
    e = model.get_layer("group").tables[0].export()
    want = {"keys": e["keys"], "values": e["values"], "freqs": e["freqs"],
            "versions": e["versions"], "accumulator": e["slots"]["accumulator"]}
    predictions = model.predict(namespace["ids"], verbose=0)
    assert sorted(want["keys"]) == [0, 1, 2, 3, 4, 5, 7]  # no -1 key; the default id
    _run_jax(_GROUP + _GROUP_JAX, path, tmp_path / "loaded.npz", tmp_path / "jax.keras")
    got = dict(np.load(tmp_path / "loaded.npz"))
    _assert_same(dict(got, default_values=0), dict(want, default_values=0))
    np.testing.assert_allclose(got["predictions"], predictions, rtol=1e-6, atol=1e-6)

    again = keras.saving.load_model(str(tmp_path / "jax.keras"))
    group = again.get_layer("group")
    assert type(group) is type(model.get_layer("group"))
    e = group.tables[0].export()
    _assert_same({"keys": e["keys"], "values": e["values"], "freqs": e["freqs"],
                  "versions": e["versions"], "accumulator": e["slots"]["accumulator"],
                  "default_values": 0}, dict(want, default_values=0))
    np.testing.assert_allclose(again.predict(namespace["ids"], verbose=0), predictions,
                               rtol=1e-6, atol=1e-6)
    with zipfile.ZipFile(tmp_path / "jax.keras") as archive:
        saved = json.loads(archive.read("config.json"))
    entry = next(e for e in saved["config"]["layers"] if e["name"] == "group")
    assert json.loads(json.dumps(group.get_config()))["features"] == entry["config"]["features"]


# Loads the TensorFlow file with a filter, trains on and saves again.
_JAX_FILTERED = """
import sys
from keras_rec_emb.backend.jax import ffi
PARTS = ("keys", "values", "freqs", "versions", "keys_filtered", "freqs_filtered",
         "versions_filtered", "bloom")
model = keras.saving.load_model(sys.argv[1])
layer = model.get_layer("ev")
def parts():
    p = ffi.export_parts(layer.handle, layer.key_dtype, layer.embedding_dim,
                         layer._kre_slot_specs)
    return {name: np.asarray(p[name]) for name in PARTS}
loaded = parts()
model.fit(more_ids, more_labels, batch_size=4, shuffle=False, verbose=0)
model.save(sys.argv[3])
np.savez(sys.argv[2], **loaded, **{f"trained_{k}": v for k, v in parts().items()},
         filter=type(layer.ev_option.filter_option).__name__)
"""


def _assert_same_filtered(got, want, prefix=""):
    """Equal admitted keys (rows, counts, versions), filtered keys with their
    counts and versions, and Bloom counters."""
    for names in (("keys", "freqs", "versions", "values"),
                  ("keys_filtered", "freqs_filtered", "versions_filtered")):
        order_got = np.argsort(got[prefix + names[0]])
        order_want = np.argsort(want[names[0]])
        for name in names:
            np.testing.assert_array_equal(np.asarray(got[prefix + name])[order_got],
                                          np.asarray(want[name])[order_want], err_msg=name)
    np.testing.assert_array_equal(got[prefix + "bloom"], want["bloom"])


@pytest.mark.parametrize("kind", ["CounterFilter", "CBFFilter"])
def test_a_filtered_table_crosses_backends_both_ways(tmp_path, kind):
    """Saved under TensorFlow with an admission filter, loaded under JAX
    with the same admitted and filtered keys, counts and Bloom counters;
    trained on and saved under JAX, loaded under TensorFlow alike."""
    import keras

    tf_side = _tensorflow()
    kre = tf_side["kre"]
    f = (kre.CounterFilter(5) if kind == "CounterFilter"
         else kre.CBFFilter(5, 200, 0.01, counter_type="uint16"))
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=tf_side["DVD"]), filter_option=f)
    layer = kre.layers.EmbeddingVariable(tf_side["DIM"], key_dtype="int32",
                                         initializer="uniform", ev_option=option, name="ev")
    model = tf_side["train"](layer, kre.optimizers.Adagrad(0.1))
    path = tmp_path / "tensorflow.keras"
    model.save(str(path))
    saved = layer.export()
    assert len(saved["keys"]) and (len(saved["keys_filtered"]) or kind == "CBFFilter")
    assert saved["bloom"].size or kind == "CounterFilter"
    _run_jax(_COMMON + _JAX_FILTERED, path, tmp_path / "loaded.npz", tmp_path / "jax.keras")
    got = dict(np.load(tmp_path / "loaded.npz"))
    assert str(got["filter"]) == kind
    _assert_same_filtered(got, saved)
    again = keras.saving.load_model(str(tmp_path / "jax.keras"))
    twin = again.get_layer("ev")
    assert twin.ev_option.filter_option == f
    trained = twin.export()
    assert len(trained["keys"]) > len(saved["keys"])  # trained on under JAX
    _assert_same_filtered(got, trained, prefix="trained_")
