"""keras-rs style `TableConfig` / `FeatureConfig` under Keras's JAX backend
(the classes of keras_rec_emb/layers/configs.py): per-table optimizers
train to NumPy's numbers, and a config-built model saves and loads in every
model form."""

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import FeatureConfig, GroupEmbedding, TableConfig

rng = np.random.default_rng(3)


def _rows(layer, ids):
    """The rows `ids` read now (an inference lookup inserts nothing)."""
    return np.asarray(layer(np.asarray(ids), training=False))


def _state(group):
    """Each table's export, rows in key order."""
    out = []
    for t in group.tables:
        e = t.export()
        order = np.argsort(e["keys"])
        out.append({"keys": e["keys"][order], "values": e["values"][order],
                    **{f"slot {k}": np.asarray(v)[order] for k, v in e["slots"].items()}})
    return out


def _assert_state_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_configs_are_the_one_public_class_under_jax():
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


@keras.saving.register_keras_serializable(package="test_jax_configs")
class Chain(keras.Model):
    """A subclassed model calling its layers in turn."""

    def __init__(self, chain, **kwargs):
        super().__init__(**kwargs)
        self.chain = list(chain)

    def call(self, x):
        for layer in self.chain:
            x = layer(x)
        return x

    def get_config(self):
        return {**super().get_config(),
                "chain": [keras.saving.serialize_keras_object(c) for c in self.chain]}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["chain"] = [keras.saving.deserialize_keras_object(c) for c in config["chain"]]
        return cls(**config)


def test_configs_docstring_examples_run_under_jax():
    import doctest

    from keras_rec_emb.layers import configs

    globs = {"keras": keras, "np": np, "keras_rec_emb": kre}
    tests = [t for t in doctest.DocTestFinder().find(configs, globs=globs) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert len(tests) == 2 and result.attempted >= 6 and result.failed == 0


@pytest.mark.parametrize("form", ["functional", "subclassed", "sequential"])
def test_configs_round_trip_in_every_model_form(tmp_path, form):
    t1 = TableConfig("t1", 4, optimizer=kre.optimizers.Adagrad(0.05), combiner="mean")
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
            model = Chain(layers)
        else:
            inputs = {n: keras.Input((2,), dtype="int64", name=n) for n in x}
            model = keras.Model(inputs, layers[1](group(inputs)))
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    y = rng.random((64, 1)).astype(np.float32)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert sorted(group.tables[0].export()["slots"]) == ["accumulator"]
    assert sorted(group.tables[1].export()["slots"]) == ["momentum", "velocity"]
    assert min(len(s["keys"]) for s in _state(group)) > 30
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_group = loaded.get_layer("group") if form != "subclassed" else loaded.chain[0]
    assert [type(t.optimizer).__name__ if t.optimizer else None
            for t in loaded_group.tables] == ["Adagrad", None]
    _assert_state_equal(_state(group), _state(loaded_group))
    for m in (model, loaded):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    _assert_state_equal(_state(group), _state(loaded_group))
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
