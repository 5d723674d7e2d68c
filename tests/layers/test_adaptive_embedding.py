"""AdaptiveEmbedding: routing, promotion (eager and in graph), masks,
gradients, saving, errors."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import AdaptiveEmbedding

DIM = 3
BUCKETS = 1000


def make(threshold=3, **kwargs):
    layer = AdaptiveEmbedding(DIM, BUCKETS, promote_threshold=threshold,
                              initializer="random_normal", **kwargs)
    layer.build()
    return layer


def static_rows(layer, ids):
    buckets = layer.static_bucket(np.asarray(ids)).numpy()
    return layer.static_embeddings.numpy()[buckets]


def ev_rows(layer, ids):
    data = layer.dynamic.export()
    where = {int(k): i for i, k in enumerate(data["keys"])}
    return np.stack([data["values"][where[int(i)]] for i in ids])


def distinct_bucket_ids(layer, n):
    """n ids whose static buckets differ (no collision in the test)."""
    ids, seen = [], set()
    for i in range(10, 10_000):
        b = int(layer.static_bucket(np.array([i])).numpy()[0])
        if b not in seen:
            seen.add(b)
            ids.append(i)
        if len(ids) == n:
            return np.array(ids, np.int64)


def test_unpromoted_ids_read_their_static_bucket():
    layer = make()
    ids = np.array([[1, 2], [10**15, -4]])
    out = layer(ids, training=True)
    assert out.shape == (2, 2, DIM)
    np.testing.assert_array_equal(out.numpy(), static_rows(layer, ids))
    np.testing.assert_array_equal(layer(ids).numpy(), static_rows(layer, ids))
    assert layer.promoted_ids().size == 0
    from keras_rec_emb.layers.multi_hash_embedding import fingerprint64
    np.testing.assert_array_equal(layer.static_bucket(ids).numpy(),
                                  fingerprint64(ids).numpy() % BUCKETS)


def test_frequencies_count_training_lookups_only():
    layer = make(threshold=3)
    layer(np.array([5, 5, 6]), training=True)
    layer(np.array([5, 6]), training=False)  # inference does not count
    state = layer.promotion_state()
    np.testing.assert_array_equal(state["counting_ids"], [5, 6])
    np.testing.assert_array_equal(state["counting_freqs"], [2, 1])
    # 5 crosses the threshold inside a batch with duplicates: exact count kept
    layer(np.array([5, 5, 7]), training=True)
    state = layer.promotion_state()
    np.testing.assert_array_equal(state["promoted_ids"], [5])
    np.testing.assert_array_equal(state["promoted_freqs"], [4])
    np.testing.assert_array_equal(state["counting_ids"], [6, 7])
    layer(np.array([5, 6]), training=True)
    state = layer.promotion_state()
    np.testing.assert_array_equal(state["promoted_freqs"], [5])
    np.testing.assert_array_equal(state["counting_freqs"], [2, 1])


def sgd_step(layer, opt, ids, mask=None):
    with tf.GradientTape() as tape:
        out = layer(ids, adaptive_mask=mask, training=True)
        loss = tf.reduce_sum(out * tf.constant([1.0, -2.0, 3.0]))
    grads = tape.gradient(loss, layer.trainable_weights)
    opt.apply(grads, layer.trainable_weights)
    return out


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_promotion_copies_the_static_row_then_trains_only_the_ev_row(graph):
    layer = make(threshold=3)
    opt = kre.optimizers.SGD(0.1)
    step = tf.function(lambda ids: sgd_step(layer, opt, ids)) if graph else (
        lambda ids: sgd_step(layer, opt, ids))
    hot, cold = distinct_bucket_ids(layer, 2)
    ids = np.array([hot, cold])
    before = static_rows(layer, ids)
    for _ in range(2):  # seen 1, 2 times: static rows learn
        out = step(ids).numpy()
    after_two = static_rows(layer, ids)
    assert np.all(np.abs(after_two - before) > 1e-4)
    assert layer.promoted_ids().size == 0
    # Third sight promotes both: they are served the copy of their static row.
    out = step(ids).numpy()
    np.testing.assert_array_equal(out, after_two)
    np.testing.assert_array_equal(layer.promoted_ids(), np.sort(ids))
    # The gradient of that step went to the EV rows, not the static ones.
    np.testing.assert_array_equal(static_rows(layer, ids), after_two)
    grad = np.array([1.0, -2.0, 3.0])
    np.testing.assert_allclose(ev_rows(layer, ids), after_two - 0.1 * grad, rtol=1e-6)
    # And from then on.
    out = step(ids).numpy()
    np.testing.assert_allclose(out, after_two - 0.1 * grad, rtol=1e-6)
    np.testing.assert_array_equal(static_rows(layer, ids), after_two)
    np.testing.assert_allclose(ev_rows(layer, ids), after_two - 0.2 * grad, rtol=1e-6)
    np.testing.assert_array_equal(layer.promotion_state()["promoted_freqs"], [4, 4])


def test_gradients_reach_the_table_that_served_each_id():
    layer = make(threshold=2)
    a, b, c = distinct_bucket_ids(layer, 3)
    layer(np.array([a, a]), training=True)  # a promoted
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(np.array([a, b, c]), training=True))
    g_static, g_ev = tape.gradient(loss, layer.trainable_weights)
    assert layer.trainable_weights[0] is layer.static_embeddings
    np.testing.assert_array_equal(np.sort(g_static.indices.numpy()),
                                  np.sort(layer.static_bucket(np.array([b, c])).numpy()))
    np.testing.assert_array_equal(g_ev.indices.numpy(), [a])


def test_explicit_mask_routes_ids():
    layer = make(threshold=None)
    opt = kre.optimizers.SGD(0.1)
    a, b, c = distinct_bucket_ids(layer, 3)
    ids = np.array([a, b, c])
    # Without a threshold nothing is promoted by frequency.
    for _ in range(3):
        layer(ids, training=True)
    assert layer.promoted_ids().size == 0
    # In inference a mask of 1 on an id without an EV row reads its static row.
    np.testing.assert_array_equal(layer(ids, adaptive_mask=np.array([1, 0, 1])).numpy(),
                                  static_rows(layer, ids))
    assert layer.promoted_ids().size == 0
    # In training it moves the id to the EV, starting from its static row.
    static_before = static_rows(layer, ids)
    out = sgd_step(layer, opt, ids, mask=np.array([1, 0, 1])).numpy()
    np.testing.assert_array_equal(out, static_before)
    np.testing.assert_array_equal(layer.promoted_ids(), np.sort([a, c]))
    after = static_rows(layer, ids)
    np.testing.assert_array_equal(after[[0, 2]], static_before[[0, 2]])
    assert np.all(after[1] != static_before[1])
    # Mask 0 serves the static row even for a promoted id; mask 1 the EV row.
    out = layer(ids, adaptive_mask=np.array([0, 0, 1])).numpy()
    np.testing.assert_array_equal(out[:2], after[:2])
    np.testing.assert_array_equal(out[2], ev_rows(layer, [c])[0])
    assert np.all(out[2] != after[2])
    # Without a mask, ids with an EV row use it.
    out = layer(ids).numpy()
    np.testing.assert_array_equal(out[[0, 2]], ev_rows(layer, [a, c]))
    np.testing.assert_array_equal(out[1], after[1])


def test_mask_with_combiner_and_ragged_ids():
    layer = AdaptiveEmbedding(DIM, BUCKETS, promote_threshold=2, combiner="sum",
                              initializer="random_normal")
    ids = tf.ragged.constant([[1, 2, 3], [4]], dtype=tf.int64)
    mask = tf.ragged.constant([[1, 0, 0], [1]], dtype=tf.int64)
    out = layer(ids, adaptive_mask=mask, training=True).numpy()
    np.testing.assert_array_equal(layer.promoted_ids(), [1, 4])
    rows = static_rows(layer, [1, 2, 3, 4])
    np.testing.assert_allclose(out, [rows[:3].sum(0), rows[3]], rtol=1e-6)
    np.testing.assert_allclose(layer(ids.to_sparse()).numpy(), out, rtol=1e-6)
    dense = layer(np.array([[1, 2, 3]]), adaptive_mask=np.array([[1, 0, 0]])).numpy()
    np.testing.assert_allclose(dense[0], out[0], rtol=1e-6)


def build_model(threshold=2, **kwargs):
    ids = keras.Input((2,), dtype="int64", name="ids")
    emb = AdaptiveEmbedding(4, 64, promote_threshold=threshold, combiner="mean",
                            name="adaptive", **kwargs)(ids)
    out = keras.layers.Dense(1, activation="sigmoid")(emb)
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    return model


def data(seed=0, rows=512):
    rng = np.random.default_rng(seed)
    x = rng.zipf(1.5, (rows, 2)) % 500
    return x, (x[:, :1] % 2).astype("float32")


def test_fit_promotes_frequent_ids_and_save_reload_keeps_state(saving_round_trip):
    model = build_model(threshold=5)
    x, y = data()
    model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    layer = model.get_layer("adaptive")
    state = layer.promotion_state()
    ids, counts = np.unique(x, return_counts=True)
    # Exact counts: ids seen >= 5 times are promoted with their frequencies.
    hot = counts * 2 >= 5
    np.testing.assert_array_equal(state["promoted_ids"], ids[hot])
    np.testing.assert_array_equal(state["promoted_freqs"], counts[hot] * 2)
    np.testing.assert_array_equal(state["counting_ids"], ids[~hot])
    np.testing.assert_array_equal(state["counting_freqs"], counts[~hot] * 2)
    # Promoted rows have trained away from the static rows.
    prom = state["promoted_ids"]
    assert np.abs(ev_rows(layer, prom) - static_rows(layer, prom)).max() > 1e-3

    probe = np.concatenate([x[:64], [[10**12, 3]]])
    loaded = saving_round_trip(model, probe, name="adaptive.keras")
    new_state = loaded.get_layer("adaptive").promotion_state()
    for key in state:
        np.testing.assert_array_equal(new_state[key], state[key])
    # Training resumes identically in both (counts carry on).
    x2, y2 = data(seed=1, rows=128)
    model.fit(x2, y2, batch_size=64, verbose=0)
    loaded.fit(x2, y2, batch_size=64, verbose=0)
    np.testing.assert_allclose(model.predict(probe, verbose=0),
                               loaded.predict(probe, verbose=0), rtol=1e-5)
    a, b = (m.get_layer("adaptive").promotion_state() for m in (model, loaded))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_fit_with_a_mask_input():
    ids = keras.Input((2,), dtype="int64")
    mask = keras.Input((2,), dtype="int32")
    emb = AdaptiveEmbedding(4, 64, combiner="sum")(ids, adaptive_mask=mask)
    model = keras.Model([ids, mask], keras.layers.Dense(1)(emb))
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    x = np.array([[1, 2], [3, 4]] * 8)
    m = np.array([[1, 0], [0, 0]] * 8)
    model.fit([x, m], np.ones((16, 1)), batch_size=4, verbose=0)
    np.testing.assert_array_equal(model.layers[2].promoted_ids(), [1])


def test_get_config_round_trip(config_round_trip):
    option = kre.EmbeddingVariableOption(evict_option=kre.GlobalStepEvict(100), num_shards=4)
    layer = AdaptiveEmbedding(8, 128, promote_threshold=4, ev_option=option, combiner="sqrtn",
                              initializer=keras.initializers.RandomNormal(seed=1), name="ad")
    clone = config_round_trip(layer, ("embedding_dim", "hash_bucket_size", "promote_threshold",
                                      "initializer", "ev_option", "combiner", "name"))
    assert clone.ev_option == option


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(promote_threshold=0), ValueError, "promote_threshold=0"),
    (dict(promote_threshold=-2), ValueError, "promote_threshold=-2"),
    (dict(promote_threshold=2.5), ValueError, "promote_threshold=2.5"),
    (dict(hash_bucket_size=0), ValueError, "hash_bucket_size=0"),
    (dict(embedding_dim=-1), ValueError, "embedding_dim=-1"),
    (dict(combiner="max"), ValueError, "combiner='max'"),
    (dict(ev_option="x"), TypeError, "ev_option='x'"),
    (dict(ev_option=kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(2))),
     ValueError, "promote_threshold.*filter_option=CounterFilter"),
    (dict(ev_option=kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=8))), ValueError, "init_option"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(embedding_dim=4, hash_bucket_size=10)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        AdaptiveEmbedding(**args)


def test_bad_inputs():
    layer = make()
    with pytest.raises(TypeError, match="integer ids"):
        layer(np.array([1.5]))
    with pytest.raises(ValueError, match="not built"):
        AdaptiveEmbedding(2, 4).promoted_ids()
    with pytest.raises(tf.errors.InvalidArgumentError, match="one entry per id"):
        layer(np.array([1, 2]), adaptive_mask=np.array([1]))
