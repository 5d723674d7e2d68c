"""One `.keras` format for both backends: a model trained and saved under
TensorFlow (this process) loads under JAX (a child process) with the same
rows, slots, frequencies, versions, initializer matrix and predictions,
and the reverse; `export_for_serving` of a model trained under JAX writes
the stock-TensorFlow SavedModel.

The models load with `compile=False`: the model's own optimizer is
`keras_rec_emb.optimizers.SGD` under TensorFlow (a stock Keras optimizer
cannot update a table there) and a stock one under JAX, and neither
backend deserializes the other's yet. The table's optimizer (the layer's
`optimizer=`) and its slots load in both directions."""

import json
import os
import pathlib
import subprocess
import sys
import zipfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Ids -> EmbeddingVariable(Adagrad) -> Flatten -> Dense(1). The initializer
# is unseeded: a loaded layer draws another matrix, so the predictions for
# the unseen ids 40 and 41 match only if the saved matrix was restored.
_COMMON = """
import json
import numpy as np
import keras
DIM, FEATURES, DVD = 3, 2, 5
rng = np.random.default_rng(11)
ids = rng.integers(0, 11, size=(16, FEATURES)).astype(np.int32)
labels = rng.normal(size=(16, 1)).astype(np.float32)
queries = np.array([[0, 1], [2, 3], [40, 41]], np.int32)
def table_optimizer():
    return dict(learning_rate=0.1, initial_accumulator_value=0.2)
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
"""

_JAX = """
from keras_rec_emb._jax import ffi
from keras_rec_emb._jax.layers import EmbeddingVariable
def parts_of(layer):
    return table_parts(ffi.export_parts(layer.handle, layer.key_dtype, layer.embedding_dim,
                                        [("accumulator", layer.embedding_dim)]))
"""

_JAX_LOADS = """
import sys
model = keras.saving.load_model(sys.argv[1], compile=False)
layer = model.get_layer("ev")
np.savez(sys.argv[2], predictions=model.predict(queries, verbose=0),
         iterations=int(layer.iterations.value), **parts_of(layer))
with open(sys.argv[3], "w") as f:
    json.dump(layer.get_config(), f)
"""

_JAX_SAVES = """
import sys
layer = EmbeddingVariable(DIM, optimizer=keras.optimizers.Adagrad(**table_optimizer()),
                          initializer="uniform", default_value_dim=DVD, key_dtype="int32",
                          name="ev")
model = train(layer, keras.optimizers.SGD(0.05))
model.save(sys.argv[1])
np.savez(sys.argv[2], predictions=model.predict(queries, verbose=0), **parts_of(layer))
import keras_rec_emb
assert keras_rec_emb.export_for_serving(model, sys.argv[3]) == sys.argv[3]
"""

_TENSORFLOW = """
import keras_rec_emb as kre
def tensorflow_layer():
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD), track_meta=True)
    return kre.layers.EmbeddingVariable(
        DIM, key_dtype="int32", initializer="uniform", ev_option=option, name="ev",
        optimizer=kre.optimizers.Adagrad(**table_optimizer()))
"""


def _run_jax(code, *args):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]


def _tensorflow():
    namespace = {}
    exec(_COMMON + _TENSORFLOW, namespace)
    return namespace


def _by_key(parts):
    order = np.argsort(parts["keys"])
    return {name: (np.asarray(parts[name])[order]
                   if name in ("keys", "values", "freqs", "versions", "accumulator")
                   else np.asarray(parts[name]))
            for name in ("keys", "values", "freqs", "versions", "accumulator",
                         "default_values")}


def _assert_same(got, want):
    got, want = _by_key(got), _by_key(want)
    np.testing.assert_array_equal(got["keys"], want["keys"])
    for name in ("freqs", "versions", "values", "accumulator", "default_values"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_model_saved_under_tensorflow_loads_under_jax(tmp_path):
    tf_side = _tensorflow()
    layer = tf_side["tensorflow_layer"]()
    import keras_rec_emb as kre

    model = tf_side["train"](layer, kre.optimizers.SGD(0.05))
    path = tmp_path / "tensorflow.keras"
    model.save(str(path))
    want = tf_side["table_parts"](layer.export())
    assert len(want["keys"]) > 5 and want["versions"].max() == 7  # 8 steps
    _run_jax(_COMMON + _JAX + _JAX_LOADS, path, tmp_path / "loaded.npz",
             tmp_path / "config.json")
    got = dict(np.load(tmp_path / "loaded.npz"))
    _assert_same(got, want)
    np.testing.assert_allclose(got["predictions"], model.predict(tf_side["queries"], verbose=0),
                               rtol=1e-6, atol=1e-6)
    assert int(got["iterations"]) == 8  # the step after the last update
    # The JAX layer writes back the config it read.
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        json.dumps(layer.get_config()))


def test_a_model_trained_under_jax_loads_and_serves_under_tensorflow(tmp_path):
    """The JAX child saves the model and exports it for serving (which runs
    a TensorFlow child of its own)."""
    import keras
    import tensorflow as tf

    path = tmp_path / "jax.keras"
    _run_jax(_COMMON + _JAX + _JAX_SAVES, path, tmp_path / "saved.npz", tmp_path / "serving")
    want = dict(np.load(tmp_path / "saved.npz"))
    assert len(want["keys"]) > 5 and want["versions"].max() == 7
    tf_side = _tensorflow()
    model = keras.saving.load_model(str(path), compile=False)
    layer = model.get_layer("ev")
    import keras_rec_emb as kre

    assert isinstance(layer, kre.layers.EmbeddingVariable)
    assert type(layer.table_optimizer).__name__ == "Adagrad"
    _assert_same(tf_side["table_parts"](layer.export()), want)
    np.testing.assert_allclose(model.predict(tf_side["queries"], verbose=0), want["predictions"],
                               rtol=1e-6, atol=1e-6)
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
