"""keras-rs style `TableConfig` / `FeatureConfig` and per-table optimizers
(`EmbeddingVariable(optimizer=...)`), checked against NumPy, under both
backends: per-table optimizers train to NumPy's numbers, and a
config-built model saves and loads in every model form."""

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import (EmbeddingVariable, FeatureConfig, GroupEmbedding,
                                  TableConfig)
from tests._doctest_examples import assert_examples_run
from tests._model_forms import ChainModel, assert_state_equal, state

pytestmark = pytest.mark.backends("tensorflow", "jax")

rng = np.random.default_rng(3)


def _rows(layer, ids):
    """The rows `ids` read now (an inference lookup inserts nothing)."""
    return keras.ops.convert_to_numpy(layer(np.asarray(ids), training=False))


def test_configs_are_the_one_public_class():
    assert kre.layers.TableConfig is TableConfig and kre.layers.FeatureConfig is FeatureConfig
    assert TableConfig.__module__ == FeatureConfig.__module__ == "keras_rec_emb.layers.configs"
    assert keras.saving.get_registered_name(TableConfig) == "keras_rec_emb>TableConfig"
    layer = TableConfig("movie", embedding_dim=8, optimizer=kre.optimizers.Adagrad(0.1),
                        combiner="sum").make_layer()
    assert isinstance(layer, kre.layers.EmbeddingVariable) and layer.embedding_dim == 8
    assert type(layer.optimizer).__name__ == "Adagrad"
    with pytest.raises(ValueError, match="`embedding_dim` must be a positive integer.*=0"):
        TableConfig("t", 0)
    with pytest.raises(ValueError, match="`combiner` must be one of.*combiner='max'"):
        TableConfig("t", 4, combiner="max")


def test_configs_docstring_examples_run():
    from keras_rec_emb.layers import configs

    assert_examples_run(configs, tests=2, attempted=6)


def test_per_table_optimizer_and_shared_table_match_numpy():
    """Table `a` (shared by features `a1`, `a2`) has its own SGD with a
    schedule, table `b` follows the model's Adagrad. Output = sum of every
    embedding entry (a frozen all-ones Dense), MSE loss: the gradient of each
    entry of a row is the sum over its occurrences of 2 (pred - y) / B."""
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.5, 0.25])
    a = TableConfig("a", 3, optimizer=kre.optimizers.SGD(schedule), combiner="sum")
    b = TableConfig("b", 3, combiner="sum")
    feats = {"a1": FeatureConfig("a1", a), "a2": FeatureConfig("a2", a),
             "b": FeatureConfig("b", b)}
    group = GroupEmbedding(feats, output_mode="concat")
    assert [t.name for t in group.tables] == ["a", "b"]
    inputs = {n: keras.Input((2,), dtype="int64", name=n) for n in feats}
    head = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", trainable=False)
    model = keras.Model(inputs, head(group(inputs)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1, initial_accumulator_value=0.1,
                                                   epsilon=1e-7), loss="mse")
    B = 16
    x = {n: rng.integers(0, 12, (B, 2)) for n in feats}
    y = rng.random((B, 1)).astype(np.float32)
    ta, tb = group.tables
    ka, kb = np.unique(np.concatenate([x["a1"], x["a2"]])), np.unique(x["b"])
    ref_a = dict(zip(ka, _rows(ta, ka).astype(np.float64)))
    ref_b = dict(zip(kb, _rows(tb, kb).astype(np.float64)))
    acc_b = {k: np.full(3, 0.1) for k in kb}
    for step, lr_a in enumerate([0.5, 0.25]):
        pred = np.array([sum(ref_a[k].sum() for k in np.concatenate([x["a1"][i], x["a2"][i]]))
                         + sum(ref_b[k].sum() for k in x["b"][i]) for i in range(B)])
        g = 2 * (pred - y[:, 0]) / B
        grad_a, grad_b = dict.fromkeys(ka, 0.0), dict.fromkeys(kb, 0.0)
        for i in range(B):
            for k in np.concatenate([x["a1"][i], x["a2"][i]]):
                grad_a[k] += g[i]
            for k in x["b"][i]:
                grad_b[k] += g[i]
        for k in ka:
            ref_a[k] = ref_a[k] - lr_a * grad_a[k]
        for k in kb:
            acc_b[k] = acc_b[k] + grad_b[k] ** 2
            ref_b[k] = ref_b[k] - 0.1 * grad_b[k] / np.sqrt(acc_b[k] + 1e-7)
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        np.testing.assert_allclose(_rows(ta, ka), np.stack([ref_a[k] for k in ka]),
                                   rtol=1e-5, atol=1e-6, err_msg=f"table a, step {step}")
        np.testing.assert_allclose(_rows(tb, kb), np.stack([ref_b[k] for k in kb]),
                                   rtol=1e-5, atol=1e-6, err_msg=f"table b, step {step}")
    assert ta.export()["slots"] == {}  # SGD keeps no slot, and no Adagrad slot either
    e = tb.export()
    assert sorted(e["slots"]) == ["accumulator"]
    np.testing.assert_allclose(e["slots"]["accumulator"][np.argsort(e["keys"])],
                               np.stack([acc_b[k] for k in kb]), rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["adagrad", kre.optimizers.Adagrad(0.05)])
