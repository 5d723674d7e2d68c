"""The table engine through XLA's FFI (keras_rec_emb/backend/jax/ffi.py): rows,
initializer rows, sparse updates against NumPy, export, bad input."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from keras_rec_emb.backend.jax import ffi

# Written for int32 ids (JAX's 32-bit mode); the 64-bit cases switch it on.
pytestmark = pytest.mark.usefixtures("jax_32_bit_mode")

SGD = ("learning_rate", "decay")
ADAGRAD = ("learning_rate", "decay", "epsilon")


def live_tables():
    """The number of tables alive in this process (created, not destroyed)."""
    return int(ffi.library().KreLiveTables())


def defaults(rows=3, dim=4):
    return (np.arange(rows * dim, dtype=np.float32).reshape(rows, dim) - 5.0) / 7.0


@pytest.fixture
def table():
    handle = ffi.create(defaults())
    yield handle
    ffi.destroy(handle)


def by_key(exported):
    order = np.argsort(exported["keys"])
    return {name: value[order] for name, value in exported.items()}


def test_no_tensorflow_under_the_jax_backend():
    """The package and the binding import and run without TensorFlow (in a
    fresh process: this one's fixtures are not the package's)."""
    code = ("import sys, numpy as np\n"
            "import keras_rec_emb\n"
            "from keras_rec_emb.backend.jax import ffi\n"
            "t = ffi.create(np.ones((1, 2), np.float32))\n"
            "assert np.asarray(ffi.lookup(t, np.array([3], np.int32), 2)).tolist() == [[1, 1]]\n"
            "assert keras_rec_emb.__all__[:4] == ['__version__', 'export_for_serving', "
            "'layers', 'optimizers']\n"
            "assert keras_rec_emb.CounterFilter(2).filter_freq == 2\n"
            "assert keras_rec_emb.optimizers.Adam.__module__ == "
            "'keras_rec_emb.optimizers.keras_optimizers'\n"
            "assert keras_rec_emb.layers.GroupEmbedding.__module__ == "
            "'keras_rec_emb.layers.group_embedding'\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, KERAS_BACKEND="jax"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_new_keys_read_their_initializer_row_and_keep_it(table):
    keys = np.array([[4, 0, 7], [4, 11, 2]], np.int32)
    rows = np.asarray(ffi.lookup(table, keys, 4))
    assert rows.shape == (2, 3, 4)
    np.testing.assert_array_equal(rows, defaults()[keys % 3])
    np.testing.assert_array_equal(np.asarray(ffi.size(table)), [5, 0, 0, 0])
    exported = by_key(ffi.export(table, "int32", 4))
    np.testing.assert_array_equal(exported["keys"], [0, 2, 4, 7, 11])
    np.testing.assert_array_equal(exported["values"], defaults()[[0, 2, 1, 1, 2]])
    np.testing.assert_array_equal(exported["freqs"], [1, 1, 2, 1, 1])


def test_lookup_without_insert_changes_nothing(table):
    rows = np.asarray(ffi.lookup(table, np.array([5, 6], np.int32), 4, insert=False))
    np.testing.assert_array_equal(rows, defaults()[[2, 0]])
    assert int(ffi.size(table)[0]) == 0
    assert ffi.export(table, "int32", 4)["keys"].shape == (0,)


def test_empty_batch(table):
    rows = ffi.lookup(table, np.zeros((0, 3), np.int32), 4)
    assert rows.shape == (0, 3, 4)
    ffi.apply(table, np.zeros((0,), np.int32), np.zeros((0, 4), np.float32), [0.1, 0.0], 1,
              "sgd", SGD, ())
    assert int(ffi.size(table)[0]) == 0


def test_sgd_sums_the_gradients_of_equal_keys_and_decays_first(table):
    keys = np.array([3, 8, 3, 3], np.int32)
    grads = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    ffi.lookup(table, keys, 4)
    ffi.apply(table, keys, grads, [0.5, 0.01], 7, "sgd", SGD, ())
    start = defaults()[[0, 2]]
    summed = np.stack([grads[[0, 2, 3]].sum(0), grads[1]])
    want = (start - start * np.float32(0.01)) - summed * np.float32(0.5)
    exported = by_key(ffi.export(table, "int32", 4))
    np.testing.assert_allclose(exported["values"], want, rtol=1e-6)
    np.testing.assert_array_equal(exported["versions"], [7, 7])
    np.testing.assert_array_equal(exported["freqs"], [3, 1])


def test_adagrad_matches_numpy_over_steps(table):
    ffi.add_slot(table, "accumulator", 4, 0.1)
    rng = np.random.default_rng(0)
    lr, eps = np.float32(0.3), np.float32(1e-7)
    values = {}
    acc = {}
    for step in range(4):
        keys = rng.integers(0, 6, size=5).astype(np.int32)
        grads = rng.normal(size=(5, 4)).astype(np.float32)
        rows = np.asarray(ffi.lookup(table, keys, 4))
        for i, k in enumerate(keys):
            values.setdefault(int(k), defaults()[k % 3].copy())
            acc.setdefault(int(k), np.full(4, 0.1, np.float32))
            np.testing.assert_allclose(rows[i], values[int(k)], rtol=1e-6)
        ffi.apply(table, keys, grads, [lr, 0.0, eps], step, "adagrad", ADAGRAD,
                  ("accumulator",))
        for k in np.unique(keys):
            g = grads[keys == k].sum(0)
            acc[int(k)] = acc[int(k)] + g * g
            values[int(k)] = values[int(k)] - lr * g / np.sqrt(acc[int(k)] + eps)
    exported = by_key(ffi.export(table, "int32", 4))
    want_keys = sorted(values)
    np.testing.assert_array_equal(exported["keys"], want_keys)
    np.testing.assert_allclose(exported["values"], [values[k] for k in want_keys], rtol=1e-5)
    np.testing.assert_allclose(exported["slots"], [acc[k] for k in want_keys], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ffi.size(table)), [len(values), 0, 4, 1])


def test_int64_keys_with_x64():
    with jax.enable_x64(True):
        handle = ffi.create(defaults(), key_dtype="int64")
        big = np.array([2**40 + 1, -(2**35)], np.int64)
        rows = np.asarray(ffi.lookup(handle, big, 4))
        np.testing.assert_array_equal(rows, defaults()[big % 3])
        exported = by_key(ffi.export(handle, "int64", 4))
        assert exported["keys"].dtype == np.int64
        np.testing.assert_array_equal(exported["keys"], np.sort(big))
        ffi.destroy(handle)


def test_int64_keys_need_x64():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        ffi.create(defaults(), key_dtype="int64")
    with pytest.raises(ValueError, match="key_dtype must be one of"):
        ffi.create(defaults(), key_dtype="float32")


def test_destroy_frees_the_table():
    before = live_tables()
    handle = ffi.create(defaults())
    assert live_tables() == before + 1
    ffi.destroy(handle)
    assert live_tables() == before
    with pytest.raises(Exception, match=f"no embedding table has handle {handle}"):
        np.asarray(ffi.lookup(handle, np.array([1], np.int32), 4))


@pytest.mark.parametrize("call, message", [
    (lambda t: ffi.lookup(t, np.array([1.0], np.float32), 4),
     "the embedding table has int32 keys but `keys` is float32"),
    (lambda t: ffi.lookup(t, np.array([1], np.int32), 5),
     r"`out` must have shape keys.shape \+ \[dim\] = \[1\] \+ \[4\], got \[1, 5\]"),
    (lambda t: ffi.apply(t, np.array([1], np.int32), np.zeros((2, 4)), [0.1, 0.0], 1, "sgd",
                         SGD, ()),
     r"`grads` must have shape keys.shape \+ \[dim\]"),
    (lambda t: ffi.apply(t, np.array([1], np.int32), np.zeros((1, 4)), [0.1, 0.0], 1, "rmsprop",
                         SGD, ()),
     "unknown rule 'rmsprop'"),
    (lambda t: ffi.apply(t, np.array([1], np.int32), np.zeros((1, 4)), [0.1, 0.0], 1, "sgd",
                         ("decay", "learning_rate"), ()),
     r"rule 'sgd' takes hyper-parameters \[learning_rate, decay\] in this order"),
    (lambda t: ffi.apply(t, np.array([1], np.int32), np.zeros((1, 4)), [0.1, 0.0, 1e-7], 1,
                         "adagrad", ADAGRAD, ("accumulator",)),
     "the embedding table has no optimizer slot 'accumulator'"),
    (lambda t: ffi.apply(t, np.array([1], np.int32), np.zeros((1, 4)), [0.1], 1, "sgd", SGD, ()),
     r"rule 'sgd' takes 2 hyper-parameters, got shape \[1\]"),
    (lambda t: ffi.apply(t, np.array([1], np.int32), np.zeros((1, 4)), [np.nan, 0.0], 1, "sgd",
                         SGD, ()),
     "`hyper` must be finite; learning_rate is nan"),
    (lambda t: ffi.add_slot(t, "", 4), "`slot_name` must not be empty"),
    (lambda t: ffi.add_slot(t, "a,b", 4), "`slot_name` must not contain ','"),
    (lambda t: ffi.add_slot(t, "m", 0), r"`width` must be in \[1, 2\*\*20\], got 0"),
])
def test_bad_input_is_an_error_naming_the_argument(table, call, message):
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(call(table))
    # The table is still usable.
    assert np.asarray(ffi.lookup(table, np.array([1], np.int32), 4)).shape == (1, 4)


def test_bad_create_arguments():
    with pytest.raises(ValueError, match="default_values must be"):
        ffi.create(np.zeros((0, 4), np.float32))
    with pytest.raises(Exception, match=r"`num_shards` must be in \[1, 65536\], got 0"):
        ffi.create(defaults(), num_shards=0)
    with pytest.raises(Exception, match="`default_values` must not hold NaN"):
        ffi.create(np.full((1, 2), np.nan, np.float32))


def test_a_slot_keeps_its_width(table):
    ffi.add_slot(table, "m", 4)
    with pytest.raises(Exception, match="width"):
        jax.block_until_ready(ffi.add_slot(table, "m", 1))


def test_management_runs_at_once_inside_a_trace():
    """create, add_slot and size are host calls, not staged into the
    computation being traced (which may never run)."""
    made, sizes = [], []

    def f(x):
        made.append(ffi.create(defaults()))
        ffi.add_slot(made[-1], "accumulator", 4, 0.5)
        sizes.append(ffi.size(made[-1]))
        return x + 1

    before = live_tables()
    jax.make_jaxpr(f)(np.float32(1))  # traced, never run
    assert len(made) == 1 and isinstance(made[0], int) and live_tables() == before + 1
    np.testing.assert_array_equal(sizes[0], [0, 0, 4, 1])
    jax.jit(lambda x: f(x))(np.float32(1))  # another trace: another table
    assert len(made) == 2 and live_tables() == before + 2
    np.testing.assert_array_equal(ffi.size(made[1]), [0, 0, 4, 1])
    np.testing.assert_array_equal(np.asarray(ffi.lookup(made[0], np.array([4], np.int32), 4)),
                                  defaults()[[1]])
    for handle in made:
        ffi.destroy(handle)
    assert live_tables() == before


def test_size_sees_the_lookups_dispatched_before_it(table):
    step = jax.jit(lambda k: ffi.lookup(table, k, 4))
    for i in range(5):
        step(np.arange(3 * i, 3 * i + 3, dtype=np.int32))
    assert ffi.size(table)[0] == 15
