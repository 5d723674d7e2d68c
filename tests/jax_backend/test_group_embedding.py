"""GroupEmbedding and FeatureSpec under Keras's JAX backend: the dict and
stacked forms pool padded ids to NumPy's numbers, a table shared by two
features gets one update per step with its ids' summed gradient, the model
forms fit and save, and what JAX lacks is refused."""

import os
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb import optimizers
from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.layers import group_embedding
from keras_rec_emb.layers.group_embedding import FeatureSpec, GroupEmbedding
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from tests._doctest_examples import assert_examples_run
from tests._table_checks import with_meta

DIM, DVD = 3, 5
# [batch, F=2, L=3], padded with -1; row 1 of feature 0 has no id.
STACKED = np.array([[[1, 4, -1], [4, 4, 2]],
                    [[-1, -1, -1], [0, -1, 3]],
                    [[2, 2, 2], [1, -1, -1]],
                    [[5, 0, -1], [5, 1, 0]]], np.int32)


def table(name="shared"):
    return EmbeddingVariable(DIM, ev_option=with_meta(DVD), name=name,
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


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sequence": "yes"}, TypeError, r"`sequence` must be a bool. Received: sequence='yes'"),
    ({"max_norm": -1.0}, ValueError, r"max_norm.*-1\.0"),
    ({"max_norm": float("inf")}, ValueError, r"max_norm.*inf"),
    ({"default_id": -5}, ValueError, r"default_id.*-5"),
    ({"default_id": 1.5}, TypeError, r"default_id.*1\.5"),
    ({"combiner": "max"}, ValueError, "`combiner` must be one of.*combiner='max'"),
])
def test_feature_spec_refuses_bad_arguments_as_under_tensorflow(kwargs, error, match):
    with pytest.raises(error, match=match):
        FeatureSpec({"embedding_dim": DIM}, **kwargs)


def test_group_refuses_bad_arguments_and_inputs():
    with pytest.raises(TypeError, match="`table` must be an EmbeddingVariable.*table=3.5"):
        FeatureSpec(3.5)
    with pytest.raises(ValueError, match="must be a serialized layer.*Received"):
        GroupEmbedding({"a": FeatureSpec({"dim": DIM})})
    with pytest.raises(ValueError, match="`output_mode` must be one of.*output_mode='stack'"):
        GroupEmbedding({"a": FeatureSpec({"embedding_dim": DIM})}, output_mode="stack")
    with pytest.raises(ValueError, match="`features` must be a non-empty dict"):
        GroupEmbedding({})
    with pytest.raises(ValueError, match="index 1 is out of range for 0 tables"):
        GroupEmbedding({"a": FeatureSpec(1)})
    with pytest.raises(ValueError, match="Sequence feature 'a' cannot be concatenated"):
        GroupEmbedding({"a": FeatureSpec({"embedding_dim": DIM}, sequence=True)},
                       output_mode="concat")
    group = make_group()
    with pytest.raises(ValueError, match=r"missing inputs \['b'\]"):
        group({"a": STACKED[:, 0]})
    with pytest.raises(ValueError, match=r"expects ids \[batch, 2\].*shape \(4, 3\)"):
        group(np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match=r"inputs=a dict of ids or one stacked"):
        group((STACKED[:, 0], STACKED[:, 0]))


# Features with TensorFlow's per-feature options: a and b share table t1,
# c reads t2; a clips rows (mean, weighted: ids of weight <= 0 dropped), b
# reads id 6 where an example keeps none (sum), c is a weighted sequence
# with a default id and clipped rows.
OPTIONS = {"a": dict(combiner="mean", weight_feature="wa", max_norm=0.045),
           "b": dict(combiner="sum", default_id=6),
           "c": dict(combiner="sum", weight_feature="wc", sequence=True, default_id=5,
                     max_norm=0.04)}
