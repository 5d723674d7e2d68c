"""GroupEmbedding and FeatureSpec under Keras's JAX backend: the dict and
stacked forms pool padded ids to NumPy's numbers, a table shared by two
features gets one update per step with its ids' summed gradient, the model
forms fit and save, and what JAX lacks is refused."""

import doctest

import jax
import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.backend.jax import group_embedding, optimizers
from keras_rec_emb.backend.jax.group_embedding import FeatureSpec, GroupEmbedding
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

DIM, DVD = 3, 5
# [batch, F=2, L=3], padded with -1; row 1 of feature 0 has no id.
STACKED = np.array([[[1, 4, -1], [4, 4, 2]],
                    [[-1, -1, -1], [0, -1, 3]],
                    [[2, 2, 2], [1, -1, -1]],
                    [[5, 0, -1], [5, 1, 0]]], np.int32)


def table(name="shared"):
    return EmbeddingVariable(DIM, default_value_dim=DVD, name=name,
                             initializer=keras.initializers.RandomUniform(seed=2))


def numpy_pool(rows, ids, combiner):
    """rows [B, L, DIM] of ids [B, L] -> [B, DIM]; ids < 0 weigh 0."""
    keep = ids >= 0
    total = (rows * keep[..., None]).sum(1)
    count = np.maximum(keep.sum(1, keepdims=True), 1)
    return {"sum": total, "mean": total / count, "sqrtn": total / np.sqrt(count)}[combiner]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_dict_and_stacked_forms_pool_padded_ids_like_numpy(combiner):
    shared, other = table(), table("other")
    group = GroupEmbedding({"a": FeatureSpec(shared, combiner),
                            "b": FeatureSpec(shared, "sum"),
                            "c": FeatureSpec(other, combiner)}, output_mode="dict")
    ids = np.concatenate([STACKED, STACKED[:, :1] + 1], axis=1)  # c: a's ids + 1 (-1 -> 0)
    got = group({"a": ids[:, 0], "b": ids[:, 1], "c": ids[:, 2]})  # builds the tables
    want = {n: numpy_pool(t.default_values[ids[:, j] % DVD], ids[:, j], c)
            for j, (n, t, c) in enumerate((("a", shared, combiner), ("b", shared, "sum"),
                                           ("c", other, combiner)))}
    assert sorted(got) == ["a", "b", "c"]
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-6, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got["a"])[1], np.zeros(DIM))  # no id: zeros
    concat = GroupEmbedding(group.get_config()["features"], output_mode="concat",
                            tables=group.tables)
    np.testing.assert_allclose(np.asarray(concat(ids)),
                               np.concatenate([want[n] for n in "abc"], axis=1), rtol=1e-6)
    # [batch] ids and [batch, F] stacked ids: one id per row.
    single = np.asarray(GroupEmbedding({"a": FeatureSpec(shared, combiner)})(
        {"a": ids[:, 1, 0]})["a"])
    np.testing.assert_allclose(single, shared.default_values[ids[:, 1, 0] % DVD], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(concat(ids[:, :, 1])),
                               np.concatenate([t.default_values[ids[:, j, 1] % DVD]
                                               for j, t in enumerate((shared, shared, other))],
                                              axis=1) * (ids[:, :, 1:2] >= 0).repeat(DIM, 2)
                               .reshape(len(ids), -1), rtol=1e-6)
    assert shared.table_size() == other.table_size() == 0  # inference inserts nothing


