"""`EmbeddingVariable(combiner=...)(ids, weights=...)` under TensorFlow: the
JAX layer's per-id weights (sum: sum(w * row); mean: / sum(w); sqrtn:
/ sqrt(sum(w**2)); mean and sqrtn drop ids of weight <= 0), against NumPy,
for dense, ragged and sparse ids, in training and with its errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre

DIM = 3
ROWS = np.arange(8 * DIM, dtype=np.float32).reshape(8, DIM) / 5.0 - 2.0
IDS = np.array([[0, 1, -1], [2, 2, 3], [-1, -1, -1], [4, 5, 6], [7, 1, 0]], np.int64)
W = np.array([[1.0, 2.0, 9.0], [0.5, -1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, -2.0],
              [3.0, 0.5, 0.25]], np.float32)


def numpy_combine(ids, weights, combiner):
    out = np.zeros((len(ids), DIM))
    for b, (row, w) in enumerate(zip(ids, weights)):
        keep = [(i, x) for i, x in zip(row, w) if i >= 0 and (combiner == "sum" or x > 0)]
        total = sum((x * ROWS[i] for i, x in keep), np.zeros(DIM))
        denom = {"sum": 1.0, "mean": sum(x for _, x in keep),
                 "sqrtn": np.sqrt(sum(x * x for _, x in keep))}[combiner]
        out[b] = total / denom if denom > 0 else 0.0
    return out


def _layer(combiner, **kwargs):
    layer = kre.layers.EmbeddingVariable(DIM, combiner=combiner, prune_invalid_ids=True,
                                         **kwargs)
    layer.build()
    layer.table.import_({"keys": np.arange(8), "values": ROWS})
    return layer


def _kinds():
    mask = IDS >= 0
    lengths = mask.sum(1)
    ragged = (tf.RaggedTensor.from_row_lengths(IDS[mask], lengths),
              tf.RaggedTensor.from_row_lengths(W[mask], lengths))
    idx = np.argwhere(mask)
    sparse = (tf.SparseTensor(idx, IDS[mask], IDS.shape), tf.SparseTensor(idx, W[mask], W.shape))
    return {"dense": (IDS, W), "ragged": ragged, "sparse": sparse}


@pytest.mark.parametrize("kind", ["dense", "ragged", "sparse"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weighted_combine_matches_numpy(combiner, kind):
    ids, weights = _kinds()[kind]
    got = _layer(combiner)(ids, weights=weights)
    np.testing.assert_allclose(got.numpy(), numpy_combine(IDS, W, combiner), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_ids_of_weight_at_most_zero_are_not_inserted_for_mean_and_sqrtn(combiner):
    layer = kre.layers.EmbeddingVariable(DIM, combiner=combiner, prune_invalid_ids=True)
    layer(np.where(IDS >= 0, IDS + 100, -1), weights=W, training=True)
    inserted = sorted(layer.export()["keys"].tolist())
    keep = (IDS >= 0) & ((W > 0) | (combiner == "sum"))
    assert inserted == sorted(set((IDS[keep] + 100).tolist()))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_fit_trains_each_row_by_its_share(combiner):
    # loss = sum(out): a row's gradient is sum over its occurrences of
    # w / denominator (SGD, one step).
    layer = _layer(combiner)
    ids_in = keras.Input(shape=(3,), dtype="int64")
    w_in = keras.Input(shape=(3,), dtype="float32")
    model = keras.Model([ids_in, w_in], layer(ids_in, weights=w_in))
    model.compile(optimizer=kre.optimizers.SGD(0.1), loss=lambda _, y: tf.reduce_sum(y))
    model.fit([IDS, W], np.zeros((5, DIM)), batch_size=5, shuffle=False, verbose=0)
    grad = np.zeros(8)
    for row, w in zip(IDS, W):
        keep = [(i, x) for i, x in zip(row, w) if i >= 0 and (combiner == "sum" or x > 0)]
        denom = {"sum": 1.0, "mean": sum(x for _, x in keep),
                 "sqrtn": np.sqrt(sum(x * x for _, x in keep))}[combiner]
        for i, x in keep:
            grad[i] += x / denom if denom > 0 else 0.0
    data = layer.export()
    got = dict(zip(data["keys"].tolist(), data["values"]))
    for key in range(8):
        np.testing.assert_allclose(got[key], ROWS[key] - 0.1 * grad[key], rtol=1e-5,
                                   atol=1e-6, err_msg=key)


@pytest.mark.parametrize("make, kwargs, error, match", [
    (lambda: kre.layers.EmbeddingVariable(DIM), {}, ValueError, "need a `combiner`"),
    (lambda: kre.layers.EmbeddingVariable(DIM, combiner="mean"), {}, ValueError,
     "prune_invalid_ids=True.*prune_invalid_ids=False"),
    (lambda: kre.layers.EmbeddingVariable(DIM, combiner="sum"),
     {"weights": np.array([["a", "b", "c"]] * 5)}, TypeError, "must be numbers"),
    (lambda: kre.layers.EmbeddingVariable(DIM, combiner="sum"),
     {"weights": np.ones((5, 2), np.float32)}, ValueError, r"ids' shape \(5, 3\).*\(5, 2\)"),
    (lambda: kre.layers.EmbeddingVariable(DIM, combiner="sum"),
     {"weights": tf.ragged.constant([[1.0]] * 5)}, TypeError, "ids' kind.*RaggedTensor"),
])
def test_bad_weights_are_refused_by_name(make, kwargs, error, match):
    kwargs = kwargs or {"weights": W}
    with pytest.raises(error, match=match):
        make()(IDS, **kwargs)
