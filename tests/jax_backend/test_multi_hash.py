"""MultiHashEmbedding under Keras's JAX backend: the hash under jit, `fit`
to NumPy's SGD and Adagrad, save/load in every model form, config and bad
input (the rows, partitions and combiners against NumPy under both backends
are in tests/layers/test_multi_hash_embedding.py)."""

import math

import jax
import keras
import numpy as np
import pytest

import keras_rec_emb
from keras_rec_emb.layers.multi_hash_embedding import MultiHashEmbedding
from tests._doctest_examples import assert_examples_run
from tests._multi_hash_cases import CASES, IDS, MASK64, case_id, in_range, splitmix64

@pytest.mark.parametrize("kwargs", CASES, ids=case_id)
def test_rows_in_jit_are_the_eager_ones(kwargs):
    # tests/layers/test_multi_hash_embedding.py checks the rows against
    # NumPy under both backends; here the hash traced as in fit.
    layer = MultiHashEmbedding(100, initializer="random_normal", **kwargs)
    eager = np.asarray(layer(IDS))  # builds the tables outside the trace
    np.testing.assert_allclose(np.asarray(jax.jit(lambda x: layer(x))(IDS)), eager, rtol=1e-6)


def adagrad(lr, acc0=0.1, eps=1e-7):
    state = {}

    def step(name, weight, grad):
        acc = state.setdefault(name, np.full_like(weight, acc0)) + grad * grad
        state[name] = acc
        return weight - lr * grad / np.sqrt(acc + eps)

    return step


def sgd(lr):
    return lambda name, weight, grad: weight - lr * grad


def numpy_fit(layer_tables, kernel, bias, ids, labels, batch, step, moduli):
    """MSE training of ids -> Q-R "add" -> Flatten -> Dense(1), by hand."""
    quotient, remainder = (t.copy() for t in layer_tables)
    m = moduli
    for start in range(0, len(ids), batch):
        k, y = ids[start:start + batch], labels[start:start + batch]
        q, r = k // m, k % m
        rows = quotient[q] + remainder[r]  # [b, F, D]
        flat = rows.reshape(len(k), -1)
        pred = flat @ kernel + bias
        d = 2.0 * (pred - y) / len(k)
        d_rows = (d @ kernel.T).reshape(rows.shape)
        g_quotient, g_remainder = np.zeros_like(quotient), np.zeros_like(remainder)
        np.add.at(g_quotient, q.ravel(), d_rows.reshape(-1, rows.shape[-1]))
        np.add.at(g_remainder, r.ravel(), d_rows.reshape(-1, rows.shape[-1]))
        kernel, bias = (step("kernel", kernel, flat.T @ d), step("bias", bias, d.sum(0)))
        quotient = step("quotient", quotient, g_quotient)
        remainder = step("remainder", remainder, g_remainder)
    return quotient, remainder, kernel, bias


