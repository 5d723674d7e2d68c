"""The distinct-key apply (`KRE>TableSparseApplyDistinct`, and for several
tables `KRE>GroupSparseApplyDistinct`).

A table gradient of the group lookup (its keys: the forward's distinct ids)
or of a `tf.unique` takes the apply that skips the dedupe, in a traced step
(the step's tables in one op).
It must train exactly as the general apply (`KRE>TableSparseApply`, taken by
the same step run eagerly): values, slots, frequencies, versions, filtered
keys; and as a NumPy Adagrad. Tables are shared by two features, so a key
repeats across features (and rows) of one table.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import optimizer as base

DIM, BATCH, STEPS = 4, 6, 4
rng = np.random.default_rng(3)
# Features 0 and 1 read table A (keys 0-8: many repeats within and across
# features), feature 2 table B (keys 0-59: a few repeats, some keys seen
# once, never admitted by a CounterFilter(2)).
VOCAB = (9, 9, 60)
IDS = [[tf.ragged.constant(rng.integers(0, v, (BATCH, 3)).tolist(), dtype=tf.int64)
        for v in VOCAB] for _ in range(STEPS)]
# The loss is linear in the rows: sum over features and rows of out . W.
W = [rng.normal(size=(BATCH, DIM)).astype(np.float32) for _ in range(3)]

OPTIMIZERS = {
    "sgd": lambda: kre.optimizers.SGD(0.1),
    "momentum": lambda: kre.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adagrad": lambda: kre.optimizers.Adagrad(0.1),
    "adam": lambda: kre.optimizers.Adam(0.02, amsgrad=True, weight_decay=0.01),
    "ftrl": lambda: kre.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                        l2_shrinkage_regularization_strength=0.01),
    "adam_async": lambda: kre.optimizers.AdamAsync(0.02),
    "adagrad_decay": lambda: kre.optimizers.AdagradDecay(0.1, accumulator_decay_step=2),
    "adamw": lambda: kre.optimizers.AdamW(0.1, learning_rate=0.02),
}


def make_tables(filtered):
    def ev(name):
        option = kre.EmbeddingVariableOption(
            filter_option=kre.CounterFilter(2) if filtered else None, track_meta=True)
        layer = kre.layers.EmbeddingVariable(
            DIM, initializer=tf.keras.initializers.RandomUniform(-1, 1, seed=1),
            ev_option=option, name=name)
        layer.build()
        return layer

    return ev("a"), ev("b")


def loss_fn(tables, ids):
    a, b = tables
    outs = kre.ops.group_embedding_lookup_sparse([a, a, b], ids, "sum", training=True)
    return sum(tf.reduce_sum(o * w) for o, w in zip(outs, W))


def train(make_optimizer, filtered, traced):
    tables = make_tables(filtered)
    variables = [t.table.variable for t in tables]
    opt = make_optimizer()
    opt.build(variables)

    def step(ids):
        with tf.GradientTape() as tape:
            loss = loss_fn(tables, ids)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    run = tf.function(step) if traced else step
    for ids in IDS:
        run(ids)
    ops = ({op.type for op in run.get_concrete_function(IDS[0]).graph.get_operations()}
           if traced else set())
    return [t.export() for t in tables], ops


def assert_same_state(got, want):
    for g, w in zip(got, want):
        order_g, order_w = np.argsort(g["keys"]), np.argsort(w["keys"])
        np.testing.assert_array_equal(g["keys"][order_g], w["keys"][order_w])
        for part in ("values", "freqs", "versions"):
            np.testing.assert_array_equal(g[part][order_g], w[part][order_w], err_msg=part)
        assert set(g["slots"]) == set(w["slots"])
        for name in g["slots"]:
            np.testing.assert_array_equal(g["slots"][name][order_g],
                                          w["slots"][name][order_w], err_msg=name)
        fg, fw = np.argsort(g["keys_filtered"]), np.argsort(w["keys_filtered"])
        np.testing.assert_array_equal(g["keys_filtered"][fg], w["keys_filtered"][fw])
        np.testing.assert_array_equal(g["freqs_filtered"][fg], w["freqs_filtered"][fw])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_distinct_apply_equals_general_apply(name):
    filtered = name in ("adagrad", "adam")
    traced, ops = train(OPTIMIZERS[name], filtered, traced=True)
    # Both tables' distinct keys in one op (KRE>GroupSparseApplyDistinct).
    assert "KRE>GroupSparseApplyDistinct" in ops
    assert not ops & {"KRE>TableSparseApply", "KRE>TableSparseApplyDistinct"}
    eager, _ = train(OPTIMIZERS[name], filtered, traced=False)
    assert len(eager[0]["keys"]) > 0
    assert eager[0]["versions"].max() == STEPS - 1 and eager[0]["freqs"].min() > 0
    if filtered:
        assert len(eager[1]["keys_filtered"]) > 0  # some keys never admitted
    assert_same_state(traced, eager)


def test_distinct_apply_matches_numpy_adagrad():
    lr, eps, init = 0.1, 1e-7, 0.1
    tables = make_tables(False)
    sizes = (VOCAB[0], VOCAB[2])
    rows = []
    for table, size in zip(tables, sizes):  # every key present, with known rows
        start = rng.normal(size=(size, DIM)).astype(np.float32)
        table.import_({"keys": np.arange(size, dtype=np.int64), "values": start})
        rows.append(start.copy())
    variables = [t.table.variable for t in tables]
    opt = kre.optimizers.Adagrad(lr, initial_accumulator_value=init, epsilon=eps)
    opt.build(variables)
    acc = [np.full((size, DIM), init, np.float32) for size in sizes]
    step = tf.function(lambda ids: opt.apply_gradients(zip(
        _grads(tables, variables, ids), variables)))
    for ids in IDS:
        step(ids)
        grads = [np.zeros((size, DIM), np.float32) for size in sizes]
        touched = [set(), set()]
        for f, t in enumerate((0, 0, 1)):
            for b, row in enumerate(ids[f].to_list()):
                for key in row:
                    grads[t][key] += W[f][b]
                    touched[t].add(key)
        for t in range(2):
            for key in touched[t]:  # rows not in the batch are not updated
                g = grads[t][key]
                acc[t][key] += g * g
                rows[t][key] -= lr * g / np.sqrt(acc[t][key] + eps)
    assert opt.iterations.numpy() == STEPS
    for t, table in enumerate(tables):
        got = table.export()
        order = np.argsort(got["keys"])
        np.testing.assert_array_equal(got["keys"][order], np.arange(sizes[t]))
        np.testing.assert_allclose(got["values"][order], rows[t], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["slots"]["accumulator"][order], acc[t], rtol=1e-5)
        assert got["versions"].max() == STEPS - 1


def _grads(tables, variables, ids):
    with tf.GradientTape() as tape:
        loss = loss_fn(tables, ids)
    return tape.gradient(loss, variables)


def test_has_distinct_keys_only_for_known_ops():
    ids = tf.constant([3, 1, 3], tf.int64)
    rows = tf.ones([3, DIM])

    @tf.function
    def kinds():
        unique, _ = tf.unique(ids)
        return (base.has_distinct_keys(tf.IndexedSlices(rows[:2], unique)),
                base.has_distinct_keys(tf.IndexedSlices(rows, ids + 0)))

    assert kinds() == (True, False)
    # Eager tensors: unknown, the general apply.
    assert not base.has_distinct_keys(tf.IndexedSlices(rows[:2], tf.unique(ids)[0]))


def test_group_lookup_keys_are_distinct_in_training_only():
    """A training group lookup's unique_ids (named by its registration) are
    distinct; an inference lookup's may list every id (the pooled path), so
    a gradient of one is applied with the dedupe."""
    table = kre.layers.EmbeddingVariable(DIM)
    table.build()
    ids = tf.ragged.constant([[3, 1], [3]], dtype=tf.int64)

    @tf.function
    def keys(training):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(kre.ops.group_embedding_lookup_sparse(
                [table], [ids], "sum", training=training)[0])
        grad, = tape.gradient(loss, [table.table.variable])
        return base.has_distinct_keys(grad), grad.indices

    distinct, indices = keys(True)
    assert distinct and sorted(indices.numpy().tolist()) == [1, 3]
    distinct, indices = keys(False)
    assert not distinct and sorted(indices.numpy().tolist()) == [1, 3, 3]