@pytest.mark.parametrize("form", ["functional", "subclassed", "sequential"])
def test_configs_round_trip_in_every_model_form(tmp_path, form, optimizer):
    t1 = TableConfig("t1", 4, optimizer=optimizer, combiner="mean")
    t2 = TableConfig("t2", 4, combiner="sum")
    feats = {"f0": FeatureConfig("f0", t1), "f1": FeatureConfig("f1", t1, output_shape=(None, 4)),
             "f2": FeatureConfig("f2", t2)}
    group = GroupEmbedding(feats, output_mode="concat", name="group")
    layers = [group, keras.layers.Dense(1)]
    if form == "sequential":  # the stacked [batch, F, L] form
        x = np.where(rng.random((64, 3, 2)) < 0.3, -1, rng.integers(0, 10**12, (64, 3, 2)))
        model = keras.Sequential(layers)
    else:
        x = {f"f{j}": rng.integers(0, 10**12, (64, 2)) for j in range(3)}
        if form == "subclassed":
            model = ChainModel(layers)
        else:
            inputs = {n: keras.Input((2,), dtype="int64", name=n) for n in x}
            out = inputs
            for layer in layers:
                out = layer(out)
            model = keras.Model(inputs, out)
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    y = rng.random((64, 1)).astype(np.float32)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert sorted(group.tables[0].export()["slots"]) == ["accumulator"]
    assert sorted(group.tables[1].export()["slots"]) == ["momentum", "velocity"]
    assert min(len(t.export()["keys"]) for t in group.tables) > 30
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_group = loaded.get_layer("group") if form != "subclassed" else loaded.chain[0]
    assert [type(t.optimizer).__name__ if t.optimizer else None
            for t in loaded_group.tables] == ["Adagrad", None]
    assert_state_equal(state(model), state(loaded))
    for m in (model, loaded):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_state_equal(state(model), state(loaded))
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))


def test_config_classes_serialize(config_round_trip):
    t = TableConfig("t", 8, vocabulary_size=1000, optimizer=kre.optimizers.Ftrl(0.2),
                    combiner="sqrtn", key_dtype="int32",
                    ev_option=kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(2)))
    f = FeatureConfig("f", t, input_shape=(None, 5), output_shape=(None, 8), weight_feature="w")
    for obj, args in ((t, ["name", "embedding_dim", "vocabulary_size", "initializer",
                           "optimizer", "combiner", "key_dtype", "ev_option"]),
                      (f, ["name", "table", "input_shape", "output_shape", "weight_feature"])):
        config = obj.get_config()
        assert [a for a in args if a not in config] == []
        clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(obj))
        assert type(clone) is type(obj) and clone.get_config() == config
    layer = t.make_layer()
    assert type(layer.table_optimizer).__name__ == "Ftrl"
    assert layer.table_optimizer.get_config()["learning_rate"] == pytest.approx(0.2)
    config_round_trip(EmbeddingVariable(4, optimizer="adam"), ["optimizer"])


def test_kerass_namesake_is_taken_as_ours_with_its_config():
    layer = TableConfig("t", 4, optimizer=keras.optimizers.Adam(0.2, beta_1=0.5)).make_layer()
    assert type(layer.table_optimizer) is kre.optimizers.Adam
    config = layer.table_optimizer.get_config()
    assert (config["learning_rate"], config["beta_1"]) == (pytest.approx(0.2), 0.5)


