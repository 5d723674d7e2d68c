"""`ops.safe_embedding_lookup_multi_dim`: ids `[d0, ..., dk]` combined along
several axes, one combiner each. Against DeepRec's own test numbers, an
independent NumPy reference (random ids, every combiner, weights on each
axis), its gradient, and bad input."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb import ops

# DeepRec's test_safe_embedding_lookup_sparse_multidim: every row of the
# parameter is [1, 1]; ids [3, 3, 3] with these indices and weights.
DEEPREC_INDICES = [[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 2],
                   [2, 0, 0]]
DEEPREC_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
DEEPREC_WEIGHTS = [1., 2., 0.5, 1., 2., 3., 4., 0.1]
# (combiners, weight_axis, weighted, DeepRec's expected output)
DEEPREC_CASES = [
    (["mean", "sum"], 2, True, [[1.75, 1.75], [5, 5], [0.1, 0.1]]),
    (["min", "max"], 2, True, [[0.5, 0.5], [1.0, 1.0], [0.1, 0.1]]),
    (["sqrtn", "sum"], 1, True, [[2.214, 2.214], [3.162, 3.162], [1., 1.]]),
    (["mean", "max"], 2, False, [[1., 1.], [1., 1.], [1., 1.]]),
    (["tile", "sum"], 2, True, [[3., 3., 0.5, 0.5, 0., 0.], [1., 1., 9., 9., 0., 0.],
                                [0.1, 0.1, 0., 0., 0., 0.]]),
    (["mean", "tile"], 1, True, [[0.75, 0.75, 1., 1., 0., 0.],
                                 [0.75, 0.75, 0.75, 0.75, 1., 1.],
                                 [1., 1., 0., 0., 0., 0.]]),
    (["sum"], 2, True, [[[3., 3.], [0.5, 0.5], [0., 0.]], [[1., 1.], [9., 9.], [0., 0.]],
                        [[0.1, 0.1], [0., 0.], [0., 0.]]]),
]


def _deeprec_sparse(values, dtype):
    return tf.SparseTensor(tf.constant(DEEPREC_INDICES, tf.int64), tf.constant(values, dtype),
                           tf.constant([3, 3, 3], tf.int64))


def _ones_param(kind):
    if kind == "dense":
        return keras.Variable(np.ones((13, 2), np.float32))
    table = kre.layers.EmbeddingVariable(2, initializer="ones")
    table.build()
    return table


@pytest.mark.parametrize("kind", ["dense", "table"])
@pytest.mark.parametrize("combiners,weight_axis,weighted,want", DEEPREC_CASES,
                         ids=["-".join(c[0]) for c in DEEPREC_CASES])
def test_matches_deeprec_test_numbers(kind, combiners, weight_axis, weighted, want):
    param = _ones_param(kind)
    weights = _deeprec_sparse(DEEPREC_WEIGHTS, tf.float32) if weighted else None
    got = ops.safe_embedding_lookup_multi_dim(param, _deeprec_sparse(DEEPREC_IDS, tf.int32),
                                              weights, combiners=combiners,
                                              weight_axis=weight_axis)
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-3, atol=1e-3)


def _numpy_multi_dim(rows, shape, entries, combiners, weight_axis, weighted, prune,
                     max_norm=None):
    """An independent reference: `entries` [(index tuple, id, weight)];
    each id's row (clipped to max_norm) times its weight; then axis by axis
    from the innermost, the present children of each entry combined."""
    k = len(shape) - 1
    first = k - len(combiners) + 1
    if prune:
        entries = [e for e in entries
                   if e[1] >= 0 and (not weighted or "sum" in combiners or e[2] > 0)]
    dim = rows.shape[1]

    def row(i):
        r = rows[i].astype(np.float64)
        if max_norm:
            n = np.linalg.norm(r)
            r = r * (max_norm / n if n > max_norm else 1.0)
        return r

    def combine(children, combiner, size, use_w):
        vecs = np.array([c[1] for c in children])
        ws = np.array([c[2] for c in children], np.float64)
        if combiner == "tile":
            out = np.zeros(size * vecs.shape[1])
            for pos, v, _ in children:
                out[pos * len(v):(pos + 1) * len(v)] = v
            value = out
        elif combiner == "max":
            value = vecs.max(0)
        elif combiner == "min":
            value = vecs.min(0)
        else:
            value = vecs.sum(0)
            if combiner != "sum":
                denom = (ws.sum() if combiner == "mean" else (ws * ws).sum()) if use_w \
                    else float(len(children))
                denom = np.sqrt(denom) if combiner == "sqrtn" else denom
                value = value / denom if denom else value * 0
        return value, ws.mean()

    level = {}
    for idx, i, w in entries:
        level.setdefault(tuple(idx[:k]), []).append((idx[k], row(i) * (w if weighted else 1), w))
    cur = {p: combine(ch, combiners[-1], shape[k], weighted and weight_axis == k)
           for p, ch in level.items()}
    width = dim
    if combiners[-1] == "tile":
        width *= shape[k]
    for a in range(k - 1, first - 1, -1):
        up = {}
        for prefix, (v, w) in cur.items():
            up.setdefault(prefix[:a], []).append((prefix[a], v, w))
        combiner = combiners[a - first]
        cur = {p: combine(ch, combiner, shape[a], weighted and weight_axis == a)
               for p, ch in up.items()}
        if combiner == "tile":
            width *= shape[a]
    out = np.zeros(tuple(shape[:first]) + (width,))
    for prefix, (v, _) in cur.items():
        out[prefix] = v
    return out


def _random_case(rng, shape, vocab, density, negative=0.1):
    dense = rng.random(shape) < density
    index = np.argwhere(dense)
    ids = rng.integers(0, vocab, len(index))
    ids[rng.random(len(index)) < negative] = -1
    weights = rng.choice([-0.5, 0.0, 0.3, 1.0, 2.5], len(index)).astype(np.float32)
    return index, ids, weights


COMBINER_SETS = [
    ["sum", "mean"], ["mean", "sqrtn"], ["sqrtn", "mean"], ["max", "min"], ["tile", "mean"],
    ["mean", "tile"], ["min", "sum"], ["sum"], ["mean"], ["sum", "mean", "sqrtn"],
    ["tile", "max", "mean"], ["mean", "sum", "tile"],
]


@pytest.mark.parametrize("combiners", COMBINER_SETS, ids=["-".join(c) for c in COMBINER_SETS])
@pytest.mark.parametrize("weighted,weight_axis", [(False, 1), (True, 1), (True, -1)],
                         ids=["unweighted", "weights_outer", "weights_inner"])
@pytest.mark.parametrize("kind", ["dense", "table"])
def test_matches_numpy(combiners, weighted, weight_axis, kind):
    rng = np.random.default_rng(len(combiners) * 7 + weight_axis + 3)
    shape = (6, 3, 4) if len(combiners) < 3 else (5, 3, 2, 4)
    index, ids, weights = _random_case(rng, shape, 20, 0.45)
    rows = rng.normal(size=(20, 3)).astype(np.float32)
    if kind == "dense":
        param = keras.Variable(rows)
    else:  # rows of keys 0..19 from the initializer (default_value_dim 20)
        param = kre.layers.EmbeddingVariable(
            3, initializer=keras.initializers.Constant(rows),
            ev_option=kre.EmbeddingVariableOption(
                init_option=kre.InitializerOption(default_value_dim=20)))
        param.build()
    sp_ids = tf.SparseTensor(index, ids, shape)
    sp_w = tf.SparseTensor(index, weights, shape) if weighted else None
    got = ops.safe_embedding_lookup_multi_dim(param, sp_ids, sp_w, combiners=combiners,
                                              weight_axis=weight_axis)
    want = _numpy_multi_dim(rows, shape, list(zip(index.tolist(), ids.tolist(),
                                                  weights.tolist())),
                            combiners, weight_axis % len(shape), weighted, True)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiners", [["mean", "sum"], ["max", "mean"]])
def test_ragged_ids_max_norm_and_no_prune(combiners):
    """Ragged ids give what their sparse form gives; max_norm clips rows
    first; without `prune`, weights <= 0 are kept (ids < 0 are keys of a
    table)."""
    rng = np.random.default_rng(9)
    rows = rng.normal(size=(12, 4)).astype(np.float32) * 3
    param = keras.Variable(rows)
    ragged = tf.ragged.constant([[[1, 2], [3]], [[4, 5, 6]], [[], [7, 8]]], dtype=tf.int64)
    weights = tf.ragged.constant([[[1.0, -2.0], [0.5]], [[1.0, 2.0, 0.0]], [[], [3.0, 1.0]]])
    sp = ragged.to_sparse()
    entries = list(zip(sp.indices.numpy().tolist(), sp.values.numpy().tolist(),
                       weights.to_sparse().values.numpy().tolist()))
    shape = sp.dense_shape.numpy().tolist()
    for prune in (True, False):
        got = ops.safe_embedding_lookup_multi_dim(param, ragged, weights, combiners=combiners,
                                                  max_norm=2.0, weight_axis=2, prune=prune)
        want = _numpy_multi_dim(rows, shape, entries, combiners, 2, True, prune, max_norm=2.0)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_gradient_and_training_inserts():
    """With `training` a table inserts the ids; the gradient of sum(out * W)
    for ["sum", "sum"] is, per key, the sum of W's rows of its entries times
    their weights (NumPy); keys are the table's."""
    table = kre.layers.EmbeddingVariable(2, initializer="ones")
    table.build()
    ids = tf.SparseTensor([[0, 0, 0], [0, 1, 0], [0, 1, 1], [1, 0, 2]], tf.constant(
        [5, 7, 5, 9], tf.int64), [2, 2, 3])
    weights = tf.SparseTensor(ids.indices, [1.0, 2.0, 0.5, 3.0], ids.dense_shape)
    target = np.array([[1.0, -1.0], [2.0, 0.5]], np.float32)
    with tf.GradientTape() as tape:
        out = ops.safe_embedding_lookup_multi_dim(table, ids, weights, combiners=["sum", "sum"],
                                                  training=True)
        loss = tf.reduce_sum(out * target)
    grad = tape.gradient(loss, table.table.variable)
    assert table.table_size() == 3
    by_key = {}
    for k, v in zip(grad.indices.numpy().tolist(), grad.values.numpy()):
        by_key[k] = by_key.get(k, 0) + v
    np.testing.assert_allclose(by_key[5], target[0] * (1.0 + 0.5))
    np.testing.assert_allclose(by_key[7], target[0] * 2.0)
    np.testing.assert_allclose(by_key[9], target[1] * 3.0)


