"""GroupEmbedding: outputs vs separate layers, input forms, training with our
optimizers, config and model saving round-trips, errors."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding

DVD = 7


def ev(matrix_initializer, dim, seed, **kwargs):
    matrix = np.random.default_rng(seed).normal(size=(DVD, dim)).astype(np.float32)
    opt = kre.EmbeddingVariableOption(init_option=kre.InitializerOption(default_value_dim=DVD))
    return EmbeddingVariable(dim, initializer=matrix_initializer(matrix), ev_option=opt, **kwargs)


def test_outputs_equal_separate_layers(matrix_initializer):
    user = ev(matrix_initializer, 4, 0)
    item = ev(matrix_initializer, 3, 1)
    cat = keras.layers.Embedding(50, 2)
    group = GroupEmbedding({
        "user": FeatureSpec(user),
        "items": FeatureSpec(item, combiner="mean"),
        "clicked": FeatureSpec(item, combiner="sqrtn"),  # shares `item`
        "cat": FeatureSpec(cat),
    })
    rng = np.random.default_rng(0)
    x = {"user": rng.integers(0, 10**12, 8),
         "items": tf.ragged.constant([[1, 2], [3], [], [4, 4, 5], [6], [7], [8], [9]],
                                     dtype=tf.int64),
         "clicked": rng.integers(0, 100, (8, 3)),
         "cat": rng.integers(0, 50, (8, 1))}
    out = group(x, training=True)
    assert set(out) == {"user", "items", "clicked", "cat"}
    assert len(group.tables) == 3 and len(group.trainable_weights) == 3
    np.testing.assert_allclose(out["user"].numpy(), user(x["user"]).numpy(), rtol=1e-6)
    items = tf.stack([tf.reduce_mean(item(tf.constant(r, tf.int64)), 0) if r else tf.zeros(3)
                      for r in x["items"].to_list()])
    np.testing.assert_allclose(out["items"].numpy(), items.numpy(), rtol=1e-5, atol=1e-6)
    clicked = tf.reduce_sum(item(x["clicked"]), 1) / np.sqrt(3.0)
    np.testing.assert_allclose(out["clicked"].numpy(), clicked.numpy(), rtol=1e-5)
    np.testing.assert_allclose(out["cat"].numpy(), cat(x["cat"])[:, 0].numpy(), rtol=1e-6)

    concat = GroupEmbedding({"user": FeatureSpec(user), "cat": FeatureSpec(cat)},
                            output_mode="concat")
    c = concat({"user": x["user"], "cat": x["cat"]})
    assert c.shape == (8, 6)
    np.testing.assert_allclose(c.numpy(), np.concatenate(
        [out["user"].numpy(), out["cat"].numpy()], 1), rtol=1e-6)


def test_weights_padding_sequence_and_default(matrix_initializer):
    table = ev(matrix_initializer, 2, 3)
    group = GroupEmbedding({
        "a": FeatureSpec(table, combiner="mean", weight_feature="a_w", default_id=0),
        "s": FeatureSpec(table, sequence=True),
    })
    a = np.array([[1, 2, -1], [-1, -1, -1]])
    a_w = np.array([[1.0, 3.0, 9.0], [1.0, 1.0, 1.0]], np.float32)
    s = tf.ragged.constant([[5, 6, 7], [8]], dtype=tf.int64)
    out = group({"a": a, "a_w": a_w, "s": s})
    rows = table(np.array([1, 2, 0])).numpy()
    np.testing.assert_allclose(out["a"].numpy()[0], (rows[0] + 3 * rows[1]) / 4, rtol=1e-5)
    np.testing.assert_allclose(out["a"].numpy()[1], rows[2], rtol=1e-6)
    assert out["s"].shape == (2, 3, 2)
    np.testing.assert_allclose(out["s"].numpy(), s.with_values(table(s.values)).to_tensor().numpy())


def test_one_embedding_input_forms(matrix_initializer):
    t0, t1 = ev(matrix_initializer, 2, 0), ev(matrix_initializer, 2, 1)
    group = GroupEmbedding({"f0": FeatureSpec(t0), "f1": FeatureSpec(t1)})
    ids = np.array([[3, 4], [5, 6]])
    out = group(ids)
    np.testing.assert_allclose(out["f0"].numpy(), t0(ids[:, 0]).numpy())
    np.testing.assert_allclose(out["f1"].numpy(), t1(ids[:, 1]).numpy())
    flat = np.array([[3, 9, 4], [5, 6, 6]])
    table_ids = np.array([[0, 0, 1], [0, 1, 1]])
    out = group((flat, table_ids))
    np.testing.assert_allclose(out["f0"].numpy(), (t0(np.array([[3, 9], [5, 5]])).numpy()
                                                   * np.array([[[1], [1]], [[1], [0]]])).sum(1),
                               rtol=1e-6)
    np.testing.assert_allclose(out["f1"].numpy(), np.stack(
        [t1(np.array([4])).numpy()[0], 2 * t1(np.array([6])).numpy()[0]]), rtol=1e-6)


def test_config_round_trip_keeps_sharing():
    shared = EmbeddingVariable(4, name="shared")
    group = GroupEmbedding({
        "a": FeatureSpec(shared),
        "b": FeatureSpec(shared, combiner="mean", max_norm=1.0, default_id=3),
        "c": FeatureSpec({"input_dim": 10, "output_dim": 2}, weight_feature="c_w"),
    }, name="g")
    config = group.get_config()
    assert set(config) >= {"features", "output_mode", "tables", "name"}
    assert config["features"]["a"]["table"] == config["features"]["b"]["table"] == 0
    clone = GroupEmbedding.from_config(config)
    assert len(clone.tables) == 2
    assert isinstance(clone.tables[1], keras.layers.Embedding)
    assert clone.get_config() == config
    spec = FeatureSpec({"embedding_dim": 3}, combiner="sqrtn", sequence=True)
    assert FeatureSpec.from_config(spec.get_config()).get_config() == spec.get_config()
    ser = keras.saving.serialize_keras_object(spec)
    assert keras.saving.deserialize_keras_object(ser).get_config() == spec.get_config()


def _model():
    user = EmbeddingVariable(4, name="user_table")
    group = GroupEmbedding({
        "user": FeatureSpec(user),
        "hist": FeatureSpec(user, combiner="mean"),
        "cat": FeatureSpec({"input_dim": 20, "output_dim": 3}),
        "tag": FeatureSpec({"embedding_dim": 2}, combiner="sqrtn"),
    }, output_mode="concat")
    inputs = {"user": keras.Input((), dtype="int64", name="user"),
              "hist": keras.Input((4,), dtype="int64", name="hist"),
              "cat": keras.Input((1,), dtype="int64", name="cat"),
              "tag": keras.Input((2,), dtype="int64", name="tag")}
    out = keras.layers.Dense(1, activation="sigmoid")(group(inputs))
    return keras.Model(inputs, out)


def _data(n=64):
    rng = np.random.default_rng(1)
    x = {"user": rng.integers(0, 10**10, n), "hist": rng.integers(-1, 10**10, (n, 4)),
         "cat": rng.integers(0, 20, (n, 1)), "tag": rng.integers(-1, 30, (n, 2))}
    return x, rng.integers(0, 2, (n, 1)).astype("float32")


def test_fit_save_and_reload(saving_round_trip):
    model = _model()
    model.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    x, y = _data()
    before = model.predict(x, verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    after = model.predict(x, verbose=0)
    assert not np.allclose(before, after)
    group = model.layers[-2] if isinstance(model.layers[-2], GroupEmbedding) else next(
        layer for layer in model.layers if isinstance(layer, GroupEmbedding))
    assert group.tables[0].table_size() > 64  # users and history ids inserted
    loaded = saving_round_trip(model)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), after, rtol=1e-6, atol=1e-7)
    lgroup = next(layer for layer in loaded.layers if isinstance(layer, GroupEmbedding))
    a, b = group.tables[0].export(), lgroup.tables[0].export()
    oa, ob = np.argsort(a["keys"]), np.argsort(b["keys"])
    np.testing.assert_array_equal(a["keys"][oa], b["keys"][ob])
    np.testing.assert_array_equal(a["values"][oa], b["values"][ob])
    # The reloaded model trains on.
    loaded.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_bad_arguments():
    t = EmbeddingVariable(2)
    with pytest.raises(ValueError, match="output_mode='stack'"):
        GroupEmbedding({"a": FeatureSpec(t)}, output_mode="stack")
    with pytest.raises(ValueError, match="combiner='max'"):
        FeatureSpec(t, combiner="max")
    with pytest.raises(ValueError, match="features"):
        GroupEmbedding({})
    with pytest.raises(TypeError, match="table="):
        FeatureSpec("user")
    with pytest.raises(ValueError, match="Sequence feature 'a'"):
        GroupEmbedding({"a": FeatureSpec(t, sequence=True)}, output_mode="concat")
    with pytest.raises(ValueError, match="embedding_dim"):
        GroupEmbedding({"a": FeatureSpec({"dim": 3})})
    group = GroupEmbedding({"a": FeatureSpec(t), "b": FeatureSpec(t, weight_feature="w")})
    with pytest.raises(ValueError, match="missing inputs \\['b', 'w'\\]"):
        group({"a": np.array([1])})
    with pytest.raises(TypeError, match="float32"):
        group({"a": np.array([1.5], np.float32), "b": np.array([1]), "w": np.array([1.0])})
