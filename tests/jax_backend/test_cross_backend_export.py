"""`export_for_serving` of models trained under JAX that hold the user's own
classes (a custom layer, a subclassed model), defined in the script being
run or in a module of the user's: the stock-TensorFlow SavedModel serves
what `predict` gave under JAX. This process runs TensorFlow and serves; the
scripts run under JAX, as users run them (`python script.py`)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A custom layer (registered) and a subclassed model (not registered: Keras
# saves it by module and class name) over an EmbeddingVariable and a
# GroupEmbedding with a sequence-free dict input; ids far above 2**24.
_CLASSES = '''
import numpy as np
import keras
import keras_rec_emb as kre

SCALE = 0.5


@keras.saving.register_keras_serializable(package="user")
class Tower(keras.layers.Layer):
    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x)) * SCALE

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class Ranker(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.user = kre.layers.EmbeddingVariable(4, combiner="mean", name="user")
        self.item = kre.layers.EmbeddingVariable(4, name="item")
        self.tower = Tower(units=5)

    def call(self, inputs):
        item = keras.ops.reshape(self.item(inputs["item"]), (-1, 4))
        return self.tower(keras.ops.concatenate([self.user(inputs["user"]), item], axis=-1))


def functional_ranker():
    user = keras.Input((3,), dtype="int64", name="user")
    item = keras.Input((1,), dtype="int64", name="item")
    rows = [kre.layers.EmbeddingVariable(4, combiner="mean")(user),
            keras.layers.Flatten()(kre.layers.EmbeddingVariable(4)(item))]
    return keras.Model({"user": user, "item": item},
                       Tower()(keras.ops.concatenate(rows, axis=-1)))
'''

_TRAIN = '''
import sys
rng = np.random.default_rng(3)
x = {"user": rng.integers(0, 10**12, size=(32, 3)), "item": rng.integers(0, 10**12, size=(32, 1))}
model = MODEL
model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
model.fit(x, rng.normal(size=(32, 1)), batch_size=8, epochs=2, verbose=0)
queries = {"user": np.concatenate([x["user"][:4], rng.integers(0, 10**12, size=(2, 3))]),
           "item": np.concatenate([x["item"][:4], rng.integers(0, 10**12, size=(2, 1))])}
np.savez(sys.argv[2], predictions=model.predict(queries, verbose=0), **queries)
assert kre.export_for_serving(model, sys.argv[1]) == sys.argv[1]
'''


def _run_under_jax(script, tmp_path, pythonpath=None):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), pythonpath) if p)
    path = tmp_path / "script.py"
    path.write_text(script)
    run = subprocess.run([sys.executable, str(path), str(tmp_path / "serving"),
                          str(tmp_path / "expected.npz")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]


def _assert_serves_predictions(tmp_path):
    expected = np.load(tmp_path / "expected.npz")
    served = tf.saved_model.load(str(tmp_path / "serving"))
    spec = served.serve.concrete_functions[0].structured_input_signature
    got = served.serve({"user": tf.constant(expected["user"]),
                        "item": tf.constant(expected["item"])}).numpy()
    np.testing.assert_allclose(got, expected["predictions"], rtol=1e-5, atol=1e-6)
    return spec


@pytest.mark.parametrize("form", ["subclassed", "functional"])
def test_a_jax_script_exports_its_own_classes(tmp_path, form):
    """The classes are defined in the script itself (`__main__`)."""
    model = "Ranker()" if form == "subclassed" else "functional_ranker()"
    _run_under_jax(_CLASSES + _TRAIN.replace("MODEL", model), tmp_path)
    spec = _assert_serves_predictions(tmp_path)
    # The subclassed model's ids are exported as int64 (its first call's dtype).
    assert {s.dtype for s in tf.nest.flatten(spec)} == {tf.int64}


def test_a_jax_script_exports_classes_of_a_module_of_its_own(tmp_path):
    """The classes live in the user's module, found through the script's path."""
    package = tmp_path / "lib"
    package.mkdir()
    (package / "user_models.py").write_text(_CLASSES)
    _run_under_jax("from user_models import *\n" + _TRAIN.replace("MODEL", "Ranker()"), tmp_path,
                   pythonpath=str(package))
    _assert_serves_predictions(tmp_path)


def test_a_class_without_source_is_refused_by_name(tmp_path):
    """A class made where no source exists (here by `type(...)`, as in a
    REPL) cannot reach the TensorFlow process: the error names it."""
    script = _CLASSES.replace("class Ranker(keras.Model):", "class _Ranker(keras.Model):") + (
        "Ranker = type('Ranker', (_Ranker,), {'__module__': '__main__'})\n"
        "del _Ranker\n") + _TRAIN.replace("MODEL", "Ranker()")
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    path = tmp_path / "script.py"
    path.write_text(script)
    run = subprocess.run([sys.executable, str(path), str(tmp_path / "serving"),
                          str(tmp_path / "expected.npz")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode != 0
    assert "'Ranker'" in run.stderr and "Define it in a module file" in run.stderr, \
        run.stderr[-3000:]
    assert not (tmp_path / "serving").exists()
