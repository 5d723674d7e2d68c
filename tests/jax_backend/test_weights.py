"""Per-id weights under Keras's JAX backend: `EmbeddingVariable(combiner=...)`
called with `weights=` and `GroupEmbedding` features with a `weight_feature`
combine padded ids to NumPy's numbers (sum(w * row), / sum(w) for mean,
/ sqrt(sum(w**2)) for sqrtn, ids of weight <= 0 dropped from mean and
sqrtn), and train each distinct id once with its summed weighted gradient."""

import keras
import numpy as np
import pytest

from keras_rec_emb import optimizers
from keras_rec_emb.layers.group_embedding import FeatureSpec, GroupEmbedding
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from tests._doctest_examples import assert_examples_run
from tests._table_checks import check_table, with_meta

DIM, DVD = 3, 5
# Padding (-1), duplicates in a row (3, 3), a weight of 0 and a negative one
# (dropped by mean and sqrtn, kept by sum), a row with no weight > 0.
IDS = np.array([[1, 5, -1], [-1, 8, 6], [3, 3, 7], [2, 9, 4]], np.int32)
WEIGHTS = np.array([[0.5, 2.0, 9.0], [1.0, -1.0, 0.0], [1.5, 0.25, 3.0], [1.0, 0.0, 2.0]],
                   np.float32)


def numpy_combine(rows, ids, weights, combiner):
    """rows [..., L, DIM] -> [..., DIM], TensorFlow's weighted rule."""
    w = np.where(ids >= 0, weights, 0.0).astype(np.float64)
    if combiner != "sum":
        w = np.where(w > 0, w, 0.0)
    total = (rows * w[..., None]).sum(-2)
    if combiner == "sum":
        return total, w, np.ones(ids.shape[:-1] + (1,))
    denom = w.sum(-1, keepdims=True) if combiner == "mean" else np.sqrt(
        (w * w).sum(-1, keepdims=True))
    scale = np.where(denom > 0, 1.0 / np.where(denom > 0, denom, 1.0), 0.0)
    return total * scale, w, scale


def kept(ids, weights, combiner):
    """The ids a lookup inserts and counts."""
    keep = ids >= 0
    return keep if combiner == "sum" else keep & (weights > 0)


def make_layer(combiner):
    return EmbeddingVariable(DIM, combiner=combiner, prune_invalid_ids=combiner is not None,
                             ev_option=with_meta(DVD),
                             initializer=keras.initializers.RandomUniform(seed=2))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weighted_inference_combines_like_numpy(combiner):
    layer = make_layer(combiner)
    got = np.asarray(layer(IDS, weights=WEIGHTS))
    rows = layer.default_values[IDS % DVD].astype(np.float64)
    want, _, _ = numpy_combine(rows, IDS, WEIGHTS, combiner)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    if combiner != "sum":
        np.testing.assert_array_equal(got[1], np.zeros(DIM))  # no weight > 0: zeros
    assert layer.table_size() == 0
    # Weights of ones are the unweighted combine.
    np.testing.assert_allclose(np.asarray(layer(IDS, weights=np.ones_like(WEIGHTS))),
                               np.asarray(layer(IDS)), rtol=1e-6)


def numpy_adagrad(default_values, batches, combiner, kernel, bias, lr, acc0, eps=1e-7):
    """The table after Adagrad on a weighted-combine -> Dense(1) -> MSE model
    with a frozen Dense layer: rows, accumulators, versions, freqs."""
    rows, acc, versions, freqs = {}, {}, {}, {}
    for step, (ids, weights, labels) in enumerate(batches):
        keep = kept(ids, weights, combiner)
        for key in ids[keep]:
            rows.setdefault(int(key), default_values[key % DVD].astype(np.float64))
            freqs[int(key)] = freqs.get(int(key), 0) + 1
        r = np.stack([[rows[int(k)] if m else np.zeros(DIM) for k, m in zip(a, b)]
                      for a, b in zip(ids, keep)])
        pooled, w, scale = numpy_combine(r, ids, weights, combiner)
        d = 2.0 * (pooled @ kernel + bias - labels) / len(ids)
        d_rows = ((d @ kernel.T) * scale)[:, None, :] * w[..., None]  # [B, L, DIM]
        for key in np.unique(ids[keep]):
            g = d_rows[(ids == key) & keep].sum(0)
            acc[int(key)] = acc.get(int(key), np.full(DIM, acc0)) + g * g
            rows[int(key)] = rows[int(key)] - lr * g / np.sqrt(acc[int(key)] + eps)
            versions[int(key)] = step
    return rows, acc, versions, freqs


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weighted_training_applies_each_ids_weighted_gradient_once(combiner):
    """fit on a functional model `layer(ids, weights=w)`, two steps: the
    table is NumPy's Adagrad on the weighted gradient (equal ids summed),
    and ids of weight <= 0 are never inserted under mean and sqrtn."""
    lr, acc0 = 0.1, 0.1
    layer = make_layer(combiner)
    ids_in = keras.Input(shape=(3,), dtype="int32", name="ids")
    w_in = keras.Input(shape=(3,), dtype="float32", name="w")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=4),
                               trainable=False)
    model = keras.Model([ids_in, w_in], dense(layer(ids_in, weights=w_in)))
    model.compile(optimizer=optimizers.Adagrad(lr, initial_accumulator_value=acc0), loss="mse")
    kernel, bias = (w.astype(np.float64) for w in dense.get_weights())
    ids = np.concatenate([IDS, IDS[::-1]])
    weights = np.concatenate([WEIGHTS, WEIGHTS[::-1] * 2])
    labels = np.arange(len(ids), dtype=np.float32)[:, None]
    model.fit([ids, weights], labels, batch_size=len(IDS), shuffle=False, verbose=0)

    n = len(IDS)
    batches = [(ids[i:i + n], weights[i:i + n], labels[i:i + n]) for i in (0, n)]
    check_table(layer, *numpy_adagrad(layer.default_values, batches, combiner, kernel, bias,
                                      lr, acc0))
    keys = set(layer.export()["keys"].tolist())
    assert (8 in keys) == (combiner == "sum")  # only weight -1: dropped by mean and sqrtn


