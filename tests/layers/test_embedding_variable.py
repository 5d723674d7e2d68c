"""EmbeddingVariable: shapes, combiners (vs NumPy), training/inference, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

DIM = 3
DVD = 7
MATRIX = np.arange(DVD * DIM, dtype=np.float32).reshape(DVD, DIM) / 10.0


def make_layer(matrix_initializer, **kwargs):
    opt = kre.EmbeddingVariableOption(init_option=kre.InitializerOption(default_value_dim=DVD))
    return EmbeddingVariable(DIM, initializer=matrix_initializer(MATRIX), ev_option=opt, **kwargs)


def rows(ids):
    return MATRIX[np.mod(np.asarray(ids, np.int64), DVD)]


@pytest.mark.parametrize("shape", [(5,), (4, 3), (2, 3, 2)])
def test_dense_ids_of_any_rank(matrix_initializer, shape):
    layer = make_layer(matrix_initializer)
    ids = np.random.default_rng(0).integers(0, 10**15, size=shape)
    out = layer(ids, training=True)
    assert out.shape == shape + (DIM,)
    np.testing.assert_array_equal(out.numpy(), rows(ids))
    assert len(layer.weights) == 1 and len(layer.trainable_weights) == 1
    assert layer.table_size() == len(np.unique(ids))


def numpy_combine(id_lists, combiner):
    out = np.zeros((len(id_lists), DIM), np.float32)
    for i, ids in enumerate(id_lists):
        if not ids:
            continue
        r = rows(ids).sum(axis=0)
        out[i] = {"sum": r, "mean": r / len(ids), "sqrtn": r / np.sqrt(len(ids))}[combiner]
    return out


ID_LISTS = [[3, 10**12, 3], [], [5], [8, 9]]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_ragged_and_sparse_ids_with_combiner(matrix_initializer, combiner):
    layer = make_layer(matrix_initializer, combiner=combiner)
    ragged = tf.ragged.constant(ID_LISTS, dtype=tf.int64)
    expect = numpy_combine(ID_LISTS, combiner)
    np.testing.assert_allclose(layer(ragged, training=True).numpy(), expect, rtol=1e-6)
    sparse = ragged.to_sparse()
    np.testing.assert_allclose(layer(sparse, training=True).numpy(), expect, rtol=1e-6)
    np.testing.assert_array_equal(layer(ragged, training=True).numpy()[1], np.zeros(DIM))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_dense_ids_with_combiner_reduce_last_axis(matrix_initializer, combiner):
    layer = make_layer(matrix_initializer, combiner=combiner)
    ids = np.array([[1, 2, 2], [4, 5, 6]])
    out = layer(ids, training=True).numpy()
    assert out.shape == (2, DIM)
    np.testing.assert_allclose(out, numpy_combine(ids.tolist(), combiner), rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_prune_invalid_ids_drops_padding(matrix_initializer, combiner):
    layer = make_layer(matrix_initializer, combiner=combiner, prune_invalid_ids=True)
    padded = np.array([[3, 10**12, 3], [-1, -1, -1], [5, -1, -1], [8, -7, 9]])
    kept = [[3, 10**12, 3], [], [5], [8, 9]]
    out = layer(padded, training=True).numpy()
    np.testing.assert_allclose(out, numpy_combine(kept, combiner), rtol=1e-6)
    # Padding is never a key: not inserted, not counted.
    keys = layer.export()["keys"]
    assert sorted(keys.tolist()) == [3, 5, 8, 9, 10**12]
    ragged = layer(tf.ragged.constant([[3, -1], [-2]], dtype=tf.int64), training=False).numpy()
    np.testing.assert_allclose(ragged, numpy_combine([[3], []], combiner), rtol=1e-6)


def test_prune_invalid_ids_trains_as_ragged_ids_do(matrix_initializer):
    """A model fed ids padded with -1 and `prune_invalid_ids` trains to the
    rows of one fed the same ids as ragged tensors."""
    padded = np.array([[1, 4, -1], [2, -1, -1], [4, 4, 3], [-1, -1, -1]] * 2, np.int64)
    y = np.array([[1.0], [0.0], [1.0], [0.0]] * 2, np.float32)
    exports = []
    for prune in (True, False):
        layer = make_layer(matrix_initializer, combiner="mean", prune_invalid_ids=prune)
        if prune:
            ids = keras.Input(shape=(3,), dtype="int64")
            x = padded
        else:
            ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
            x = tf.ragged.constant([[i for i in r if i >= 0] for r in padded.tolist()],
                                   dtype=tf.int64)
        dense = keras.layers.Dense(1, kernel_initializer="ones", name="head")
        model = keras.Model(ids, dense(layer(ids)))
        model.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="mse")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=2, verbose=0,
                  shuffle=False)
        data = layer.export()
        order = np.argsort(data["keys"])
        exports.append((data["keys"][order], data["values"][order], data["freqs"][order],
                        data["slots"]))
    np.testing.assert_array_equal(exports[0][0], [1, 2, 3, 4])
    np.testing.assert_array_equal(exports[0][0], exports[1][0])
    np.testing.assert_allclose(exports[0][1], exports[1][1], rtol=1e-6)
    np.testing.assert_array_equal(exports[0][2], exports[1][2])  # frequencies
    assert exports[0][3].keys() == exports[1][3].keys()
    assert not np.allclose(exports[0][1], rows([1, 2, 3, 4]))  # the rows did train


def test_ragged_without_combiner_is_ragged(matrix_initializer):
    layer = make_layer(matrix_initializer)
    out = layer(tf.ragged.constant(ID_LISTS, dtype=tf.int64), training=True)
    assert isinstance(out, tf.RaggedTensor)
    np.testing.assert_array_equal(out.row_lengths().numpy(), [3, 0, 1, 2])
    np.testing.assert_array_equal(out.flat_values.numpy(), rows(sum(ID_LISTS, [])))


def test_inference_does_not_insert_training_does(matrix_initializer):
    layer = make_layer(matrix_initializer)
    layer(np.array([1, 2]), training=True)
    out = layer(np.array([2, 3, 10**14]), training=False)
    np.testing.assert_array_equal(out.numpy(), rows([2, 3, 10**14]))
    assert layer.table_size() == 2
    layer(np.array([2, 3, 10**14]))  # no training flag: inference
    assert layer.table_size() == 2
    layer(np.array([2, 3, 10**14]), training=True)
    assert layer.table_size() == 4


def test_int32_keys_and_int32_ids_cast(matrix_initializer):
    layer = make_layer(matrix_initializer, key_dtype="int32")
    out = layer(np.array([[1, 2**30]], np.int64), training=True)
    np.testing.assert_array_equal(out.numpy(), rows([[1, 2**30]]))
    assert layer.export()["keys"].dtype == np.int32
    layer64 = make_layer(matrix_initializer)
    layer64(np.array([3], np.int32), training=True)
    assert layer64.export()["keys"].dtype == np.int64


def test_export_import(matrix_initializer):
    layer = make_layer(matrix_initializer)
    layer(np.array([4, 9]), training=True)
    data = layer.export()
    assert set(data) == {"keys", "values", "freqs", "versions", "slots", "default_values",
                         "keys_filtered", "freqs_filtered", "versions_filtered", "bloom"}
    assert len(data["keys_filtered"]) == 0 and len(data["bloom"]) == 0
    np.testing.assert_array_equal(data["default_values"], MATRIX)
    other = make_layer(matrix_initializer)
    other.build()
    data["values"] = data["values"] + 1.0
    other.import_(data)
    np.testing.assert_array_equal(other(np.array([4, 9]), training=False).numpy(),
                                  rows([4, 9]) + 1.0)


def test_not_built_errors():
    layer = EmbeddingVariable(4)
    with pytest.raises(ValueError, match="not built yet.*table_size"):
        layer.table_size()


def test_in_tf_function_and_trainable_false(matrix_initializer):
    layer = make_layer(matrix_initializer)

    @tf.function
    def f(ids):
        return layer(ids, training=True)

    np.testing.assert_array_equal(f(tf.constant([6, 7], tf.int64)).numpy(), rows([6, 7]))
    assert layer.table_size() == 2
    layer.trainable = False
    assert layer.trainable_weights == [] and not layer.table.trainable
    layer(np.array([100]), training=True)  # frozen: no insert
    assert layer.table_size() == 2


def test_sequential_and_functional_fit_from_tf_data():
    for build in ("sequential", "functional"):
        emb = EmbeddingVariable(4, combiner="sum")
        if build == "sequential":
            model = keras.Sequential([keras.Input((3,), dtype="int64"), emb, keras.layers.Dense(1)])
        else:
            ids = keras.Input((3,), dtype="int64")
            model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
        model.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="mse")
        x = np.random.default_rng(1).integers(0, 10**15, size=(32, 3))
        y = np.ones((32, 1), np.float32)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        history = model.fit(ds, epochs=4, verbose=0)
        assert emb.table_size() == len(np.unique(x))
        assert history.history["loss"][-1] < history.history["loss"][0]


def test_ragged_keras_input_functional_model():
    ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
    out = EmbeddingVariable(4, combiner="mean")(ids)
    assert out.shape == (None, 4)
    model = keras.Model(ids, keras.layers.Dense(1)(out))
    model.compile(optimizer=kre.optimizers.SGD(0.1), loss="mse")
    x = tf.ragged.constant([[1, 2], [3], [], [4, 5, 6]], dtype=tf.int64)
    model.fit(x, np.zeros((4, 1)), batch_size=2, verbose=0)
    assert model.layers[1].table_size() == 6


def test_get_config_round_trip(matrix_initializer, config_round_trip):
    opt = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption("glorot_uniform", 128, -1.0), num_shards=8)
    layer = EmbeddingVariable(6, initializer="ones", key_dtype="int32", combiner="sqrtn",
                              prune_invalid_ids=True, ev_option=opt, trainable=False, name="ev")
    clone = config_round_trip(layer, ("embedding_dim", "initializer", "key_dtype", "combiner",
                                      "prune_invalid_ids", "ev_option", "trainable", "name"))
    assert clone.ev_option == opt


@pytest.mark.parametrize("kwargs, error, match", [
    ({"embedding_dim": 0}, ValueError, "embedding_dim.*positive integer.*Received: embedding_dim=0"),
    ({"embedding_dim": -3}, ValueError, "embedding_dim=-3"),
    ({"embedding_dim": 2.5}, ValueError, "embedding_dim=2.5"),
    ({"embedding_dim": 4, "combiner": "max"}, ValueError, "combiner.*Received: combiner='max'"),
    ({"embedding_dim": 4, "key_dtype": "float32"}, ValueError, "key_dtype.*float32"),
    ({"embedding_dim": 4, "prune_invalid_ids": True}, ValueError,
     "prune_invalid_ids=True.*needs a `combiner`.*combiner=None"),
    ({"embedding_dim": 4, "combiner": "sum", "prune_invalid_ids": "yes"}, TypeError,
     "prune_invalid_ids.*bool.*'yes'"),
    ({"embedding_dim": 4, "ev_option": {"a": 1}}, ValueError, "ev_option"),
    ({"embedding_dim": 4, "ev_option": 3}, TypeError, "ev_option"),
    ({"embedding_dim": 4, "initializer": "no_such_init"}, ValueError, "no_such_init"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        EmbeddingVariable(**kwargs)


def test_file_storage_tier_needs_a_path():
    with pytest.raises(ValueError, match="storage_path.*required.*storage_path=None"):
        kre.StorageOption("FILE")


def test_bad_inputs(matrix_initializer):
    layer = make_layer(matrix_initializer)
    with pytest.raises(TypeError, match="integer ids.*float32.*Hashing"):
        layer(np.array([1.0, 2.0], np.float32))
    with pytest.raises(TypeError, match="integer ids.*string"):
        layer(tf.constant(["a"]))
    with pytest.raises(ValueError, match=r"ragged ids of shape \[batch, None\]"):
        layer(tf.ragged.constant([[[1], [2]]], dtype=tf.int64, ragged_rank=2))
    with pytest.raises(ValueError, match="needs a `combiner`.*SparseTensor"):
        layer(tf.ragged.constant([[1]], dtype=tf.int64).to_sparse())
    summing = make_layer(matrix_initializer, combiner="sum")
    with pytest.raises(ValueError, match="scalar ids"):
        summing(tf.constant(3, tf.int64))
