"""KRE>GroupSparseApplyDistinct: the fused update of several tables in one
op (their tables updated concurrently over the intra-op pool) is, table by
table, KRE>TableSparseApplyDistinct's update, bit for bit; and the
optimizers use it for a GroupEmbedding's tables."""

import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding

DIM = 4
HYPER = {"learning_rate": 0.3, "decay": 0.0, "epsilon": 1e-7}  # Adagrad's, in its order


def _tables(prefix, n, key_dtype="int64"):
    tables = []
    for i in range(n):
        t = EmbeddingTable(DIM, key_dtype, np.linspace(-1, 1, 5 * DIM, dtype=np.float32)
                           .reshape(5, DIM), name=f"{prefix}_{i}")
        t.add_slot("accumulator", 0.1, width=DIM)
        tables.append(t)
    return tables


def _step_inputs(rng, n, step, key_dtype="int64"):
    """Each table's distinct keys (several thousand: every shard has some)
    and their gradient rows."""
    keys, grads = [], []
    for i in range(n):
        k = rng.choice(20000, size=3000 + 500 * i, replace=False).astype(key_dtype)
        keys.append(tf.constant(k))
        grads.append(tf.constant(rng.normal(size=(k.size, DIM)).astype(np.float32)))
    return keys, grads


def _sorted_export(t):
    got = t.export()
    order = np.argsort(got["keys"])
    return {part: np.asarray(got[part])[order] for part in ("keys", "values", "versions",
                                                            "freqs")} | {
        "accumulator": np.asarray(got["slots"]["accumulator"])[order]}


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
def test_the_group_update_is_each_tables_own_update_bit_for_bit(key_dtype):
    rng = np.random.default_rng(3)
    grouped, alone = _tables(f"grouped_{key_dtype}", 3, key_dtype), _tables(
        f"alone_{key_dtype}", 3, key_dtype)
    for step in range(1, 4):
        keys, grads = _step_inputs(rng, 3, step, key_dtype)
        for t, k in zip(grouped + alone, keys + keys):
            t.lookup(k, insert=True)
        hypers = [dict(HYPER, learning_rate=0.3 / (i + 1)) for i in range(3)]
        _ops.group_sparse_apply([t.handle for t in grouped], keys, grads, "adagrad", hypers,
                                step, ["accumulator"])
        for t, k, g, h in zip(alone, keys, grads, hypers):
            _ops.sparse_apply(t.handle, k, g, "adagrad", h, step, ["accumulator"],
                              distinct=True)
    for a, b in zip(grouped, alone):
        want, got = _sorted_export(b), _sorted_export(a)
        for part in want:
            np.testing.assert_array_equal(got[part], want[part], err_msg=part)
    # The tables trained differently (each its own learning rate).
    assert not np.array_equal(_sorted_export(grouped[0])["values"],
                              _sorted_export(grouped[1])["values"])


@pytest.mark.parametrize("bad, message", [
    ("grads", r"table 1 of the group update: .*grads"),
    ("hyper", r"table 1 of the group update: rule 'adagrad' takes 3 hyper-parameters"),
    ("slot", r"table 1 of the group update: the embedding table has no optimizer slot "
             r"'accumulator'"),
])
def test_bad_input_names_the_table_and_updates_no_table(bad, message):
    tables = _tables(f"bad_{bad}", 2)
    if bad == "slot":
        tables[1] = EmbeddingTable(DIM, "int64", np.ones((1, DIM), np.float32),
                                   name="bad_slot_none")
    keys = [tf.constant([1, 2, 3], tf.int64)] * 2
    grads = [tf.ones((3, DIM))] * 2
    hypers = [HYPER, HYPER]
    if bad == "grads":
        grads = [grads[0], tf.ones((2, DIM))]
    for t in tables:
        t.lookup(keys[0], insert=True)
    before = tables[0].export()["values"]
    handles = [t.handle for t in tables]
    if bad == "hyper":
        values = [tf.constant([0.1, 0.0, 1e-7]), tf.constant([0.1, 0.0])]
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            _ops.gen().kre_group_sparse_apply_distinct(
                handles, keys, grads, values, tf.constant(1, tf.int64), rule="adagrad",
                slots=["accumulator"], hparam_names=list(HYPER))
    else:
        with pytest.raises((tf.errors.InvalidArgumentError, tf.errors.FailedPreconditionError),
                           match=message):
            _ops.group_sparse_apply(handles, keys, grads, "adagrad", hypers, 1, ["accumulator"])
    np.testing.assert_array_equal(tables[0].export()["values"], before)


def test_a_table_of_the_other_key_dtype_is_refused():
    tables = _tables("dtype_a", 1) + _tables("dtype_b", 1, "int32")
    keys = [tf.constant([1, 2], tf.int64)] * 2
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="table 1 has key dtype int32 but the op was given int64 keys"):
        _ops.group_sparse_apply([t.handle for t in tables], keys, [tf.ones((2, DIM))] * 2,
                                "adagrad", [HYPER, HYPER], 1, ["accumulator"])


def test_a_group_embedding_step_updates_its_tables_in_one_op():
    layer = GroupEmbedding({f"f{i}": FeatureSpec(EmbeddingVariable(DIM, name=f"one_op_{i}"))
                            for i in range(3)})
    optimizer = kre.optimizers.Adagrad(0.1)
    ids = {f"f{i}": tf.ragged.constant([[1, 2], [3]], tf.int64) for i in range(3)}

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(o) for o in layer(ids, training=True).values()])
        variables = layer.trainable_variables
        optimizer.apply(tape.gradient(loss, variables), variables)

    step()
    graph = step.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("KRE>GroupSparseApplyDistinct") == 1
    assert "KRE>TableSparseApplyDistinct" not in types