def test_a_model_with_weights_saves_and_loads(tmp_path):
    layer = make_layer("sqrtn")
    ids_in = keras.Input(shape=(3,), dtype="int32")
    w_in = keras.Input(shape=(3,), dtype="float32")
    model = keras.Model([ids_in, w_in], keras.layers.Dense(1)(layer(ids_in, weights=w_in)))
    model.compile(optimizer=optimizers.Adam(0.01), loss="mse")
    model.fit([IDS, WEIGHTS], np.ones((len(IDS), 1)), verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(np.asarray(loaded.predict([IDS, WEIGHTS], verbose=0)),
                               np.asarray(model.predict([IDS, WEIGHTS], verbose=0)), rtol=1e-6)


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="need a `combiner`.*combiner=None"):
        EmbeddingVariable(DIM)(IDS, weights=WEIGHTS)
    with pytest.raises(ValueError, match="needs `prune_invalid_ids=True`.*"
                                         "prune_invalid_ids=False"):
        EmbeddingVariable(DIM, combiner="mean")(IDS, weights=WEIGHTS)
    with pytest.raises(ValueError, match=r"ids' shape \(4, 3\).*weights of shape \(4, 2\)"):
        make_layer("sum")(IDS, weights=WEIGHTS[:, :2])
    with pytest.raises(TypeError, match="`weights` must be numbers.*dtype bool"):
        make_layer("sum")(IDS, weights=WEIGHTS > 0)
    # sum keeps ids of any weight, so it needs no pruning.
    np.testing.assert_allclose(
        np.asarray(EmbeddingVariable(DIM, combiner="sum", default_value_dim=DVD,
                                     initializer="ones")(IDS, weights=WEIGHTS)),
        np.repeat(WEIGHTS.sum(1, keepdims=True), DIM, 1), rtol=1e-6)


def test_the_call_example_runs():
    assert_examples_run(EmbeddingVariable.call, "call")


# -- GroupEmbedding ------------------------------------------------------------
def make_group(shared):
    """a (sum, weighted by wa) and b (combiner given, weighted by wb) share
    `shared`; c is unweighted on its own table."""
    return lambda combiner: GroupEmbedding({
        "a": FeatureSpec(shared, "sum", weight_feature="wa"),
        "b": FeatureSpec(shared, combiner, weight_feature="wb"),
        "c": FeatureSpec({"embedding_dim": 2, "default_value_dim": DVD}, "mean"),
    }, output_mode="concat", name="group")


def group_inputs(ids, weights):
    return {"a": ids[:, 0], "wa": weights[:, 0], "b": ids, "wb": weights,
            "c": ids[:, ::-1]}


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_group_weight_features_pool_like_numpy(combiner):
    shared = make_layer(None)
    group = make_group(shared)(combiner)
    out = np.asarray(group(group_inputs(IDS, WEIGHTS)))
    rows = shared.default_values[IDS % DVD].astype(np.float64)
    a, _, _ = numpy_combine(rows[:, :1], IDS[:, :1], WEIGHTS[:, :1], "sum")
    b, _, _ = numpy_combine(rows, IDS, WEIGHTS, combiner)
    np.testing.assert_allclose(out[:, :DIM], a, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out[:, DIM:2 * DIM], b, rtol=1e-6, atol=1e-7)
    assert out.shape == (len(IDS), 2 * DIM + 2)


