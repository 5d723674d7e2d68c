"""`GroupEmbedding`'s forward under Keras's TensorFlow backend: ids as
dense, ragged or sparse tensors, the stacked form split by one op
(`KRE>UnstackFeatureIds` / `KRE>UnstackKeptIds`), and every feature looked
up in one fused op (`embedding_ops.group_embedding_lookup_sparse`, or
`KRE>StackedPooledLookup` for an inference call on stacked ids)."""

import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context
from keras_rec_emb.backend.tensorflow import variables
from keras_rec_emb.backend.tensorflow.checks import assert_ids_in_range, checked, integer_ids
from keras_rec_emb.backend.tensorflow.ids import FlatIds
from keras_rec_emb.ops import embedding_ops

count_params = variables.count_params  # tables count (ids admitted) x dim


def ids_input_dtype():
    return "int64"


def prepare_inputs(layer, inputs):
    """The inputs as given: TensorFlow checks ids in the op."""
    return inputs


def _feature_inputs(layer, inputs):
    names = list(layer.features)
    if isinstance(inputs, dict):
        ids, weights = layer.dict_inputs(inputs)
        return list(ids), list(weights)
    layer.refuse_weight_features()
    if isinstance(inputs, (list, tuple)):
        if len(inputs) != 2:
            raise ValueError(
                "A GroupEmbedding called on a tuple takes (ids, table_ids). "
                f"Received {len(inputs)} tensors"
            )
        ids, table_ids = (tf.convert_to_tensor(t) for t in inputs)
        if ids.shape.rank is not None and ids.shape != table_ids.shape:
            raise ValueError(
                "`ids` and `table_ids` must have the same shape. Received "
                f"{ids.shape} and {table_ids.shape}"
            )
        if ids.shape.rank == 1:
            ids, table_ids = ids[:, None], table_ids[:, None]
        table_ids = _checked_table_ids(layer, tf.cast(table_ids, ids.dtype), ids, len(names))
        return [tf.ragged.boolean_mask(ids, tf.equal(table_ids, j))
                for j in range(len(names))], [None] * len(names)
    return _stacked_inputs(layer, tf.convert_to_tensor(inputs)), [None] * len(names)


def _stacked_inputs(layer, ids):
    """Per feature `FlatIds` of stacked ids `[batch, F(, L)]`, from one
    `KRE>UnstackFeatureIds` (L = 1) or `KRE>UnstackKeptIds` op (no
    per-feature slicing), checked once for int32-key tables."""
    layer.check_stacked(tuple(ids.shape), ids.dtype.name)
    f = len(layer.features)
    if _serving_context.tracing_stock():  # a served graph: stock ops only
        return [ids[:, j] for j in range(f)]
    if ids.dtype not in (tf.int32, tf.int64):
        ids = integer_ids(ids, f"GroupEmbedding '{layer.name}'", tf.int64)
    if ids.shape.rank == 2:
        ids = tf.expand_dims(ids, -1)
    in_range = ids.dtype == tf.int32
    if not in_range:
        key_dtypes = {tf.as_dtype(layer.tables[s.table].key_dtype)
                      for s in layer.features.values()
                      if hasattr(layer.tables[s.table], "key_dtype")}
        if key_dtypes == {tf.int32}:  # one check of all ids (-1 is padding)
            ids = assert_ids_in_range(ids, tf.int32, f"GroupEmbedding '{layer.name}' ids",
                                      lower=False)
            in_range = True
        # int64 tables with int32 ones: each int32 table's ids are checked apart
    if ids.shape[2] == 1:
        # One id per row (a training call: inference takes _stacked_lookup):
        # the plain split (its row splits shared); the group lookup reads
        # each feature's ids as given.
        values, splits = _ops.unstack_feature_ids(ids)
        return [FlatIds(v, splits, in_range) for v in values]
    # Several: padding dropped in the split (every feature of the layer
    # prunes ids < 0), so the lookup reads the kept ids where they are.
    values, splits = _ops.unstack_kept_ids(ids)
    return [FlatIds(v, s, in_range) for v, s in zip(values, splits)]


def _checked_table_ids(layer, table_ids, ids, n):
    """`table_ids` with a check that every one paired with a real
    (non-padding, >= 0) id is a feature index in [0, n): an id with
    another table id would silently be dropped."""
    bad = tf.logical_and(tf.greater_equal(ids, 0), tf.logical_or(
        tf.less(table_ids, 0), tf.greater_equal(table_ids, n)))
    message = (f"GroupEmbedding '{layer.name}': `table_ids` must be feature indices "
               f"in [0, {n}) wherever the id is >= 0")
    return checked(table_ids, tf.logical_not(tf.reduce_any(bad)), message, lambda: (
        f"Received table ids {tf.boolean_mask(table_ids, bad).numpy()[:5].tolist()}"))


def _stacked_lookup(layer, inputs):
    """The concatenated output of an inference call on stacked ids
    `[batch, F]` or `[batch, F, L]`, from one `KRE>StackedPooledLookup` op
    (no split of the ids per feature), or `None` where that op does not
    serve: other inputs, a sequence or max_norm feature, a dense or
    distributed table, a graph traced for serving."""
    if isinstance(inputs, (dict, list, tuple)) or layer.output_mode != "concat":
        return None
    specs = list(layer.features.values())
    if any(s.sequence or s.max_norm for s in specs):
        return None
    ids = tf.convert_to_tensor(inputs)
    layer.check_stacked(tuple(ids.shape), ids.dtype.name)
    if ids.shape.rank == 2:  # [batch, F]: one id a row and feature
        ids = tf.expand_dims(ids, -1)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = integer_ids(ids, f"GroupEmbedding '{layer.name}'", tf.int64)
    return embedding_ops.stacked_pooled_lookup(
        [layer.tables[s.table] for s in specs], ids, [s.combiner for s in specs],
        [s.default_id for s in specs], name=layer.name,
        what=f"GroupEmbedding '{layer.name}' ids")


def lookup(layer, inputs, training):
    """The layer's outputs: one `[batch, sum(dims)]` tensor for
    `output_mode="concat"` (written in place by the op), else a list of
    per-feature outputs in the order of `features`."""
    training = _compat.resolve_training(training)
    if isinstance(inputs, tf.Tensor) and inputs.shape.rank is not None \
            and not tf.executing_eagerly():
        # Checked when the graph runs: a SavedModel's signature callers skip
        # tf.function's input check, and stacked ids of another length or
        # rank would be read as valid ids.
        inputs = tf.ensure_shape(inputs, inputs.shape, name=f"{layer.name}_ids_shape")
    out = None if training else _stacked_lookup(layer, inputs)
    if out is not None:
        return out
    ids, weights = _feature_inputs(layer, inputs)
    specs = list(layer.features.values())
    return embedding_ops.group_embedding_lookup_sparse(
        [layer.tables[s.table] for s in specs], ids, [s.combiner for s in specs],
        sp_weights=weights if any(w is not None for w in weights) else None,
        is_sequence=[s.sequence for s in specs],
        max_norm=[s.max_norm for s in specs],
        default_id=[s.default_id for s in specs],
        training=bool(training), name=layer.name, concat=layer.output_mode == "concat")