OPTION_IDS = {"a": np.array([[1, 4, -1], [-1, -1, -1], [2, 2, 3], [0, 5, 1]], np.int32),
              "wa": np.array([[0.5, 2.0, 1.0], [1.0, 1.0, 1.0], [0.0, -1.0, 3.0],
                              [1.0, 0.25, 2.0]], np.float32),
              "b": np.array([[4, -1], [-1, -1], [1, 3], [-1, 0]], np.int32),
              "c": np.array([[-1, 3, 4], [-1, -1, -1], [2, -1, 2], [0, 1, -1]], np.int32),
              "wc": np.array([[1.0, 0.5, 2.0], [1.0, 1.0, 1.0], [3.0, 1.0, -0.5],
                              [1.0, 1.0, 1.0]], np.float32)}


def option_group():
    t1, t2 = table("t1"), table("t2")
    return GroupEmbedding({n: FeatureSpec(t1 if n != "c" else t2, **o)
                           for n, o in OPTIONS.items()}, output_mode="dict")


def numpy_feature(rows, ids, w, combiner, max_norm=None, default_id=None, sequence=False):
    """TensorFlow's fused lookup in NumPy (float64), as
    tests/ops/test_group_lookup.py's reference: prune ids < 0 (and for mean
    and sqrtn ids of weight <= 0), fill examples left empty with default_id
    (weight 1), clip rows to max_norm, weigh, combine or lay out in order
    ([batch, L, dim] here, zeros after an example's last kept id). `rows`
    maps an id to its row."""
    w = np.ones(ids.shape) if w is None else w
    out = np.zeros((len(ids), ids.shape[1], DIM) if sequence else (len(ids), DIM))
    for b in range(len(ids)):
        kept = [(int(i), float(x)) for i, x in zip(ids[b], w[b])
                if i >= 0 and (combiner == "sum" or x > 0)]
        if not kept and default_id is not None:
            kept = [(default_id, 1.0)]
        if not kept:
            continue
        x = np.stack([rows[i] for i, _ in kept]).astype(np.float64)
        if max_norm:
            n = np.linalg.norm(x, axis=1, keepdims=True)
            x = x * np.where(n > max_norm, max_norm / np.maximum(n, 1e-30), 1.0)
        ww = np.array([k[1] for k in kept])[:, None]
        if sequence:
            out[b, :len(kept)] = x * ww
            continue
        total = (x * ww).sum(0)
        out[b] = {"sum": total, "mean": total / ww.sum(),
                  "sqrtn": total / np.sqrt((ww * ww).sum())}[combiner]
    return out


def numpy_options(tables, rows_of, x):
    return {n: numpy_feature(rows_of[tables[n]], x[n], x.get(o.get("weight_feature")),
                             o["combiner"], o.get("max_norm"), o.get("default_id"),
                             o.get("sequence", False))
            for n, o in OPTIONS.items()}


def test_sequence_max_norm_and_default_id_features_look_up_like_numpy():
    group = option_group()
    for training in (False, None):
        got = group(OPTION_IDS, training=training)
        t1, t2 = group.tables
        rows = {t: {i: t.default_values[i % DVD] for i in range(8)} for t in (t1, t2)}
        want = numpy_options({"a": t1, "b": t1, "c": t2}, rows, OPTION_IDS)
        assert sorted(got) == ["a", "b", "c"]
        for name in want:
            np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-6, atol=1e-7,
                                       err_msg=f"{name} training={training}")
    # Some rows are clipped, others not; the defaults were read.
    for t in (t1, t2):
        norms = np.linalg.norm(np.asarray(t.default_values), axis=1)
        assert norms.min() < 0.04 < 0.045 < norms.max()
    np.testing.assert_allclose(np.asarray(got["b"])[1], t1.default_values[6 % DVD], rtol=1e-6)
    assert t1.table_size() == t2.table_size() == 0  # inference inserts nothing