def test_group_weighted_shared_table_gets_one_update_per_step():
    """a ([batch], sum, weighted) and b ([batch, 3], mean, weighted) share
    one table: one Adagrad update per step with each id's summed weighted
    gradient (NumPy), ids of b with weight <= 0 neither inserted nor counted."""
    lr, acc0 = 0.1, 0.1
    shared = make_layer(None)
    group = GroupEmbedding({"a": FeatureSpec(shared, "sum", weight_feature="wa"),
                            "b": FeatureSpec(shared, "mean", weight_feature="wb")},
                           output_mode="concat")
    inputs = {"a": keras.Input((), dtype="int32", name="a"),
              "wa": keras.Input((), dtype="float32", name="wa"),
              "b": keras.Input((3,), dtype="int32", name="b"),
              "wb": keras.Input((3,), dtype="float32", name="wb")}
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=4),
                               trainable=False)
    model = keras.Model(inputs, dense(group(inputs)))
    model.compile(optimizer=optimizers.Adagrad(lr, initial_accumulator_value=acc0), loss="mse")
    kernel, bias = (w.astype(np.float64) for w in dense.get_weights())
    b_ids = IDS[:, ::-1].copy()
    a_ids, a_w = IDS[:, 0], WEIGHTS[:, 2]
    labels = np.arange(len(IDS), dtype=np.float32)[:, None]
    model.fit({"a": a_ids, "wa": a_w, "b": b_ids, "wb": WEIGHTS}, labels,
              batch_size=len(IDS), verbose=0)

    rows, acc, freqs = {}, {}, {}
    keep_a = a_ids >= 0
    keep_b = kept(b_ids, WEIGHTS, "mean")
    for key in np.concatenate([a_ids[keep_a], b_ids[keep_b]]):
        rows.setdefault(int(key), shared.default_values[key % DVD].astype(np.float64))
        freqs[int(key)] = freqs.get(int(key), 0) + 1
    ra = np.stack([rows[int(k)] if m else np.zeros(DIM) for k, m in zip(a_ids, keep_a)])
    rb = np.stack([[rows[int(k)] if m else np.zeros(DIM) for k, m in zip(r, km)]
                   for r, km in zip(b_ids, keep_b)])
    pa, wa, sa = numpy_combine(ra[:, None], a_ids[:, None], a_w[:, None], "sum")
    pb, wb, sb = numpy_combine(rb, b_ids, WEIGHTS, "mean")
    d = (2.0 * (np.concatenate([pa, pb], 1) @ kernel + bias - labels) / len(IDS)) @ kernel.T
    ga = (d[:, :DIM] * sa) * wa  # [B, DIM]: one id per row
    gb = (d[:, DIM:] * sb)[:, None, :] * wb[..., None]
    for key in rows:
        g = ga[(a_ids == key) & keep_a].sum(0) + gb[(b_ids == key) & keep_b].sum(0)
        acc[key] = acc0 + g * g
        rows[key] = rows[key] - lr * g / np.sqrt(acc[key] + 1e-7)
    check_table(shared, rows, acc, dict.fromkeys(rows, 0), freqs)
    assert int(shared.iterations.value) == 1


def test_group_with_weight_features_saves_its_config_and_rows(tmp_path):
    shared = make_layer(None)
    group = make_group(shared)("sqrtn")
    inputs = {"a": keras.Input((), dtype="int32", name="a"),
              "wa": keras.Input((), dtype="float32", name="wa"),
              "b": keras.Input((3,), dtype="int32", name="b"),
              "wb": keras.Input((3,), dtype="float32", name="wb"),
              "c": keras.Input((3,), dtype="int32", name="c")}
    model = keras.Model(inputs, keras.layers.Dense(1)(group(inputs)))
    model.compile(optimizer=optimizers.Adagrad(0.1), loss="mse")
    x = group_inputs(IDS, WEIGHTS)
    model.fit(x, np.ones((len(IDS), 1)), verbose=0)
    path = str(tmp_path / "g.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    specs = loaded.get_layer("group").features
    assert (specs["a"].weight_feature, specs["b"].weight_feature, specs["c"].weight_feature) \
        == ("wa", "wb", None)
    np.testing.assert_allclose(np.asarray(loaded.predict(x, verbose=0)),
                               np.asarray(model.predict(x, verbose=0)), rtol=1e-6)
    again = FeatureSpec.from_config(FeatureSpec(0, "mean", weight_feature="w").get_config())
    assert again.weight_feature == "w"


def test_group_weight_features_refuse_bad_inputs():
    with pytest.raises(TypeError, match="`weight_feature` must be None or an input name.*=3"):
        FeatureSpec({"embedding_dim": DIM}, weight_feature=3)
    group = make_group(make_layer(None))("mean")
    x = group_inputs(IDS, WEIGHTS)
    with pytest.raises(ValueError, match=r"missing inputs \['wb'\]"):
        group({k: v for k, v in x.items() if k != "wb"})
    with pytest.raises(ValueError, match=r"weights 'wb' of feature 'b' must have the ids' "
                                         r"shape \(4, 3\).*weights of shape \(4, 2\)"):
        group(dict(x, wb=WEIGHTS[:, :2]))
    with pytest.raises(ValueError, match=r"has weight features \['wa', 'wb'\]: pass a dict"):
        group(np.zeros((4, 3, 3), np.int32))
