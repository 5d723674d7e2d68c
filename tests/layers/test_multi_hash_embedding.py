"""MultiHashEmbedding: partition math (vs NumPy), complementarity, memory,
hashing, gradients, saving, errors."""

import math

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import MultiHashEmbedding
from keras_rec_emb.layers import multi_hash_embedding as mh_module
from tests._multi_hash_cases import MASK64, CASES, IDS, case_id, numpy_embed, splitmix64

# The tests marked `both` run under both backends (the JAX-only ones are in
# tests/jax_backend/test_multi_hash.py); the others use TensorFlow's ragged
# and sparse ids, tapes and errors.
both = pytest.mark.backends("tensorflow", "jax")


@both
@pytest.mark.parametrize("kwargs", CASES, ids=case_id)
def test_rows_are_numpys_for_every_strategy_and_operation(kwargs):
    layer = MultiHashEmbedding(100, initializer="random_normal", **kwargs)
    for ids in (np.random.default_rng(0).integers(0, 100, size=(6, 3)), IDS):
        out = layer(ids)
        assert out.shape == (*ids.shape, layer.output_width)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(out), numpy_embed(layer, ids),
                                   rtol=1e-6)


@both
def test_qr_table_shapes_and_names():
    layer = MultiHashEmbedding(10, 4)
    layer.build()
    assert [tuple(w.shape) for w in layer.weights] == [(3, 4), (4, 4)]  # ceil(10/4), 4
    assert [w.name for w in layer.weights] == ["quotient_embeddings", "remainder_embeddings"]
    layer = MultiHashEmbedding(10, 4, m=3)
    layer.build()
    assert layer.partition_sizes == [4, 3]
    layer = MultiHashEmbedding(630, 2, complementary_strategy="CRT", moduli=[7, 9, 10])
    layer.build()
    assert [tuple(w.shape) for w in layer.weights] == [(7, 2), (9, 2), (10, 2)]
    assert [w.name for w in layer.weights] == [f"partition_{j}_embeddings" for j in range(3)]


@both
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiners_reduce_the_last_axis_like_numpy(combiner):
    layer = MultiHashEmbedding(50, 3, combiner=combiner, initializer="random_normal")
    ids = np.array([[[1, 2, 49], [7, -3, 0]]], np.int32)  # [1, 2, 3]
    out = layer(ids)
    assert out.shape == (1, 2, 3)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(out), numpy_embed(layer, ids, combiner),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer(np.zeros((2, 0), np.int32))),
                                  0)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiners_on_dense_ragged_and_sparse_ids(combiner):
    import tensorflow as tf

    layer = MultiHashEmbedding(50, 3, combiner=combiner, initializer="random_normal")
    lists = [[1, 2, 49], [], [7]]
    ragged = tf.ragged.constant(lists, dtype=tf.int64)
    out = layer(ragged).numpy()
    for row, ids in zip(out, lists):
        if not ids:
            np.testing.assert_array_equal(row, 0)
            continue
        r = numpy_embed(layer, ids).sum(axis=0)
        expect = {"sum": r, "mean": r / len(ids), "sqrtn": r / np.sqrt(len(ids))}[combiner]
        np.testing.assert_allclose(row, expect, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(layer(ragged.to_sparse()).numpy(), out, rtol=1e-6)
    dense = layer(np.array([[1, 2, 49]])).numpy()
    np.testing.assert_allclose(dense[0], out[0], rtol=1e-6)


def test_ragged_without_combiner_stays_ragged():
    import tensorflow as tf

    layer = MultiHashEmbedding(50, 3)
    out = layer(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64))
    assert isinstance(out, tf.RaggedTensor)
    assert out.flat_values.shape == (3, 3)


# -- complementarity -------------------------------------------------------------

PARTITIONINGS = [
    (3000, dict(complementary_strategy="Q-R")),
    (3001, dict(complementary_strategy="Q-R", m=17)),
    (2500, dict(complementary_strategy="generalized_QR", num_partitions=3)),
    (4096, dict(complementary_strategy="generalized_QR", num_partitions=4)),
    (1000, dict(complementary_strategy="generalized_QR", moduli=[3, 7, 50])),
    (3000, dict(complementary_strategy="CRT")),
    (3000, dict(complementary_strategy="CRT", num_partitions=3)),
    (630, dict(complementary_strategy="CRT", moduli=[7, 9, 10])),
]