def test_sequence_max_norm_and_default_id_train_to_numpys_gradient():
    """One SGD step: each row moves by -lr times the gradient of the loss
    (finite differences of the NumPy reference, float64), the default ids
    included; clipped rows get the clip's gradient."""
    lr = 0.5
    group = option_group()
    inputs = {k: keras.Input(shape=v.shape[1:], dtype=v.dtype.name, name=k)
              for k, v in OPTION_IDS.items()}
    out = group(inputs)
    # A position-dependent head for the sequence (its first and summed rows).
    flat = keras.layers.Concatenate()([out["a"], out["b"], out["c"][:, 0, :],
                                       keras.ops.sum(out["c"], axis=1)])
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=7),
                               trainable=False)
    model = keras.Model(inputs, dense(flat))
    model.compile(optimizer=optimizers.SGD(lr), loss="mse")
    t1, t2 = group.tables
    kernel, bias = (w.astype(np.float64) for w in dense.get_weights())
    y = np.array([[0.5], [-1.0], [2.0], [0.25]])
    ids = {t1: range(8), t2: range(8)}
    start = {t: {i: t.default_values[i % DVD].astype(np.float64) for i in ids[t]}
             for t in (t1, t2)}
    tables = {"a": t1, "b": t1, "c": t2}

    def loss(rows):
        f = numpy_options(tables, rows, OPTION_IDS)
        pred = np.concatenate([f["a"], f["b"], f["c"][:, 0], f["c"].sum(1)], 1) @ kernel + bias
        return np.mean((pred - y) ** 2)

    want = {}
    for t in (t1, t2):
        for i in ids[t]:
            grad = np.zeros(DIM)
            for d in range(DIM):
                for sign in (1, -1):
                    rows = {u: dict(r) for u, r in start.items()}
                    rows[t][i] = rows[t][i] + sign * 1e-6 * np.eye(DIM)[d]
                    grad[d] += sign * loss(rows) / 2e-6
            if np.abs(grad).max() > 0:
                want[(t.name, i)] = start[t][i] - lr * grad
    model.fit(OPTION_IDS, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for t in (t1, t2):
        e = t.export()
        got = {int(k): v for k, v in zip(e["keys"], e["values"])}
        assert 6 in got if t is t1 else 5 in got  # the default ids are rows too
        for i, row in got.items():
            np.testing.assert_allclose(row, want.get((t.name, i), start[t][i]), rtol=1e-4,
                                       atol=1e-5, err_msg=f"{t.name} id {i}")
    assert {k for k, _ in want} == {"t1", "t2"}


def test_a_keras_embedding_table_reads_and_trains_like_a_gather():
    """A `keras.layers.Embedding` table (a dense matrix) trained by the
    model's optimizer as any Keras weight: its rows are gathered, combined
    and updated as NumPy says."""
    lr = 0.25
    dense_table = keras.layers.Embedding(8, DIM, embeddings_initializer=keras.initializers
                                         .RandomUniform(seed=3))
    group = GroupEmbedding({"a": FeatureSpec(dense_table, "mean"),
                            "b": FeatureSpec({"input_dim": 8, "output_dim": 2})},
                           output_mode="concat")
    x = {"a": OPTION_IDS["a"], "b": OPTION_IDS["b"]}
    out = np.asarray(group(x))
    matrix = np.asarray(dense_table.embeddings)
    rows = dict(enumerate(matrix))
    np.testing.assert_allclose(out[:, :DIM], numpy_feature(rows, x["a"], None, "mean"),
                               rtol=1e-6)
    inputs = {k: keras.Input(shape=(v.shape[1],), dtype="int32", name=k) for k, v in x.items()}
    model = keras.Model(inputs, keras.ops.sum(group(inputs), axis=1, keepdims=True))
    model.compile(optimizer=optimizers.SGD(lr), loss="mse")
    y = np.zeros((4, 1), np.float32)
    pred = out.sum(1, keepdims=True)
    d = 2 * (pred - y) / len(y)  # each pooled entry's gradient
    keep = x["a"] >= 0
    scale = keep / np.maximum(keep.sum(1, keepdims=True), 1)
    grad = np.zeros_like(matrix, dtype=np.float64)
    for b in range(4):
        for i, s in zip(x["a"][b], scale[b]):
            if i >= 0:
                grad[i] += d[b, 0] * s
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(np.asarray(dense_table.embeddings), matrix - lr * grad,
                               rtol=1e-5, atol=1e-6)


def test_docstring_examples_run_under_jax():
    assert_examples_run(group_embedding, tests=2, attempted=10)


def test_a_group_embedding_model_compiles_its_step_with_xla():
    """Under JAX the tables are XLA FFI calls: `jit_compile="auto"` must
    choose XLA (a layer saying `supports_jit=False` would make every step
    of `fit` run op by op, about ten times slower)."""
    group = kre.layers.GroupEmbedding(
        {"a": kre.layers.FeatureSpec({"embedding_dim": 4}, combiner="sum")})
    ids = keras.Input((2,), dtype="int64", name="a")
    model = keras.Model({"a": ids}, keras.layers.Dense(1)(group({"a": ids})["a"]))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    assert group.supports_jit
    assert model.jit_compile is True
    model.fit({"a": np.array([[1, 2], [3, -1]])}, np.ones((2, 1)), verbose=0)


def _own_tables_model(threads, monkeypatch):
    """A model over a group of three features, each pooled from a table of
    its own (weighted mean, sum, sqrtn; L 3, 3, 2), trained two steps of
    Adam, its step traced as with a table call's pool of `threads`."""

    monkeypatch.setattr(ffi, "pool_threads", lambda: threads)
    tables = [EmbeddingVariable(d, ev_option=with_meta(DVD), name=f"t{j}",
                                initializer=keras.initializers.RandomUniform(seed=j))
              for j, d in enumerate((DIM, 2, 4))]
    group = GroupEmbedding({"a": FeatureSpec(tables[0], "mean", weight_feature="wa"),
                            "b": FeatureSpec(tables[1], "sum"),
                            "c": FeatureSpec(tables[2], "sqrtn")}, output_mode="concat")
    inputs = {"a": keras.Input((3,), dtype="int64", name="a"),
              "wa": keras.Input((3,), name="wa"),
              "b": keras.Input((3,), dtype="int64", name="b"),
              "c": keras.Input((2,), dtype="int64", name="c")}
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=4))
    model = keras.Model(inputs, dense(group(inputs)))
    model.compile(optimizer=kre.optimizers.Adam(0.05), loss="mse")
    rng = np.random.default_rng(7)
    x = {"a": rng.integers(-1, 9, (16, 3)), "wa": rng.uniform(-0.5, 2, (16, 3)).astype("float32"),
         "b": rng.integers(-1, 9, (16, 3)), "c": rng.integers(-1, 9, (16, 2))}
    y = rng.normal(size=(16, 1)).astype("float32")
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    monkeypatch.undo()
    return model, tables, x, y, history.history["loss"]