def _table_calls(fn, *args):
    """The targets of the table calls fn traces, inner jaxprs included."""
    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "kre_table_call":
                yield e.params["target"]
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)
    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_inference_lookup_is_one_table_call_with_the_per_table_numbers():
    # training=False (or tables not trainable): every feature in one call,
    # features of other lengths, weighted and not, shared tables; the
    # numbers of the per-table pooled lookups (training=None, not
    # differentiated) and of NumPy.
    shared, other = table(), table("other")
    group = GroupEmbedding({"a": FeatureSpec(shared, "mean", weight_feature="wa"),
                            "b": FeatureSpec(shared, "sum"),
                            "c": FeatureSpec(other, "sqrtn")}, output_mode="dict")
    wa = np.array([[0.5, 2.0, 1.0], [1.0, 1.0, 1.0], [0.0, -1.0, 3.0], [1.0, 0.25, 9.0]],
                  np.float32)
    inputs = {"a": STACKED[:, 0], "wa": wa, "b": STACKED[:, 1, :2], "c": STACKED[:, 0, 0]}
    per_table = group(inputs)
    assert _table_calls(lambda x: group(x), inputs) == [
        "kre_table_pooled_lookup", "kre_table_pooled_lookup", "kre_table_lookup"]
    assert _table_calls(lambda x: group(x, training=False), inputs) == [
        "kre_group_pooled_lookup"]
    got = jax.jit(lambda x: group(x, training=False))(inputs)
    keep = (STACKED[:, 0] >= 0) & (wa > 0)  # mean: weights <= 0 dropped
    w = np.where(keep, wa, 0)
    rows_a = shared.default_values[STACKED[:, 0] % DVD]
    want = {"a": (rows_a * w[..., None]).sum(1) / np.maximum(w.sum(1), 1e-30)[:, None]
            * (w.sum(1) > 0)[:, None],
            "b": numpy_pool(shared.default_values[STACKED[:, 1, :2] % DVD], STACKED[:, 1, :2],
                            "sum"),
            "c": other.default_values[STACKED[:, 0, 0] % DVD] * (STACKED[:, 0, 0:1] >= 0)}
    for name in "abc":
        np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(per_table[name]),
                                   rtol=1e-6, err_msg=name)
    # The stacked form, concatenated; and tables not trainable under training=None.
    stacked = GroupEmbedding({"a": FeatureSpec(shared, "mean"), "b": FeatureSpec(other, "sum")},
                             output_mode="concat")
    want = np.concatenate([numpy_pool(t.default_values[STACKED[:, j] % DVD], STACKED[:, j], c)
                           for j, (t, c) in enumerate(((shared, "mean"), (other, "sum")))], 1)
    np.testing.assert_allclose(np.asarray(stacked(STACKED, training=False)), want, rtol=1e-6)
    shared.trainable = other.trainable = False
    assert _table_calls(lambda x: stacked(x), STACKED) == ["kre_group_pooled_lookup"]
    np.testing.assert_allclose(np.asarray(stacked(STACKED)), want, rtol=1e-6)
    assert shared.table_size() == other.table_size() == 0  # inference inserts nothing