@both
@pytest.mark.parametrize("n,kwargs", PARTITIONINGS, ids=lambda x: str(x))
def test_partitions_are_complementary(n, kwargs):
    """Exhaustively: no two ids in [0, n) share every partition index."""
    layer = MultiHashEmbedding(n, 2, **kwargs)
    ids = np.arange(n, dtype=np.int64)
    idx = np.stack([keras.ops.convert_to_numpy(i) for i in layer.partition_indices(ids)], axis=1)
    for j, rows in enumerate(layer.partition_sizes):
        assert idx[:, j].min() >= 0 and idx[:, j].max() < rows
    assert len({tuple(r) for r in idx}) == n
    assert math.prod(layer.partition_sizes) >= n
    if kwargs["complementary_strategy"] == "CRT":
        sizes = layer.partition_sizes
        assert all(math.gcd(a, b) == 1 for i, a in enumerate(sizes) for b in sizes[i + 1:])
    # and so every id has its own embedding
    out = keras.ops.convert_to_numpy(
        MultiHashEmbedding(n, 4, initializer="random_normal", **kwargs)(ids))
    assert len(np.unique(out.round(6), axis=0)) == n


def test_memory_is_sqrt_n_rows():
    n = 10**6
    layer = MultiHashEmbedding(n, 16)
    layer.build()
    rows = sum(layer.partition_sizes)
    assert rows == 2000
    assert layer.count_params() == 2000 * 16  # vs 16_000_000 for a full table
    for k in (3, 4):
        layer = MultiHashEmbedding(n, 16, complementary_strategy="generalized_QR",
                                   num_partitions=k)
        assert sum(layer.partition_sizes) <= k * math.ceil(n ** (1 / k)) + 1
    layer = MultiHashEmbedding(n, 16, complementary_strategy="CRT")
    assert sum(layer.partition_sizes) <= 2 * math.isqrt(n) + 3


# -- hashing ---------------------------------------------------------------------

def test_fingerprint_is_the_documented_formula():
    import tensorflow as tf

    ids = [0, 1, -1, -5, 2**40 + 3, 2**63 - 1, -(2**63)]
    got = mh_module.fingerprint64(tf.constant(ids, tf.int64)).numpy().tolist()
    assert got == [splitmix64(i & MASK64) for i in ids]
    assert got[:2] == [16294208416658607535, 10451216379200822465]  # golden
    got32 = mh_module.fingerprint64(tf.constant([-5, 7], tf.int32)).numpy().tolist()
    assert got32 == [got[3], splitmix64(7)]


def test_out_of_range_ids_are_hashed_into_range():
    n = 1000
    layer = MultiHashEmbedding(n, 4, initializer="random_normal")
    ids = np.array([-7, 1000, 10**15, 5], np.int64)
    expect_ids = [splitmix64(int(i) & MASK64) % n for i in ids[:3]] + [5]
    np.testing.assert_allclose(layer(ids).numpy(), numpy_embed(layer, expect_ids), rtol=1e-6)
    np.testing.assert_array_equal(layer(ids[:2].astype(np.int32)).numpy(),
                                  layer(ids[:2]).numpy())


