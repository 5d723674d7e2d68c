"""EmbeddingVariable(combiner=..., prune_invalid_ids=...) under Keras's JAX
backend: combines the last axis of padded ids, to NumPy's numbers, and
trains each distinct id once with its summed gradient."""

import keras
import numpy as np
import pytest

from keras_rec_emb import optimizers
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.options import EmbeddingVariableOption, InitializerOption

DIM, DVD = 3, 5
IDS = np.array([[1, 5, -1], [-1, -1, -1], [3, 3, 7], [2, 9, 4]], np.int32)



def _with_meta(default_value_dim):
    # Frequencies and versions are kept only when asked for (as under
    # TensorFlow): they show here which step updated each key, and how often.
    return EmbeddingVariableOption(init_option=InitializerOption(default_value_dim=default_value_dim),
                                   track_meta=True)

def numpy_combine(rows, ids, combiner, prune):
    """rows [..., L, DIM] -> [..., DIM]; pruned ids weigh 0."""
    keep = (ids >= 0) if prune else np.ones(ids.shape, bool)
    total = (rows * keep[..., None]).sum(-2)
    count = np.maximum(keep.sum(-1, keepdims=True), 1)
    return {"sum": total, "mean": total / count, "sqrtn": total / np.sqrt(count)}[combiner]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("prune", [True, False])
def test_inference_combines_the_last_axis_like_numpy(combiner, prune):
    layer = EmbeddingVariable(DIM, combiner=combiner, prune_invalid_ids=prune,
                              default_value_dim=DVD,
                              initializer=keras.initializers.RandomUniform(seed=2))
    got = np.asarray(layer(IDS))
    rows = layer.default_values[IDS % DVD]  # unseen ids read their initializer row
    np.testing.assert_allclose(got, numpy_combine(rows, IDS, combiner, prune), rtol=1e-6)
    assert got.shape == (len(IDS), DIM) and layer.table_size() == 0
    if prune:
        np.testing.assert_array_equal(got[1], np.zeros(DIM))  # no id: zeros


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_training_updates_each_distinct_id_once_with_its_summed_gradient(combiner):
    """Adagrad tells a once-per-step update from per-occurrence updates."""
    lr, init = 0.1, 0.1
    layer = EmbeddingVariable(DIM, combiner=combiner, prune_invalid_ids=True,
                              ev_option=_with_meta(DVD),
                              initializer=keras.initializers.RandomUniform(seed=2))
    inputs = keras.Input(shape=(IDS.shape[1],), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=4))
    model = keras.Model(inputs, dense(layer(inputs)))
    model.compile(optimizer=optimizers.Adagrad(lr, initial_accumulator_value=init), loss="mse")
    kernel, bias = (w.astype(np.float64) for w in dense.get_weights())
    labels = np.arange(len(IDS), dtype=np.float32)[:, None]
    model.fit(IDS, labels, batch_size=len(IDS), epochs=1, verbose=0)

    table = {int(k): layer.default_values[k % DVD].astype(np.float64)
             for k in np.unique(IDS[IDS >= 0])}
    rows = np.stack([[table.get(int(k), np.zeros(DIM)) for k in r] for r in IDS])
    pred = numpy_combine(rows, IDS, combiner, True) @ kernel + bias
    d = 2.0 * (pred - labels) / len(IDS)  # d loss / d pred
    d_combined = d @ kernel.T  # [B, DIM]
    keep = IDS >= 0
    count = np.maximum(keep.sum(-1, keepdims=True), 1)
    scale = {"sum": np.ones_like(count, float), "mean": 1.0 / count,
             "sqrtn": 1.0 / np.sqrt(count)}[combiner]
    d_rows = (d_combined * scale)[:, None, :] * keep[..., None]  # [B, L, DIM]
    for key in table:
        g = d_rows[IDS == key].sum(0)
        acc = init + g * g
        table[key] = table[key] - lr * g / np.sqrt(acc + 1e-7)

    e = layer.export()
    order = np.argsort(e["keys"])
    np.testing.assert_array_equal(e["keys"][order], sorted(table))  # no -1 key
    np.testing.assert_allclose(e["values"][order], [table[int(k)] for k in e["keys"][order]],
                               rtol=1e-5, atol=1e-6)
    freqs = dict(zip(e["keys"].tolist(), e["freqs"].tolist()))
    assert freqs == {k: int((IDS == k).sum()) for k in table}


def test_without_pruning_minus_one_is_a_key():
    layer = EmbeddingVariable(DIM, combiner="sum", default_value_dim=DVD)
    inputs = keras.Input(shape=(IDS.shape[1],), dtype="int32")
    model = keras.Model(inputs, layer(inputs))
    model.compile(optimizer=optimizers.SGD(0.1), loss="mse")
    model.fit(IDS, np.zeros((len(IDS), DIM), np.float32), batch_size=len(IDS), verbose=0)
    assert sorted(layer.export()["keys"].tolist()) == sorted(np.unique(IDS).tolist())


def test_combiner_config_round_trips_and_bad_arguments_are_refused():
    layer = EmbeddingVariable(DIM, combiner="sqrtn", prune_invalid_ids=True)
    again = EmbeddingVariable.from_config(layer.get_config())
    assert (again.combiner, again.prune_invalid_ids) == ("sqrtn", True)
    with pytest.raises(ValueError, match="`combiner` must be None or one of.*combiner='max'"):
        EmbeddingVariable(DIM, combiner="max")
    with pytest.raises(TypeError, match="`prune_invalid_ids` must be a bool.*=1"):
        EmbeddingVariable(DIM, combiner="sum", prune_invalid_ids=1)
    with pytest.raises(ValueError, match="needs a `combiner`.*combiner=None"):
        EmbeddingVariable(DIM, prune_invalid_ids=True)
