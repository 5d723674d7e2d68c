"""`.keras` files saved under TensorFlow, loaded under JAX: one holding a
`LossScaleOptimizer` loads; one whose model hashes strings (`HashStrings`)
fails with the error naming the host-side alternative; every name registered
under TensorFlow is registered under JAX."""

import json
import os
import pathlib
import subprocess
import sys

import keras
import pytest

import keras_rec_emb  # noqa: F401  (registers the classes)

ROOT = pathlib.Path(__file__).resolve().parents[2]

_TENSORFLOW_SAVES = r"""
import sys
import numpy as np
import tensorflow as tf
import keras
import keras_rec_emb as kre

strings = keras.Input(shape=(2,), dtype="string")
keys = kre.layers.HashStrings()(strings)
rows = kre.layers.EmbeddingVariable(4, combiner="mean")(keys)
model = keras.Model(strings, keras.layers.Dense(1)(rows))
model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
model.fit(tf.constant([["a", "b"], ["a", ""]]), np.ones((2, 1)), verbose=0)
model.save(sys.argv[1])

ids = keras.Input(shape=(2,), dtype="int64")
rows = kre.layers.EmbeddingVariable(4, combiner="sum")(ids)
model = keras.Model(ids, keras.layers.Dense(1)(rows))
model.compile(optimizer=kre.optimizers.LossScaleOptimizer(kre.optimizers.SGD(0.1)),
              loss="mse")
model.fit(np.array([[1, 2], [3, 4]]), np.ones((2, 1)), verbose=0)
model.save(sys.argv[2])

import json
from keras_rec_emb import callbacks, data, incremental, layers, ops, optimizers  # noqa: F401
from keras.src.saving import object_registration
print(json.dumps(sorted(name for name in object_registration.GLOBAL_CUSTOM_OBJECTS
                        if name.startswith("keras_rec_emb>"))))
"""


@pytest.fixture(scope="module")
def tensorflow_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tf_files")
    paths = (folder / "hash_strings.keras", folder / "loss_scale.keras")
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    run = subprocess.run([sys.executable, "-c", _TENSORFLOW_SAVES, *map(str, paths)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    files = dict(zip(("HashStrings", "LossScaleOptimizer"), paths))
    # The names the TensorFlow backend registers.
    files["names"] = json.loads(run.stdout.strip().splitlines()[-1])
    return files


def test_a_loss_scale_optimizer_file_loads_under_jax(tensorflow_files):
    # LossScaleOptimizer is one class for both backends now.
    from keras_rec_emb import optimizers

    model = keras.saving.load_model(str(tensorflow_files["LossScaleOptimizer"]))
    assert isinstance(model.optimizer, optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, optimizers.SGD)


def test_a_tensorflow_file_whose_model_hashes_strings_names_the_alternative(tensorflow_files):
    with pytest.raises(ValueError, match=r"HashStrings '.*' cannot be part of a model under "
                       r"Keras's JAX backend: JAX arrays hold no strings.*before the model"):
        keras.saving.load_model(str(tensorflow_files["HashStrings"]))


def test_every_name_registered_under_tensorflow_is_registered_under_jax(tensorflow_files):
    names = tensorflow_files["names"]
    assert "keras_rec_emb>HashStrings" in names and len(names) > 10
    missing = [n for n in names if keras.saving.get_registered_object(n) is None]
    assert missing == []