def test_shared_table_gets_one_adagrad_update_per_step_with_the_summed_gradient():
    """Features a (sum) and b (mean) read one table; Adagrad's accumulator
    tells one update with the summed gradient from one per feature."""
    lr, acc0, eps = 0.1, 0.1, 1e-7
    shared = table()
    group = GroupEmbedding({"a": FeatureSpec(shared, "sum"), "b": FeatureSpec(shared, "mean")},
                           output_mode="concat")
    inputs = keras.Input(shape=STACKED.shape[1:], dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=4),
                               trainable=False)
    model = keras.Model(inputs, dense(group(inputs)))
    model.compile(optimizer=optimizers.Adagrad(lr, initial_accumulator_value=acc0,
                                               epsilon=eps), loss="mse")
    kernel, bias = (w.astype(np.float64) for w in dense.get_weights())
    ids = np.concatenate([STACKED, STACKED[::-1]])
    labels = np.arange(len(ids), dtype=np.float32)[:, None]
    batch = len(STACKED)
    model.fit(ids, labels, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    rows, acc, versions = {}, {}, {}
    for step in range(len(ids) // batch):
        k, y = ids[step * batch:][:batch], labels[step * batch:][:batch]
        for key in np.unique(k[k >= 0]):
            rows.setdefault(int(key), shared.default_values[key % DVD].astype(np.float64))
        r = np.stack([[[rows.get(int(i), np.zeros(DIM)) for i in f] for f in e] for e in k])
        pooled = [numpy_pool(r[:, 0], k[:, 0], "sum"), numpy_pool(r[:, 1], k[:, 1], "mean")]
        d = 2.0 * (np.concatenate(pooled, 1) @ kernel + bias - y) / batch
        d_pooled = d @ kernel.T
        grads = {}
        for j, combiner in ((0, "sum"), (1, "mean")):
            keep = k[:, j] >= 0
            scale = 1.0 if combiner == "sum" else 1.0 / np.maximum(keep.sum(1, keepdims=True), 1)
            d_rows = (d_pooled[:, j * DIM:(j + 1) * DIM] * scale)[:, None, :] * keep[..., None]
            for key in np.unique(k[:, j][keep]):
                grads[int(key)] = grads.get(int(key), 0) + d_rows[k[:, j] == key].sum(0)
        for key, g in grads.items():  # one update per distinct id
            acc[key] = acc.get(key, np.full(DIM, acc0)) + g * g
            rows[key] = rows[key] - lr * g / np.sqrt(acc[key] + eps)
            versions[key] = step

    e = shared.export()
    order = np.argsort(e["keys"])
    keys = e["keys"][order].tolist()
    assert keys == sorted(rows)  # no -1 key
    np.testing.assert_allclose(e["values"][order], [rows[k] for k in keys], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e["slots"]["accumulator"][order], [acc[k] for k in keys],
                               rtol=1e-5)
    assert e["versions"][order].tolist() == [versions[k] for k in keys]
    assert e["freqs"][order].tolist() == [int((ids == k).sum()) for k in keys]
    assert int(shared.iterations.value) == len(ids) // batch  # one lookup per step


def one_id_model(combiner, padded):
    """Tables of two dims and three rules (the compiled Adagrad, an own SGD,
    an own Adam); features of one id (a, c, d) and of three (b, sharing
    a's table). With `padded` the one-id features come as [batch, 2] with a
    padding column, which takes the pooled lookup."""
    def ev(dim, name, seed, **kwargs):
        return EmbeddingVariable(dim, default_value_dim=DVD, name=name,
                                 initializer=keras.initializers.RandomUniform(seed=seed), **kwargs)
    t1, t2, t3 = (ev(DIM, "t1", 2), ev(2, "t2", 3, optimizer=keras.optimizers.SGD(0.2)),
                  ev(2, "t3", 4, optimizer=keras.optimizers.Adam(0.05)))
    group = GroupEmbedding({"a": FeatureSpec(t1, "sum"), "b": FeatureSpec(t1, combiner),
                            "c": FeatureSpec(t2, combiner), "d": FeatureSpec(t3, combiner)},
                           output_mode="concat")
    width = 2 if padded else 1
    inputs = {"a": keras.Input((width,), dtype="int32", name="a"),
              "b": keras.Input((3,), dtype="int32", name="b"),
              "c": keras.Input((width,) if padded else (), dtype="int32", name="c"),
              "d": keras.Input((width,), dtype="int32", name="d")}
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=5))
    model = keras.Model(inputs, dense(group(inputs)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model, group


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_one_id_features_look_up_and_train_as_padded_ones(combiner):
    """Unweighted features of one id take a plain lookup (their combine is
    the row): rows, predictions, updates, slots, versions and frequencies
    equal those of the same ids padded to two (the pooled lookup), in a
    step where the shared table also pools a feature of three ids."""
    rng = np.random.default_rng(0)
    n = 16
    one = {f: rng.integers(-1, 7, (n, 1)).astype(np.int32) for f in "acd"}
    x = dict(one, b=rng.integers(-1, 7, (n, 3)).astype(np.int32))
    pad = np.full((n, 1), -1, np.int32)
    x_padded = dict(x, **{f: np.concatenate([one[f], pad], 1) for f in "acd"})
    x = dict(x, c=x["c"][:, 0])  # [batch] ids too
    labels = rng.normal(size=(n, 1)).astype(np.float32)
    got, got_group = one_id_model(combiner, padded=False)
    want, want_group = one_id_model(combiner, padded=True)
    np.testing.assert_array_equal(got.predict(x, verbose=0), want.predict(x_padded, verbose=0))
    for model, inputs in ((got, x), (want, x_padded)):
        model.fit(inputs, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.predict(x, verbose=0), want.predict(x_padded, verbose=0),
                               rtol=1e-6, atol=1e-7)
    for t, w in zip(got_group.tables, want_group.tables):
        g, e = t.export(), w.export()
        order_g, order_e = np.argsort(g["keys"]), np.argsort(e["keys"])
        assert g["keys"][order_g].tolist() == e["keys"][order_e].tolist()
        assert min(g["keys"]) >= 0 and len(g["keys"]) > 3
        for name in ("values", "freqs", "versions"):
            np.testing.assert_allclose(g[name][order_g], e[name][order_e], rtol=1e-6,
                                       atol=1e-7, err_msg=f"{t.name} {name}")
        assert sorted(g["slots"]) == sorted(e["slots"])
        assert len(g["slots"]) == {"t1": 1, "t2": 0, "t3": 2}[t.name]  # Adagrad, SGD, Adam
        for name in g["slots"]:
            np.testing.assert_allclose(g["slots"][name][order_g], e["slots"][name][order_e],
                                       rtol=1e-6, atol=1e-7, err_msg=f"{t.name} {name}")
        assert int(t.iterations.value) == int(w.iterations.value) == 2 * n // 4
    # The one-id rows are the rows: t2 (SGD) has moved from its initial rows.
    c = x["c"][x["c"] >= 0]
    rows = np.asarray(got_group.tables[1](c, training=False))
    assert not np.allclose(rows, got_group.tables[1].default_values[c % DVD])


@keras.saving.register_keras_serializable(package="test_group_embedding")
class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.group = make_group()
        self.dense = keras.layers.Dense(1)

    def call(self, ids):
        return self.dense(self.group(ids))


def make_group():
    return GroupEmbedding({"a": FeatureSpec({"embedding_dim": DIM}, "mean"),
                           "b": FeatureSpec({"embedding_dim": 2}, "sqrtn")},
                          output_mode="concat", name="group")


def make(form):
    if form == "functional":
        inputs = {n: keras.Input(shape=(3,), dtype="int32", name=n) for n in "ab"}
        return keras.Model(inputs, keras.layers.Dense(1)(make_group()(inputs)))
    if form == "subclassed":
        return Subclassed()
    if form == "sequential":
        return keras.Sequential([keras.Input(shape=STACKED.shape[1:], dtype="int32"),
                                 make_group(), keras.layers.Dense(1)])
    return keras.Sequential([make_group(), keras.layers.Dense(1)])  # without keras.Input


@pytest.mark.parametrize("form", ["functional", "subclassed", "sequential",
                                  "sequential_without_input"])
def test_model_forms_fit_and_save_every_row(form, tmp_path):
    model = make(form)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    x = {"a": STACKED[:, 0], "b": STACKED[:, 1]} if form == "functional" else STACKED
    labels = np.ones((len(STACKED), 1), np.float32)
    model.predict(x, batch_size=2, verbose=0)
    model.evaluate(x, labels, batch_size=2, verbose=0)
    group = model.get_layer("group")
    assert [t.table_size() for t in group.tables] == [0, 0]  # inference inserts nothing
    model.fit(x, labels, batch_size=2, epochs=1, verbose=0)
    want = [t.export() for t in group.tables]
    assert [len(w["keys"]) for w in want] == [len(np.unique(STACKED[:, j][STACKED[:, j] >= 0]))
                                              for j in range(2)]
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    for t, w in zip(loaded.get_layer("group").tables, want):
        got = t.export()
        for name in ("keys", "values", "freqs", "versions"):
            np.testing.assert_array_equal(got[name], w[name], err_msg=name)
        assert list(got["slots"]) == list(w["slots"]) == ["accumulator"]
        np.testing.assert_array_equal(got["slots"]["accumulator"], w["slots"]["accumulator"])
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)


def test_config_is_the_tensorflow_layers():
    group = make_group()
    config = group.get_config()
    assert config["features"]["a"] == {"table": 0, "combiner": "mean", "weight_feature": None,
                                       "sequence": False, "max_norm": None, "default_id": None}
    assert [t["registered_name"] for t in config["tables"]] == ["keras_rec_emb>EmbeddingVariable"] * 2
    again = GroupEmbedding.from_config(config)
    assert [t.embedding_dim for t in again.tables] == [DIM, 2] and again.output_mode == "concat"
    assert keras.saving.get_registered_name(GroupEmbedding) == "keras_rec_emb>GroupEmbedding"
    assert keras.saving.get_registered_name(FeatureSpec) == "keras_rec_emb>FeatureSpec"
    assert kre.layers.GroupEmbedding is GroupEmbedding and kre.layers.FeatureSpec is FeatureSpec


@pytest.mark.parametrize("kwargs, match", [
    ({"sequence": True}, "sequence=False only.*Received: sequence=True"),
    ({"max_norm": 1.0}, "max_norm=None only.*Received: max_norm=1.0"),
    ({"default_id": 0}, "default_id=None only.*Received: default_id=0"),
    ({"combiner": "max"}, "`combiner` must be one of.*combiner='max'"),
])
def test_feature_spec_refuses_what_jax_lacks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FeatureSpec({"embedding_dim": DIM}, **kwargs)


def test_group_refuses_bad_arguments_and_inputs():
    with pytest.raises(ValueError, match="table=an EmbeddingVariable.*keras.layers.Embedding"):
        FeatureSpec(keras.layers.Embedding(10, DIM))
    with pytest.raises(ValueError, match="keras.layers.Embedding"):
        GroupEmbedding({"a": FeatureSpec({"input_dim": 10, "output_dim": DIM})})
    with pytest.raises(ValueError, match="`output_mode` must be one of.*output_mode='stack'"):
        GroupEmbedding({"a": FeatureSpec({"embedding_dim": DIM})}, output_mode="stack")
    with pytest.raises(ValueError, match="`features` must be a non-empty dict"):
        GroupEmbedding({})
    with pytest.raises(ValueError, match="index 1 is out of range for 0 tables"):
        GroupEmbedding({"a": FeatureSpec(1)})
    group = make_group()
    with pytest.raises(ValueError, match=r"missing inputs \['b'\]"):
        group({"a": STACKED[:, 0]})
    with pytest.raises(ValueError, match=r"expects ids \[batch, 2\].*shape \(4, 3\)"):
        group(np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match=r"inputs=a dict of ids or one stacked"):
        group((STACKED[:, 0], STACKED[:, 0]))


def test_docstring_examples_run_under_jax():
    globs = {"keras": keras, "np": np, "keras_rec_emb": kre}
    tests = [t for t in doctest.DocTestFinder().find(group_embedding, globs=globs) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert len(tests) == 2 and result.attempted >= 10 and result.failed == 0
