"""Bad inputs that used to crash the process: each one, through the
public API or the raw ops, gets a clear error instead of killing the process.
Every case runs in a child process (tests/_isolated.py), so a crash fails
its case rather than pytest."""

import pytest

from tests._isolated import run_cases

PRELUDE = """
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable
gen = _ops.gen()
ADAM = ['learning_rate', 'decay', 'alpha', 'beta_1', 'beta_2', 'epsilon', 'amsgrad']

def table(dim=4, key_dtype="int64", **kw):
    return EmbeddingTable(dim, key_dtype, np.zeros((2, dim), np.float32), num_shards=4, **kw)

def ev(**kw):
    layer = kre.layers.EmbeddingVariable(4, **kw)
    layer.build()
    return layer

def filled(dim=4):
    t = table(dim)
    t.lookup(tf.constant([1, 2, 3], tf.int64), insert=True)
    return t

def group_attrs(num_features=1, combiner="sum", sequence=False, grad=False):
    a = {} if grad else dict(num_params=1)
    return dict(a, table_key_dtypes=[tf.int64], param_dims=[4],
                feature_params=[0] * num_features, combiners=[combiner] * num_features,
                max_norms=[0.0] * num_features, default_ids=[-1] * num_features,
                prune_invalid_ids=[True] * num_features, is_sequence=[sequence] * num_features)

def parts(t, **over):
    p = t._export_parts()
    p.update(over)
    return p

evicting = kre.EmbeddingVariableOption(evict_option=kre.GlobalStepEvict(2))
"""