def test_hash_input_false_rejects_out_of_range_ids_eagerly_and_in_fit():
    import tensorflow as tf

    layer = MultiHashEmbedding(100, 4, hash_input=False)
    layer(np.array([0, 99]))
    with pytest.raises(ValueError, match=r"hash_input=False.*\[0, 100\).*e.g. 100"):
        layer(np.array([3, 100]))
    with pytest.raises(ValueError, match="e.g. -1"):
        layer(np.array([-1]))
    inputs = keras.Input((2,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(
        MultiHashEmbedding(100, 4, hash_input=False, combiner="sum")(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.array([[1, 2]]), np.ones((1, 1)), verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="hash_input=False"):
        model.fit(np.array([[1, 200]]), np.ones((1, 1)), verbose=0)


def test_non_integer_ids_are_a_type_error():
    with pytest.raises(TypeError, match="integer ids"):
        MultiHashEmbedding(10, 2)(np.array([1.0]))


# -- training --------------------------------------------------------------------

def test_gradients_reach_the_rows_of_each_table():
    import tensorflow as tf

    layer = MultiHashEmbedding(100, [2, 3], m=10, operation="concat")
    ids = np.array([[12, 47]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids))
    grads = tape.gradient(loss, layer.trainable_weights)
    assert len(grads) == 2
    q, r = (tf.convert_to_tensor(g).numpy() for g in grads)
    assert set(np.nonzero(q.any(axis=1))[0]) == {1, 4}  # 12 // 10, 47 // 10
    assert set(np.nonzero(r.any(axis=1))[0]) == {2, 7}  # 12 % 10, 47 % 10
    assert isinstance(grads[0], tf.IndexedSlices)


@pytest.mark.parametrize("optimizer", ["adam", "kre_adagrad"])
def test_fit_learns_with_any_optimizer(optimizer):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 400, (512, 1))
    y = (x % 2).astype("float32")
    inputs = keras.Input((1,), dtype="int64")
    emb = MultiHashEmbedding(400, 8, combiner="sum")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(emb))
    opt = keras.optimizers.Adam(0.05) if optimizer == "adam" else kre.optimizers.Adagrad(0.3)
    model.compile(optimizer=opt, loss="binary_crossentropy", metrics=["accuracy"])
    hist = model.fit(x, y, epochs=8, batch_size=64, verbose=0)
    assert hist.history["accuracy"][-1] > 0.9


# -- saving ----------------------------------------------------------------------

def test_get_config_round_trip(config_round_trip):
    layer = MultiHashEmbedding(5000, [4, 2, 2], complementary_strategy="CRT",
                               operation="concat", moduli=[17, 18, 19], combiner="mean",
                               hash_input=False, output_dim=8, name="mh",
                               initializer=keras.initializers.RandomNormal(seed=3))
    clone = config_round_trip(layer, ("num_buckets", "embedding_dim", "complementary_strategy",
                                      "operation", "initializer", "combiner", "m",
                                      "num_partitions", "moduli", "hash_input", "output_dim",
                                      "name"))
    assert clone.partition_sizes == [17, 18, 19]


def test_model_save_and_load(saving_round_trip):
    inputs = keras.Input((3,), dtype="int64")
    emb = MultiHashEmbedding(10**5, 4, complementary_strategy="generalized_QR",
                             num_partitions=3, operation="mult", combiner="sqrtn",
                             initializer=keras.initializers.RandomNormal(1.0, 0.1))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(emb))
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    x = np.random.default_rng(2).integers(-10**6, 10**6, (64, 3))
    model.fit(x, np.ones((64, 1)), verbose=0)
    loaded = saving_round_trip(model, x, name="mh.keras")
    assert isinstance(loaded.layers[1], MultiHashEmbedding)


# -- errors ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_buckets=0, embedding_dim=4), ValueError, "num_buckets=0"),
    (dict(num_buckets=-3, embedding_dim=4), ValueError, "num_buckets=-3"),
    (dict(num_buckets=10, embedding_dim=0), ValueError, "embedding_dim=0"),
    (dict(num_buckets=10, embedding_dim=4, complementary_strategy="QR"), ValueError,
     "complementary_strategy='QR'"),
    (dict(num_buckets=10, embedding_dim=4, operation="max"), ValueError, "operation='max'"),
    (dict(num_buckets=10, embedding_dim=[2, 2], operation="concat", output_dim=5), ValueError,
     r"sum to `output_dim` \(5\).*embedding_dim=\[2, 2\]"),
    (dict(num_buckets=10, embedding_dim=[2, 2, 2], operation="concat"), ValueError,
     "list of 2 widths.*embedding_dim=\\[2, 2, 2\\]"),
    (dict(num_buckets=10, embedding_dim=4, operation="concat"), ValueError,
     "embedding_dim=4"),
    (dict(num_buckets=10, embedding_dim=[2, 3]), ValueError, r"embedding_dim=\[2, 3\]"),
    (dict(num_buckets=10, embedding_dim=4, complementary_strategy="CRT", moduli=[4, 6]),
     ValueError, "pairwise coprime.*4 and 6.*moduli=\\[4, 6\\]"),
    (dict(num_buckets=100, embedding_dim=4, complementary_strategy="CRT", moduli=[7, 9]),
     ValueError, "at least `num_buckets`.*moduli=\\[7, 9\\]"),
    (dict(num_buckets=10, embedding_dim=4, num_partitions=3), ValueError,
     "num_partitions=3"),
    (dict(num_buckets=10, embedding_dim=4, complementary_strategy="CRT", num_partitions=1),
     ValueError, "num_partitions=1"),
    (dict(num_buckets=10, embedding_dim=4, complementary_strategy="CRT", m=3), ValueError,
     "m=3"),
    (dict(num_buckets=10, embedding_dim=4, m=0), ValueError, "m=0"),
    (dict(num_buckets=10, embedding_dim=4, moduli=[3, 4]), ValueError, "moduli=\\[3, 4\\]"),
    (dict(num_buckets=10, embedding_dim=4, complementary_strategy="generalized_QR",
          moduli=[3, 4], num_partitions=3), ValueError, "num_partitions"),
    (dict(num_buckets=10, embedding_dim=4, combiner="max"), ValueError, "combiner='max'"),
    (dict(num_buckets=10, embedding_dim=4, hash_input="yes"), TypeError, "hash_input='yes'"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiHashEmbedding(**kwargs)