def test_traced_and_empty():
    """Traced with unknown dense shape values, and with no ids at all
    (zeros of the output's shape)."""
    param = keras.Variable(np.ones((4, 2), np.float32))

    @tf.function
    def lookup(indices, values):
        sp = tf.SparseTensor(indices, values, tf.constant([3, 2, 2], tf.int64))
        return ops.safe_embedding_lookup_multi_dim(param, sp, combiners=["tile", "sum"])

    got = lookup(tf.constant([[1, 1, 0]], tf.int64), tf.constant([2], tf.int64))
    np.testing.assert_array_equal(got.numpy(), [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    empty = lookup(tf.zeros([0, 3], tf.int64), tf.zeros([0], tf.int64))
    np.testing.assert_array_equal(empty.numpy(), np.zeros((3, 4)))


def test_bad_input():
    param = keras.Variable(np.ones((4, 2), np.float32))
    sp = _deeprec_sparse(DEEPREC_IDS, tf.int64)
    with pytest.raises(ValueError, match="combiners.*'median'"):
        ops.safe_embedding_lookup_multi_dim(param, sp, combiners=["median", "sum"])
    with pytest.raises(ValueError, match="non-empty list"):
        ops.safe_embedding_lookup_multi_dim(param, sp, combiners=[])
    with pytest.raises(ValueError, match="rank of at least len\\(combiners\\) \\+ 1 = 4"):
        ops.safe_embedding_lookup_multi_dim(param, sp, combiners=["sum", "sum", "sum"])
    with pytest.raises(ValueError, match="weight_axis.*\\[1, 2\\].*weight_axis=0"):
        ops.safe_embedding_lookup_multi_dim(param, sp, combiners=["sum"], weight_axis=0)
    with pytest.raises(ValueError, match="weight_axis=3"):
        ops.safe_embedding_lookup_multi_dim(param, sp, combiners=["sum"], weight_axis=3)
    with pytest.raises(TypeError, match="sp_ids.*SparseTensor"):
        ops.safe_embedding_lookup_multi_dim(param, tf.zeros([2, 2], tf.int64))
    with pytest.raises(TypeError, match="prune"):
        ops.safe_embedding_lookup_multi_dim(param, sp, prune="yes")
    with pytest.raises(ValueError, match="max_norm"):
        ops.safe_embedding_lookup_multi_dim(param, sp, max_norm=-1.0)
    with pytest.raises(TypeError, match="sp_ids.*integer"):
        ops.safe_embedding_lookup_multi_dim(param, tf.SparseTensor([[0, 0]], [1.5], [1, 1]))
    fewer = tf.SparseTensor(DEEPREC_INDICES[:3], [1.0, 1.0, 1.0], [3, 3, 3])
    with pytest.raises(ValueError, match="sp_weights.*indices of `sp_ids`"):
        ops.safe_embedding_lookup_multi_dim(param, sp, fewer, combiners=["mean", "mean"])