def test_own_tables_train_in_one_group_call_with_the_per_table_numbers(monkeypatch):
    """Features each pooled from a table of their own: with threads to
    spare a training step looks every table up in one call (and updates
    each table once); the loss, rows, slots, step counters and dense
    weights equal those of the per-table lookups (one thread) bit for bit."""
    got, got_tables, x, y, got_loss = _own_tables_model(2, monkeypatch)
    want, want_tables, _, _, want_loss = _own_tables_model(1, monkeypatch)
    assert got_loss == want_loss
    for g, w in zip(got_tables, want_tables):
        ge, we = g.export(), w.export()
        for name in ("keys", "values", "freqs", "versions"):
            np.testing.assert_array_equal(ge[name], we[name], err_msg=f"{g.name} {name}")
        for slot in we["slots"]:
            np.testing.assert_array_equal(ge["slots"][slot], we["slots"][slot], err_msg=slot)
        assert int(g.iterations.value) == int(w.iterations.value) == 2
    for g, w in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_array_equal(g, w)
    state = got._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                               optimizer_variables=True, metrics_variables=True)
    data = ({k: v[:8] for k, v in x.items()}, y[:8])
    monkeypatch.setattr(ffi, "pool_threads", lambda: 2)
    calls = _table_calls(lambda s, d: got.train_step(s, d), state, data)
    assert calls.count("kre_group_pooled_lookup_distinct") == 1
    assert not [c for c in calls if "lookup" in c and c != "kre_group_pooled_lookup_distinct"]
    assert calls.count("kre_table_apply_distinct") == 3
    monkeypatch.setattr(ffi, "pool_threads", lambda: 1)
    # (A function of its own: JAX keeps the trace of one.)
    assert _table_calls(lambda s, d: got.train_step(s, d), state, data).count(
        "kre_table_pooled_lookup_distinct") == 3


