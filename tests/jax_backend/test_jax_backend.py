"""Runs tests/jax_backend under Keras's JAX backend in a child pytest (this
process runs TensorFlow), and checks that the JAX binding's library links
neither TensorFlow nor Python."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

import keras_rec_emb

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = pathlib.Path(keras_rec_emb.__file__).parent / "_kre_jax.so"


def test_library_is_built():
    assert LIBRARY.exists(), f"{LIBRARY} is missing: `make jax-ops` builds it"


def test_library_links_neither_tensorflow_nor_python():
    needed = subprocess.run(["ldd", str(LIBRARY)], capture_output=True, text=True, check=True)
    libraries = [line.split()[0] for line in needed.stdout.splitlines() if line.strip()]
    assert libraries and not [lib for lib in libraries
                              if "tensorflow" in lib or "python" in lib or "jax" in lib]
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(LIBRARY)],
                               capture_output=True, text=True, check=True).stdout
    symbols = [line.split()[-1] for line in undefined.splitlines() if line.strip()]
    assert symbols  # libc, libstdc++
    assert [s for s in symbols if "tensorflow" in s or "absl" in s or s.startswith("Py")] == []
    exported = subprocess.run(["nm", "-D", "--defined-only", str(LIBRARY)],
                              capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert {"KreTableCreate", "KreTableLookup", "KreTableApply", "KreTableExport"} <= names


def test_tests_under_the_jax_backend_pass():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "tests/jax_backend"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-4000:]


# The same model under both backends: ids -> EmbeddingVariable -> Flatten ->
# Dense(1), MSE, SGD for the table and the Dense layer, fixed initial values.
_CROSS = """
import numpy as np
import keras
DIM, FEATURES, DVD, LR = 3, 2, 5, 0.05
rng = np.random.default_rng(7)
ids = rng.integers(0, 11, size=(16, FEATURES)).astype(np.int32)
labels = rng.normal(size=(16, 1)).astype(np.float32)
matrix = rng.normal(size=(DVD, DIM)).astype(np.float32)
kernel = rng.normal(size=(FEATURES * DIM, 1)).astype(np.float32)
layer = make_layer(keras.initializers.Constant(matrix))
inputs = keras.Input(shape=(FEATURES,), dtype="int32")
dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(kernel))
model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
model.compile(optimizer=dense_optimizer(LR), loss="mse")
model.fit(ids, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
e = export(layer)
order = np.argsort(e["keys"])
result = {"keys": e["keys"][order].tolist(), "values": e["values"][order].tolist(),
          "freqs": e["freqs"][order].tolist(),
          "kernel": dense.get_weights()[0].tolist(), "bias": dense.get_weights()[1].tolist()}
"""

_TENSORFLOW = """
import keras_rec_emb as kre
def make_layer(init):
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(initializer=init, default_value_dim=DVD), track_meta=True)
    return kre.layers.EmbeddingVariable(DIM, key_dtype="int32", ev_option=option)
def dense_optimizer(lr):
    return kre.optimizers.SGD(learning_rate=lr)
def export(layer):
    return layer.table.export()
"""

_JAX = """
from keras_rec_emb._jax.layers import EmbeddingVariable
def make_layer(init):
    return EmbeddingVariable(DIM, optimizer=keras.optimizers.SGD(learning_rate=LR),
                             initializer=init, default_value_dim=DVD)
def dense_optimizer(lr):
    return keras.optimizers.SGD(learning_rate=lr)
def export(layer):
    return layer.export()
"""


def _train_under_jax():
    code = "import json, sys\nimport keras\n" + _JAX + _CROSS + "json.dump(result, sys.stdout)\n"
    env = dict(os.environ, KERAS_BACKEND="jax")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _train_under_tensorflow():
    """In this process (the suite's runs TensorFlow): saves a child's start."""
    namespace = {}
    exec("import keras\n" + _TENSORFLOW + _CROSS, namespace)
    return namespace["result"]


def test_sgd_training_gives_the_tensorflow_backends_numbers():
    """model.fit with SGD under KERAS_BACKEND=jax and =tensorflow: the same
    ids, rows, frequencies and Dense weights (1e-5)."""
    tf_run = _train_under_tensorflow()
    jax_run = _train_under_jax()
    assert jax_run["keys"] == tf_run["keys"] and jax_run["freqs"] == tf_run["freqs"]
    for name in ("values", "kernel", "bias"):
        np.testing.assert_allclose(jax_run[name], tf_run[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