def test_table_optimizer_is_a_copy_per_table():
    """One optimizer given to two layers: each trains with a copy of its
    own, so a rate set on one layer's optimizer (0: table `a` stays as it
    is) leaves the other's, and the one given, as they are. Both tables read
    the same ids; loss = mean((sum of both rows - y)**2), so table `b`'s row
    of id k moves by 0.3 * 2 (pred_k - y_k) / B per entry."""
    opt = kre.optimizers.SGD(0.3)
    a = EmbeddingVariable(2, combiner="sum", optimizer=opt, name="a")
    b = EmbeddingVariable(2, combiner="sum", optimizer=opt, name="b")
    assert a.table_optimizer is not opt and a.table_optimizer is not b.table_optimizer
    assert not opt.built
    a.optimizer.learning_rate = 0.0
    assert float(b.optimizer.learning_rate) == float(opt.learning_rate) == pytest.approx(0.3)
    ids = keras.Input((1,), dtype="int64")
    total = keras.layers.Add()([a(ids), b(ids)])
    model = keras.Model(ids, keras.layers.Lambda(
        lambda x: keras.ops.sum(x, axis=-1, keepdims=True))(total))
    # The compiled optimizer trains nothing here (both tables have their own).
    model.compile(optimizer=kre.optimizers.SGD(0.0), loss="mse")
    x = np.array([[1], [2], [3], [4]], np.int64)
    y = np.array([[1.0], [-1.0], [0.5], [2.0]], np.float32)
    before_a, before_b = _rows(a, x), _rows(b, x)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    pred = (before_a + before_b).sum(axis=-1, keepdims=True)
    want_b = before_b - 0.3 * 2.0 * (pred - y) / 2
    np.testing.assert_allclose(_rows(a, x), before_a, rtol=0, atol=0)
    np.testing.assert_allclose(_rows(b, x), want_b, rtol=1e-6, atol=1e-6)
    assert float(opt.learning_rate) == pytest.approx(0.3)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"embedding_dim": 0}, ValueError, "embedding_dim"),
    ({"embedding_dim": 4, "vocabulary_size": -3}, ValueError, "vocabulary_size"),
    ({"embedding_dim": 4, "combiner": "max"}, ValueError, "combiner"),
    ({"embedding_dim": 4, "combiner": None}, ValueError, "combiner"),
    ({"embedding_dim": 4, "optimizer": "rmsprop"}, ValueError, "optimizer.*rmsprop"),
    ({"embedding_dim": 4, "optimizer": keras.optimizers.RMSprop()}, TypeError, "optimizer"),
    ({"embedding_dim": 4, "optimizer": kre.optimizers.SGD(0.1, clipnorm=1.0)}, ValueError,
     "clipnorm"),
    ({"embedding_dim": 4, "optimizer": kre.optimizers.LossScaleOptimizer(
        kre.optimizers.SGD(0.1))}, TypeError, "optimizer"),
    ({"embedding_dim": 4, "key_dtype": "float32"}, ValueError, "key_dtype"),
])
def test_table_config_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        TableConfig("t", **kwargs)


def test_feature_config_bad_input():
    t = TableConfig("t", 4)
    with pytest.raises(TypeError, match="`table` must be a TableConfig"):
        FeatureConfig("f", {"embedding_dim": 4, "bad": 1} and 3)
    with pytest.raises(ValueError, match="output_shape.*embedding_dim 4"):
        FeatureConfig("f", t, output_shape=(None, 8))
    with pytest.raises(TypeError, match="input_shape"):
        FeatureConfig("f", t, input_shape=(None, -1))
    with pytest.raises(TypeError, match="`name`"):
        FeatureConfig("", t)
    other = TableConfig("t", 8)
    with pytest.raises(ValueError, match="Two different TableConfigs are named 't'"):
        GroupEmbedding({"a": FeatureConfig("a", t), "b": FeatureConfig("b", other)})
    # Equal configs under one name are one table.
    group = GroupEmbedding({"a": FeatureConfig("a", t),
                            "b": FeatureConfig("b", TableConfig("t", 4))})
    assert len(group.tables) == 1