def test_pool_threads_is_xlas_pool_size_when_it_has_threads_to_spare():
    code = ("import jax; from keras_rec_emb.backend.jax import ffi; "
            "print(jax.jit(lambda x: x + ffi.pool_threads())(0), ffi.pool_threads())")
    for nproc, want in (("1", "1 1"), ("3", "3 3")):
        env = dict(os.environ, NPROC=nproc, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split()[-2:] == want.split(), run.stdout


@pytest.mark.parametrize("length", [6, 12], ids=["padded_combine", "long_rows"])
def test_training_and_inference_lookups_give_the_same_bits(length):
    """The training lookup (through the distinct ids) and the inference
    lookup combine unweighted ids with the same operations in the same order
    (core/pooled_rows.h): the same bits, -0.0 included (a row of one id reads
    its row as it is), and NumPy's float32 sums in that order."""
    rng = np.random.default_rng(5)
    dims, combiners = (16, 3), ("sum", "mean", "sqrtn")
    matrices = []
    for dim in dims:
        m = rng.normal(size=(DVD, dim)).astype(np.float32)
        m[0] = -0.0
        m[1, ::2] = -0.0
        matrices.append(m)
    tables = [EmbeddingVariable(dim, ev_option=with_meta(DVD), name=f"t{j}",
                                initializer=lambda shape, dtype=None, m=m: m)
              for j, (dim, m) in enumerate(zip(dims, matrices))]
    specs = {f"f{j}": FeatureSpec(tables[j % 2], combiners[j % 3]) for j in range(4)}
    group = GroupEmbedding(specs, output_mode="concat")
    model = keras.Sequential([keras.Input((4, length), dtype="int32"), group])
    model.compile(optimizer=optimizers.Adagrad(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)  # the tables' update rule: training lookups
    x = rng.integers(0, 40, (300, 4, length)).astype(np.int32)
    x[rng.random(x.shape) < 0.45] = -1
    x[:20] = -1
    x[20:40, :, 1:] = -1  # rows of one id
    x[20:30, :, 0] = 0  # ... that is all -0.0
    trained = np.asarray(group(x, training=True))
    inferred = np.asarray(group(x, training=False))
    np.testing.assert_array_equal(trained.view(np.uint32), inferred.view(np.uint32))
    want = []
    for j in range(4):
        m, comb = matrices[j % 2], combiners[j % 3]
        rows = []
        for ids in x[:, j]:
            kept = ids[ids >= 0]
            if len(kept) == 1:
                rows.append(m[kept[0] % DVD])
                continue
            acc = np.zeros(m.shape[1], np.float32)
            for k in kept:
                acc = acc + m[k % DVD]
            if comb != "sum" and len(kept):
                n = np.float32(len(kept))
                acc = acc * (np.float32(1) / (np.sqrt(n, dtype=np.float32) if comb == "sqrtn" else n))
            rows.append(acc)
        want.append(np.stack(rows))
    want = np.concatenate(want, -1)
    np.testing.assert_array_equal(trained.view(np.uint32), want.view(np.uint32))
    assert (np.signbit(trained) & (trained == 0)).any()