# (name, code, substring the error message must contain)
CRASHES = [
    # 1. Scalars read without checking their shape.
    ("evict_step_vector", "ev(ev_option=evicting).evict(step=np.array([3, 4]))", "step"),
    ("evict_step_empty", "ev(ev_option=evicting).evict(step=np.zeros([0], np.int64))", "step"),
    ("raw_evict_vectors", "gen.kre_table_evict(table().handle, [1, 2], [3], [1.0, 2.0], "
                          "Tkeys=tf.int64)", "step"),
    ("add_slot_names_vector", "table().add_slot(['a', 'b'])", "slot_name"),
    ("add_slot_empty_name", "gen.kre_table_add_slot(table().handle, tf.zeros([0], tf.string), "
                            "tf.constant(4, tf.int64), 0.0, Tkeys=tf.int64)", "slot_name"),
    ("add_slot_width_vector", "gen.kre_table_add_slot(table().handle, 'a', "
                              "tf.constant([4, 4], tf.int64), 0.0, Tkeys=tf.int64)", "width"),
    ("add_slot_init_empty", "gen.kre_table_add_slot(table().handle, 'a', "
                            "tf.constant(4, tf.int64), tf.zeros([0]), Tkeys=tf.int64)", "init"),
    ("sparse_apply_step_vector", "gen.kre_table_sparse_apply(table().handle, tf.constant([1], tf.int64), [[1.0] * 4], "
                                 "[0.1, 0.0], [1, 2], rule='sgd', slots=[], "
                                 "hparam_names=['learning_rate', 'decay'])", "step"),
    # 2. Ragged row_splits trusted.
    ("ragged_splits_lookup_sparse",
     "ids = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), "
     "tf.constant([0, 10**6, 3], tf.int64), validate=False)\n"
     "kre.ops.embedding_lookup_sparse(ev(), ids, combiner='sum')", "row_splits"),
    ("ragged_splits_dense_param",
     "ids = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), "
     "tf.constant([0, 10**6, 3], tf.int64), validate=False)\n"
     "kre.ops.embedding_lookup_sparse(keras.Variable(np.eye(4, dtype='float32')), ids, "
     "combiner='sum')", "row_splits"),
    ("ragged_splits_group_embedding",
     "g = kre.layers.GroupEmbedding({'a': kre.layers.FeatureSpec({'embedding_dim': 4})})\n"
     "ids = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), "
     "tf.constant([0, 10**6, 3], tf.int64), validate=False)\n"
     "g({'a': ids})", "row_splits"),
    ("ragged_splits_decreasing_tail",
     "ids = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), "
     "tf.constant([0, 3, 1, 3], tf.int64), validate=False)\n"
     "kre.ops.embedding_lookup_sparse(ev(), ids, combiner='mean')", "row_splits"),
    ("ragged_splits_negative",
     "ids = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), "
     "tf.constant([0, -5, 3], tf.int64), validate=False)\n"
     "kre.ops.embedding_lookup_sparse(ev(), ids, combiner='sum')", "row_splits"),
    # 3. Group ops with inconsistent inputs.
    ("group_splits_past_ids",
     "t = table()\n"
     "gen.kre_group_lookup([t.handle], [], [[1, 2]], [[0, 5, 2]], [[]], **group_attrs())",
     "row_splits"),
    ("group_weights_short",
     "t = table()\n"
     "gen.kre_group_lookup([t.handle], [], [[1, 2, 3]], [[0, 3]], [[1.0]], **group_attrs())",
     "weights"),
    ("group_grad_unique_ids_rank",
     "t = table()\n"
     "gen.kre_group_lookup_grad([t.handle], [], [[1, 2]], [[0, 2]], [[]], "
     "[[[1, 2]]], [[0, 1]], [[[1.0] * 4]], **group_attrs(grad=True))", "unique_ids"),
    ("group_grad_bad_splits",
     "t = table()\n"
     "gen.kre_group_lookup_grad([t.handle], [], [[1, 2]], [[0, 7, 2]], [[]], "
     "[[1, 2]], [[0, 1]], [[[1.0] * 4] * 2], **group_attrs(grad=True))", "row_splits"),
    ("group_grad_inverse_type_rank",
     "t = table()\n"
     "gen.kre_group_lookup_grad([t.handle], [], [[1, 2]], [[0, 2]], [[]], "
     "[[1, 2]], [[[0, 1]]], [[[1.0] * 4]], **group_attrs(grad=True))", "inverse"),
    ("group_dense_ids_out_of_range",
     "gen.kre_group_lookup([], [np.eye(4, dtype='float32')], [[1, 99]], [[0, 2]], [[]], "
     "**dict(group_attrs(), table_key_dtypes=[]))", "out of range"),
    # 4. Import of a checkpoint naming one slot twice, and other bad parts.
    ("import_duplicate_slot",
     "t = filled()\n"
     "p = parts(t, slot_values=np.zeros((3, 8), np.float32), "
     "slot_names=tf.constant(['m', 'm']), slot_widths=np.array([4, 4], np.int64))\n"
     "t._import_parts(p)", "slot"),
    ("import_huge_slot_width",
     "t = filled()\n"
     "p = parts(table(), slot_values=np.zeros((0, 2**40), np.float32), "
     "slot_names=tf.constant(['m']), slot_widths=np.array([2**40], np.int64))\n"
     "t._import_parts(p)", "slot_widths"),
    ("import_slot_width_overflow",
     "t = filled()\n"
     "p = parts(t, slot_values=np.zeros((3, 4), np.float32), "
     "slot_names=tf.constant(['a', 'b']), slot_widths=np.array([2**62, 2**62 + 4], np.int64))\n"
     "t._import_parts(p)", "slot_widths"),
    ("import_names_not_vector",
     "t = filled()\n"
     "p = parts(t, slot_names=tf.constant([['m']]), slot_widths=np.array([[4]], np.int64))\n"
     "t._import_parts(p)", "slot_names"),
    # 5. Adam with amsgrad but no velocity_hat slot.
    ("adam_amsgrad_missing_slot",
     "t = table()\n"
     "t.add_slot('momentum'); t.add_slot('velocity')\n"
     "gen.kre_table_sparse_apply(t.handle, tf.constant([1], tf.int64), [[1.0] * 4], [0.1, 0, 0.1, 0.9, 0.99, 1e-7, 1], "
     "tf.constant(1, tf.int64), rule='adam', slots=['momentum', 'velocity'], "
     "hparam_names=ADAM)", "amsgrad"),
    # Huge sizes name the argument instead of reporting std::bad_alloc (a
    # Bloom filter's counters are reserved, not committed: 2**52 keys size
    # 306 PiB, more address space than a 57-bit machine has).
    ("cbf_huge", "ev(ev_option=kre.EmbeddingVariableOption(filter_option=kre.CBFFilter("
                 "3, max_element_size=2**52, false_positive_probability=0.01)))",
     "max_element_size"),
    ("cbf_beyond_int64", "ev(ev_option=kre.EmbeddingVariableOption(filter_option=kre.CBFFilter("
                         "3, max_element_size=2**62, false_positive_probability=0.001)))",
     "max_element_size"),
    ("add_slot_huge_width", "table().add_slot('big', width=2**40)", "width"),
    # 2 (served): the stock lookup of export_for_serving checks row splits too.
    ("serving_stock_bad_splits", """
from keras_rec_emb.ops.embedding_ops import _Param, stock_group_lookup
t = filled()
@tf.function(input_signature=[tf.TensorSpec([None], tf.int64)] * 2)
def f(ids, splits):
    return stock_group_lookup([_Param(table=t)], [ids], [splits], [tf.zeros([0])],
                              ['mean'], [None], [None], [True], [False],
                              stock_table=lambda table: table)
f(tf.constant([1, 2, 3], tf.int64), tf.constant([0, 10**6, 3], tf.int64))
""", "row_splits"),
    ("serving_stock_short_splits", """
from keras_rec_emb.ops.embedding_ops import _Param, stock_group_lookup
t = filled()
@tf.function(input_signature=[tf.TensorSpec([None], tf.int64)] * 2)
def f(ids, splits):
    return stock_group_lookup([_Param(table=t)], [ids], [splits], [tf.zeros([0])],
                              ['sum'], [None], [0], [True], [False],
                              stock_table=lambda table: table)
f(tf.constant([1, 2, 3], tf.int64), tf.constant([0, 1], tf.int64))
""", "row_splits"),
    # 6. Arbitrary addresses to the Arrow op.
    ("arrow_arbitrary_address",
     "gen.kre_arrow_batch_to_tensors(tf.constant([12345678, 87654321], tf.int64), "
     "out_types=[tf.int64], ragged_ranks=[0], inner_ranks=[0], inner_shapes=[])",
     "not an Arrow batch"),
    ("arrow_null_address",
     "gen.kre_arrow_batch_to_tensors(tf.constant([0, 0], tf.int64), "
     "out_types=[tf.int64], ragged_ranks=[0], inner_ranks=[0], inner_shapes=[])",
     "not an Arrow batch"),
]


