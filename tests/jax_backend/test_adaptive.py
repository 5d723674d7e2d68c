"""AdaptiveEmbedding under Keras's JAX backend: promotion by count and by
mask, `fit` to NumPy's numbers, save/load in every model form with the
promotion state, config and bad input."""

import keras
import numpy as np
import pytest

import keras_rec_emb
from keras_rec_emb.layers.adaptive_embedding import AdaptiveEmbedding

MASK64 = (1 << 64) - 1
DIM, BUCKETS = 3, 5


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def bucket(i, n=BUCKETS):
    return splitmix64(int(i) & MASK64) % n


def layer_of(threshold=2, **kwargs):
    return AdaptiveEmbedding(DIM, BUCKETS, promote_threshold=threshold,
                             initializer="random_normal", name="adaptive", **kwargs)


def test_ids_are_promoted_at_the_threshold_with_their_static_rows():
    layer = layer_of()
    layer(np.array([7, 8, 7], np.int32), training=True)  # 7 counted twice
    static = np.asarray(layer.static_embeddings)
    state = layer.promotion_state()
    assert state["promoted_ids"].tolist() == [7] and state["promoted_freqs"].tolist() == [2]
    assert state["counting_ids"].tolist() == [8] and state["counting_freqs"].tolist() == [1]
    np.testing.assert_array_equal(layer.dynamic.export()["values"], static[[bucket(7)]])
    # Inference counts nothing: 7 reads its row, 8 and -3 their buckets.
    out = np.asarray(layer(np.array([7, 8, -3], np.int32)))
    np.testing.assert_array_equal(out, static[[bucket(7), bucket(8), bucket(-3)]])
    assert layer.promotion_state()["counting_freqs"].tolist() == [1]
    # Ids < 0 are never counted or promoted under JAX.
    layer(np.array([-3, -3, -3], np.int32), training=True)
    assert layer.promoted_ids().tolist() == [7]
    layer(np.array([8], np.int32), training=True)
    assert layer.promoted_ids().tolist() == [7, 8]


def test_a_mask_routes_ids_and_copies_the_rows_of_those_it_sends_to_the_table():
    layer = layer_of(threshold=None)
    ids = np.array([[4, 9], [4, 6]], np.int32)
    mask = np.array([[0, 1], [0, 0]])
    out = np.asarray(layer(ids, adaptive_mask=mask, training=True))
    static = np.asarray(layer.static_embeddings)
    np.testing.assert_array_equal(out, static[[[bucket(4), bucket(9)], [bucket(4), bucket(6)]]])
    assert layer.promoted_ids().tolist() == [9]  # without a threshold: by mask only
    layer(ids, training=True)
    assert layer.promoted_ids().tolist() == [9]
    # In inference a masked id without a row reads its bucket.
    out = np.asarray(layer(ids, adaptive_mask=np.ones((2, 2))))
    np.testing.assert_array_equal(out[1, 1], static[bucket(6)])


def numpy_fit(static, kernel, bias, ids, labels, threshold, lr, batch):
    """ids [n, 1] -> AdaptiveEmbedding -> Flatten -> Dense(1), MSE, SGD."""
    counts, table = {}, {}
    static = static.copy()
    for start in range(0, len(ids), batch):
        k, y = ids[start:start + batch, 0], labels[start:start + batch]
        for key in k:
            counts[key] = counts.get(key, 0) + 1
        for key in np.unique(k):
            if key not in table and counts[key] >= threshold:
                table[key] = static[bucket(key)].copy()
        rows = np.stack([table[key] if key in table else static[bucket(key)] for key in k])
        pred = rows @ kernel + bias
        d = 2.0 * (pred - y) / len(k)
        d_rows = d @ kernel.T
        kernel, bias = kernel - lr * rows.T @ d, bias - lr * d.sum(0)
        for key, g in zip(k, d_rows):
            if key in table:
                table[key] = table[key] - lr * g
            else:
                static[bucket(key)] -= lr * g
    return static, table, kernel, bias, counts


def test_fit_promotes_and_trains_both_tables_to_numpys_numbers():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 9, size=(24, 1)).astype(np.int32)
    labels = rng.normal(size=(24, 1)).astype(np.float32)
    layer = layer_of(threshold=3)
    inputs = keras.Input(shape=(1,), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer="random_normal", bias_initializer="ones")
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=keras_rec_emb.optimizers.SGD(0.1), loss="mse")
    static0 = np.asarray(layer.static_embeddings).copy()
    kernel0, bias0 = (np.asarray(w).copy() for w in dense.weights)
    model.fit(ids, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    static, table, kernel, bias, counts = numpy_fit(static0, kernel0, bias0, ids, labels, 3,
                                                    0.1, 4)
    state = layer.promotion_state()
    assert state["promoted_ids"].tolist() == sorted(table)
    assert state["promoted_freqs"].tolist() == [counts[k] for k in sorted(table)]
    e = layer.dynamic.export()
    order = np.argsort(e["keys"])
    np.testing.assert_allclose(e["values"][order], [table[k] for k in sorted(table)],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(layer.static_embeddings), static, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(dense.weights[0]), kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dense.weights[1]), bias, rtol=1e-5, atol=1e-6)


