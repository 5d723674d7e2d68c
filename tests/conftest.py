"""Shared test set-up: quiet TensorFlow, deterministic seeds, and the two
backends (tests/_backends.py).

One run, both backends: the main pytest process runs Keras's TensorFlow
backend; the tests that run under JAX run in a JAX worker process of
tests/_backends.py, each its own item, its node id ending in `[jax]`
(`pytest -k`, `--lf`, `-m` and xdist's `--dist loadfile` treat them as any
test). Which backend a test runs under:

- tests/jax_backend/*: JAX only, except the files of
  `_backends.TENSORFLOW_SIDE` (they start JAX children of their own).
- elsewhere: TensorFlow, unless marked `@pytest.mark.backends("tensorflow",
  "jax")` (or a module's `pytestmark`): then under each backend named, so a
  test written once runs under both. Such a module must not import
  TensorFlow at module level (under JAX it must stay unimported).
- `@pytest.mark.tensorflow_only` marks a test that is TensorFlow by nature
  (tf.distribute, tf.train.Checkpoint, `model.export` of the TF ops):
  the whole of tests/distribute is, and files say so in their `pytestmark`.
  Such a test names no JAX backend, and `-m "not tensorflow_only"` runs
  what should run under both.

By hand, the JAX side alone, in one JAX process:
`KERAS_BACKEND=jax .venv/bin/python -m pytest -q -p no:cacheprovider tests/jax_backend`.
"""

import os
import sys
import random

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest

# `tests.*` modules import from the checkout's root: `python -m pytest` puts
# the working folder on the path, the `pytest` script does not (the wheel
# check runs it). Appended, so that the package imported is still the one
# installed, when one is.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

pytest_plugins = ("tests._backends",)


@pytest.fixture(autouse=True)
def _seed():
    if keras.config.backend() == "jax":
        # keras.utils.set_random_seed imports TensorFlow whenever it is
        # installed, which the JAX backend must not need.
        random.seed(1234)
        np.random.seed(1234)
    else:
        keras.utils.set_random_seed(1234)
    yield


def _mark_tensorflow_only(items):
    """tests/distribute is TensorFlow by nature (tf.distribute)."""
    for item in items:
        if item.nodeid.startswith("tests/distribute/"):
            item.add_marker("tensorflow_only")


class MatrixInitializer(keras.initializers.Initializer):
    """Returns a fixed matrix (tiled to the requested number of rows)."""

    def __init__(self, matrix):
        self.matrix = np.asarray(matrix, np.float32)

    def __call__(self, shape, dtype=None):
        reps = -(-shape[0] // self.matrix.shape[0])
        return np.tile(self.matrix, (reps, 1))[: shape[0]].astype(np.float32)

    def get_config(self):
        return {"matrix": self.matrix.tolist()}


@pytest.fixture
def matrix_initializer():
    """The MatrixInitializer class (rows of a given matrix, tiled)."""
    return MatrixInitializer


def pytest_addoption(parser):
    parser.addoption(
        "--long", action="store_true", default=False,
        help="run the long fuzz test (thousands of cases; also KRE_FUZZ_LONG=1)")


@pytest.fixture
def saving_round_trip(tmp_path):
    """Saves a model as `.keras` under tmp_path, loads it back, checks the
    reloaded model has the same layers and, given `inputs`, predicts the
    same (exactly, unless `rtol`/`atol` are given); returns it."""

    def round_trip(model, inputs=None, name="m.keras", rtol=0.0, atol=0.0):
        path = str(tmp_path / name)
        model.save(path)
        loaded = keras.saving.load_model(path)
        assert type(loaded) is type(model)
        assert [layer.name for layer in loaded.layers] == [layer.name for layer in model.layers]
        if inputs is not None:
            expect = model.predict(inputs, verbose=0)
            got = loaded.predict(inputs, verbose=0)
            if rtol or atol:
                np.testing.assert_allclose(got, expect, rtol=rtol, atol=atol)
            else:
                np.testing.assert_array_equal(got, expect)
        return loaded

    return round_trip


@pytest.fixture
def config_round_trip():
    """Checks that `layer.get_config()` holds every name in `args` (its
    `__init__` arguments) and that `from_config` and Keras serialization
    each rebuild a layer of the same class with an equal config; returns
    the `from_config` clone."""

    def round_trip(layer, args):
        config = layer.get_config()
        assert [a for a in args if a not in config] == []
        clone = type(layer).from_config(config)
        assert type(clone) is type(layer) and clone.get_config() == config
        restored = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(layer))
        assert type(restored) is type(layer) and restored.get_config() == config
        return clone

    return round_trip


# The files that take longest (each minutes of CPU, from `--durations`), the
# longest first. pytest-xdist's `--dist loadfile` hands whole files to its
# workers in collection order (`make test-py` turns off its reordering by
# test count, which put these few-test files last): started first, no long
# file is left running alone at the end while the other worker idles.
_LONGEST_FILES = (
    "tests/test_guides.py",
    "tests/jax_backend/test_multi_hash.py",
    "tests/jax_backend/test_jax_file_tier.py",
    "tests/jax_backend/test_cross_backend_hash_layers.py",
    "tests/distribute/test_mirrored.py",
    "tests/distribute/test_multi_worker.py",
    "tests/benchmarks/test_report.py",
    "tests/test_leaks.py",
    "tests/test_dlrm_forms.py",
    "tests/jax_backend/test_cross_backend_saving.py",
    "tests/test_file_tier.py",
    "tests/test_serving_loaders.py",
    "tests/benchmarks/test_peers.py",
    "tests/distribute/test_ps_connect.py",
    "tests/distribute/test_parameter_servers.py",
    "tests/distribute/test_mwms_lost_worker.py",
    "tests/distribute/test_ps_one_model.py",
    "tests/distribute/test_mwms_group.py",
    "tests/distribute/test_ps_failover.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of _LONGEST_FILES first, in its order; then the others,
    the files of most tests first (xdist's own order), each file's tests in
    their order."""
    missing = [name for name in _LONGEST_FILES
               if not (config.rootpath / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py's _LONGEST_FILES names missing files "
                                f"{missing}: rename or drop them there")

    def path(item):
        return item.nodeid.split("::", 1)[0]

    counts = {}
    for item in items:
        counts[path(item)] = counts.get(path(item), 0) + 1
    rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(path(item), i)
    _mark_tensorflow_only(items)
    items.sort(key=lambda item: (rank.get(path(item), len(rank)), -counts[path(item)],
                                 first[path(item)]))