@pytest.mark.parametrize("optimizer", ["SGD", "Adagrad"])
def test_fit_trains_the_tables_and_dense_weights_to_numpys_numbers(optimizer):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 30, size=(12, 2)).astype(np.int32)
    labels = rng.normal(size=(12, 1)).astype(np.float32)
    layer = MultiHashEmbedding(30, 3, initializer="random_normal", name="mh")
    inputs = keras.Input(shape=(2,), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer="random_normal", bias_initializer="ones")
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    lr = 0.05
    if optimizer == "SGD":
        model.compile(optimizer=keras_rec_emb.optimizers.SGD(lr), loss="mse")
        step = sgd(lr)
    else:
        model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(
            lr, initial_accumulator_value=0.1, epsilon=1e-7), loss="mse")
        step = adagrad(lr)
    tables = [np.asarray(w) for w in layer.tables]
    kernel, bias = (np.asarray(w) for w in dense.weights)
    model.fit(ids, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    want = numpy_fit(tables, kernel, bias, ids, labels, 4, step, layer.partition_sizes[1])
    got = [np.asarray(w) for w in (*layer.tables, *dense.weights)]
    for name, a, b in zip(("quotient", "remainder", "kernel", "bias"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@keras.saving.register_keras_serializable(package="test_multi_hash")
class Subclassed(keras.Model):
    """Its `call` takes no `training`: its layers get None in `fit`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = MultiHashEmbedding(40, [2, 3], operation="concat", combiner="mean",
                                            initializer="random_normal", name="mh")
        self.dense = keras.layers.Dense(1, name="dense")

    def call(self, ids):
        return self.dense(self.embedding(ids))


def make(form):
    def layers():
        return [MultiHashEmbedding(40, [2, 3], operation="concat", combiner="mean",
                                   initializer="random_normal", name="mh"),
                keras.layers.Dense(1, name="dense")]

    if form == "functional":
        inputs = keras.Input(shape=(3,), dtype="int32")
        embedding, dense = layers()
        return keras.Model(inputs, dense(embedding(inputs)))
    if form == "subclassed":
        return Subclassed()
    if form == "sequential":
        return keras.Sequential([keras.Input(shape=(3,), dtype="int32"), *layers()])
    return keras.Sequential(layers())  # without keras.Input: float32 ids, cast


@pytest.mark.parametrize("form", ["functional", "subclassed", "sequential",
                                  "sequential_without_input"])
def test_each_model_form_trains_and_saves_its_tables(form, tmp_path):
    """`fit` trains the tables (a subclassed model's layer gets
    training=None), `predict` changes nothing, and a saved model loads
    with the same tables and predictions."""
    rng = np.random.default_rng(5)
    ids = rng.integers(-50, 90, size=(16, 3)).astype(np.int32)
    labels = rng.normal(size=(16, 1)).astype(np.float32)
    model = make(form)
    model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    before = model.predict(ids, batch_size=4, verbose=0)
    layer = model.get_layer("mh")
    tables = [np.asarray(w).copy() for w in layer.tables]
    np.testing.assert_array_equal(model.predict(ids, batch_size=4, verbose=0), before)
    model.fit(ids, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    trained = [np.asarray(w) for w in layer.tables]
    # Only the rows the ids read moved.
    for table, old, idx in zip(trained, tables, layer.partition_indices(
            in_range(ids, 40))):
        read = np.zeros(len(table), bool)
        read[np.asarray(idx).ravel()] = True
        assert not np.allclose(table[read], old[read])
        np.testing.assert_array_equal(table[~read], old[~read])
    after = model.predict(ids, batch_size=4, verbose=0)
    assert not np.allclose(after, before)

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    again = loaded.get_layer("mh")
    assert type(again) is MultiHashEmbedding
    assert again.get_config() == layer.get_config()
    for a, b in zip(again.tables, trained):
        np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_allclose(loaded.predict(ids, batch_size=4, verbose=0), after, rtol=1e-6)
    # The optimizer's state came back: one more step is the same on both.
    for m in (model, loaded):
        m.fit(ids[:4], labels[:4], batch_size=4, verbose=0)
    for a, b in zip(again.tables, layer.tables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_the_public_name_is_the_jax_class_under_the_tensorflow_name():
    assert keras_rec_emb.layers.MultiHashEmbedding is MultiHashEmbedding
    assert (keras.saving.get_registered_name(MultiHashEmbedding)
            == "keras_rec_emb>MultiHashEmbedding")


def test_get_config_covers_every_argument():
    layer = MultiHashEmbedding(
        500, [2, 3, 4], complementary_strategy="CRT", operation="concat",
        initializer=keras.initializers.RandomNormal(seed=4), combiner="sqrtn",
        num_partitions=3, moduli=[7, 9, 10], hash_input=False, output_dim=9, name="mh",
        dtype="float32", trainable=False)
    config = layer.get_config()
    again = MultiHashEmbedding.from_config(config)
    assert again.get_config() == config
    for name in ("num_buckets", "embedding_dim", "complementary_strategy", "operation",
                 "combiner", "num_partitions", "moduli", "hash_input", "output_dim",
                 "trainable", "name"):
        assert getattr(again, name) == getattr(layer, name), name
    deeprec = MultiHashEmbedding(25, 6, qr_sizes=(5, 3), m=None)
    assert MultiHashEmbedding.from_config(deeprec.get_config()).partition_sizes == [5, 3]
    assert MultiHashEmbedding.from_config(MultiHashEmbedding(30, 2, m=4).get_config()).m == 4


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_buckets": 0}, ValueError, r"`num_buckets` must be a positive integer\. "
                                     r"Received: num_buckets=0"),
    ({"complementary_strategy": "XOR"}, ValueError,
     r"`complementary_strategy` must be one of \('Q-R', 'generalized_QR', 'CRT'\)\. "
     r"Received: complementary_strategy='XOR'"),
    ({"operation": "max"}, ValueError, r"`operation` must be one of .*operation='max'"),
    ({"combiner": "max"}, ValueError, r"`combiner` must be None or one of .*combiner='max'"),
    ({"hash_input": 1}, TypeError, r"`hash_input` must be a bool\. Received: hash_input=1"),
    ({"operation": "concat"}, ValueError, r"`embedding_dim` must be a list of 2 widths"),
    ({"embedding_dim": [2, 3]}, ValueError, r"a list of widths needs operation='concat'"),
    ({"complementary_strategy": "CRT", "moduli": [10, 12]}, ValueError,
     r"`moduli` must be pairwise coprime.*10 and 12 share the factor 2"),
    ({"moduli": [10, 10]}, ValueError, r"'Q-R' takes `m`\. Received: moduli=\[10, 10\]"),
    ({"complementary_strategy": "CRT", "moduli": [3, 5]}, ValueError,
     r"product of `moduli` must be at least `num_buckets` \(100\)"),
    ({"num_partitions": 3}, ValueError, r"`num_partitions` must be 2 .*num_partitions=3"),
    ({"qr_sizes": (5, 3)}, ValueError, r"must be at most 5\*\*2 = 25.*num_buckets=100"),
    ({"output_dim": 5}, ValueError, r"`embedding_dim` must sum to `output_dim` \(5\)"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, message):
    arguments = dict({"num_buckets": 100, "embedding_dim": 4}, **kwargs)
    with pytest.raises(error, match=message):
        MultiHashEmbedding(**arguments)


def test_ids_outside_the_range_are_refused_with_hash_input_false():
    layer = MultiHashEmbedding(100, 4, hash_input=False, name="strict")
    layer(np.array([0, 99], np.int32))
    with pytest.raises(ValueError, match=r"'strict' has hash_input=False and takes ids in "
                                         r"\[0, 100\)\. Received 1 id\(s\) outside, e\.g\. 100"):
        layer(np.array([3, 100], np.int32))
    with pytest.raises(ValueError, match=r"e\.g\. -1"):
        layer(np.array([-1], np.int32))
    # Inside jit (fit): the ValueError comes out of the compiled step.
    inputs = keras.Input((2,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Dense(1)(
        MultiHashEmbedding(100, 4, hash_input=False, combiner="sum", name="strict")(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.array([[1, 2]]), np.ones((1, 1)), verbose=0)
    with pytest.raises(Exception, match=r"ValueError: MultiHashEmbedding 'strict' has "
                                        r"hash_input=False.*e\.g\. 200"):
        model.fit(np.array([[1, 200]]), np.ones((1, 1)), verbose=0)


@pytest.mark.usefixtures("jax_32_bit_mode")  # int32 ids
def test_bad_ids_are_refused_by_name():
    with pytest.raises(ValueError, match=r"combines the last axis.*shape \(\)"):
        MultiHashEmbedding(10, 2, combiner="sum", name="mh")(np.int32(3))
    with pytest.raises(ValueError, match=r"'big' holds int32 ids .*num_buckets <= 2147483647"
                                         r".*64-bit mode.*Received: num_buckets=3000000000"):
        MultiHashEmbedding(3 * 10**9, 2, name="big")(np.array([1], np.int32))


_X64 = """
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
from keras_rec_emb.backend.jax import hashing
from keras_rec_emb.layers.multi_hash_embedding import MultiHashEmbedding
from tests._doctest_examples import assert_examples_run
from tests._multi_hash_cases import CASES, IDS, MASK64, case_id, in_range, splitmix64
ids = np.array([-(2**63), -5, 0, 7, 2**40 + 3, 2**63 - 1], np.int64)
n = 3 * 10**9
print(np.asarray(hashing.hash_to_range(ids, n)).tolist())
layer = MultiHashEmbedding(n, 2, hash_input=False)
print(np.asarray(layer.partition_indices(np.array([n - 1], np.int64))[0]).tolist())
layer(np.array([n - 1], np.int64))
"""


def test_int64_ids_hash_as_under_tensorflow_in_jaxs_64_bit_mode():
    import json
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _X64], capture_output=True, text=True,
                         env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"),
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    hashed, quotient = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
    n = 3 * 10**9
    assert hashed == [splitmix64(i & MASK64) % n
                      for i in (-(2**63), -5, 0, 7, 2**40 + 3, 2**63 - 1)]
    assert quotient == [(n - 1) // (math.isqrt(n - 1) + 1)]


def test_the_docstring_example_runs():
    assert_examples_run(MultiHashEmbedding)