@keras.saving.register_keras_serializable(package="test_adaptive")
class Subclassed(keras.Model):
    """Its `call` takes no `training`: its layers get None in `fit`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layer_of(threshold=3, combiner="mean")
        self.dense = keras.layers.Dense(1, name="dense")

    def call(self, ids):
        return self.dense(self.embedding(ids))


def make(form):
    if form == "subclassed":
        return Subclassed()
    layers = [layer_of(threshold=3, combiner="mean"), keras.layers.Dense(1, name="dense")]
    if form == "sequential":
        return keras.Sequential([keras.Input(shape=(3,), dtype="int32"), *layers])
    inputs = keras.Input(shape=(3,), dtype="int32")
    return keras.Model(inputs, layers[1](layers[0](inputs)))


@pytest.mark.parametrize("form", ["functional", "subclassed", "sequential"])
def test_each_model_form_promotes_in_fit_only_and_saves_the_promotion_state(form, tmp_path):
    rng = np.random.default_rng(6)
    ids = rng.integers(0, 12, size=(16, 3)).astype(np.int32)
    labels = rng.normal(size=(16, 1)).astype(np.float32)
    model = make(form)
    model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    model.predict(ids, batch_size=4, verbose=0)
    model.evaluate(ids, labels, batch_size=4, verbose=0)
    layer = model.get_layer("adaptive")
    assert layer.promotion_state()["counting_ids"].size == 0  # nothing counted
    model.fit(ids, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    state = layer.promotion_state()
    keys, counts = np.unique(ids, return_counts=True)
    assert state["promoted_ids"].tolist() == keys[2 * counts >= 3].tolist()  # 2 epochs
    assert int(layer.dynamic.iterations.value) == 8
    before = model.predict(ids, batch_size=4, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    again = loaded.get_layer("adaptive")
    assert type(again) is AdaptiveEmbedding and again.get_config() == layer.get_config()
    for name, value in state.items():
        np.testing.assert_array_equal(again.promotion_state()[name], value, err_msg=name)
    np.testing.assert_array_equal(np.asarray(again.static_embeddings),
                                  np.asarray(layer.static_embeddings))
    np.testing.assert_allclose(loaded.predict(ids, batch_size=4, verbose=0), before, rtol=1e-6)


def test_the_public_name_and_config():
    assert keras_rec_emb.layers.AdaptiveEmbedding is AdaptiveEmbedding
    assert (keras.saving.get_registered_name(AdaptiveEmbedding)
            == "keras_rec_emb>AdaptiveEmbedding")
    option = keras_rec_emb.options.EmbeddingVariableOption(num_shards=4, save_filtered=False)
    layer = AdaptiveEmbedding(4, 50, promote_threshold=3, ev_option=option, combiner="sqrtn",
                              initializer=keras.initializers.Constant(0.5), name="a")
    again = AdaptiveEmbedding.from_config(layer.get_config())
    assert again.get_config() == layer.get_config()
    assert (again.promote_threshold, again.ev_option.num_shards) == (3, 4)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"embedding_dim": 0}, ValueError, r"`embedding_dim` must be a positive integer\. "
                                       r"Received: embedding_dim=0"),
    ({"promote_threshold": 0}, ValueError, r"`promote_threshold` must be None or an integer "
                                           r">= 1\. Received: promote_threshold=0"),
    ({"combiner": "max"}, ValueError, r"`combiner` must be None or one of .*combiner='max'"),
    ({"ev_option": "x"}, TypeError, r"`ev_option` must be a keras_rec_emb\."),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        AdaptiveEmbedding(**dict({"embedding_dim": 4, "hash_bucket_size": 10}, **kwargs))


def test_bad_ids_and_masks_are_refused_by_name():
    layer = layer_of(combiner="sum")
    with pytest.raises(ValueError, match=r"combines the last axis.*shape \(\)"):
        layer(np.int32(3))
    with pytest.raises(ValueError, match=r"`adaptive_mask` must have the shape of the ids "
                                         r"\(2, 2\)\. Received: adaptive_mask of shape \(2,\)"):
        layer(np.ones((2, 2), np.int32), adaptive_mask=np.ones(2))


def test_the_docstring_example_runs():
    import doctest

    test = doctest.DocTestFinder().find(
        AdaptiveEmbedding, globs={"keras": keras, "np": np, "keras_rec_emb": keras_rec_emb})[0]
    assert test.examples
    assert doctest.DocTestRunner().run(test, out=lambda text: None).failed == 0