@pytest.fixture(scope="module")
def crash_results():
    return run_cases([(n, c) for n, c, _ in CRASHES], prelude=PRELUDE)


@pytest.mark.parametrize("name,code,needle", CRASHES, ids=[c[0] for c in CRASHES])
def test_bad_input_is_a_clear_error(crash_results, name, code, needle):
    r = crash_results[name]
    assert r["outcome"] == "error", f"{name}: {r}"
    assert r["type"] in ("InvalidArgumentError", "ValueError", "TypeError",
                         "FailedPreconditionError", "ResourceExhaustedError"), r
    assert needle.lower() in r["message"].lower(), r["message"]


def test_shape_functions_reject_bad_ranks_when_a_graph_is_built():
    """In a tf.function the shape functions reject what they can before any
    kernel runs."""
    import numpy as np
    import tensorflow as tf

    from keras_rec_emb.backend.tensorflow import ops as _ops
    from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

    gen = _ops.gen()
    t = EmbeddingTable(4, "int64", np.zeros((1, 4), np.float32), num_shards=4)
    bad = {
        "step": lambda: gen.kre_table_evict(t.handle, tf.constant([1, 2], tf.int64),
                                            tf.constant(1, tf.int64), 0.0, Tkeys=tf.int64),
        "slot_name": lambda: gen.kre_table_add_slot(t.handle, tf.constant(["a", "b"]),
                                                    tf.constant(4, tf.int64), 0.0,
                                                    Tkeys=tf.int64),
        "keys": lambda: gen.kre_table_sparse_apply(
            t.handle, tf.constant([[1]], tf.int64), tf.ones([1, 4]), tf.constant([0.1, 0.0]),
            tf.constant(1, tf.int64), rule="sgd", slots=[],
            hparam_names=["learning_rate", "decay"]),
        "row_splits": lambda: gen.kre_group_lookup(
            [t.handle], [], [tf.constant([1], tf.int64)], [tf.constant([[0, 1]], tf.int64)],
            [tf.zeros([0])], num_params=1, table_key_dtypes=[tf.int64], param_dims=[4],
            feature_params=[0], combiners=["sum"], max_norms=[0.0], default_ids=[-1],
            prune_invalid_ids=[True], is_sequence=[False]),
    }
    for name, build in bad.items():
        with pytest.raises(ValueError, match="rank|Shape must be"):
            tf.function(build).get_concrete_function()
