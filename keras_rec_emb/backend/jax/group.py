"""`GroupEmbedding`'s forward under Keras's JAX backend.

One pooled table call per table, combiner (and weighting) and step looks
up and combines the features that read the table so (`lookup`), so a
table shared by several features gets one sparse update per step, with
the gradient of each distinct id summed over its features, as
TensorFlow's fused op gives it: Adagrad's and Adam's slots are updated
once per step, not once per feature.

A `default_id` replaces the ids of an example that keeps none before the
lookup (weight 1), so it is inserted and trained as any id. Sequence and
`max_norm` features, and `keras.layers.Embedding` tables, read their rows
per id (`[batch, L, dim]`) and clip, weigh, combine or lay them out in
`keras.ops`, whose gradient reaches the rows through the lookup's.
"""

import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.backend.jax.ids import float_weights, integer_ids, numpy_ids
from keras_rec_emb.backend.jax.layers import EmbeddingVariableBackend as _JaxEmbeddingVariable
from keras_rec_emb.backend.jax.layers import denominator, divided, group_training_lookup

count_params = keras.layers.Layer.count_params


def ids_input_dtype():
    return ffi.int_dtype().name


def _key_dtype(table):
    return table.key_dtype if isinstance(table, _JaxEmbeddingVariable) else "int64"


def prepare_inputs(layer, inputs):
    """NumPy ids checked before Keras makes JAX arrays of them (which in
    JAX's 32-bit mode narrows int64 ids unchecked)."""
    if isinstance(inputs, dict):
        inputs = dict(inputs)
        for j, (n, s) in enumerate(layer.features.items()):
            if n in inputs:
                inputs[n] = numpy_ids(inputs[n], f"`sp_ids[{j}]`",
                                      _key_dtype(layer.tables[s.table]), lower=False)
    elif {_key_dtype(t) for t in layer.tables} == {"int32"}:
        inputs = numpy_ids(inputs, f"GroupEmbedding '{layer.name}' ids", "int32", lower=False)
    return inputs


def _feature_ids(layer, inputs):
    """(ids, weights) per feature, in the order of `features`: ids
    `[batch, L]`, weights `[batch, L]` float32 or None."""
    if isinstance(inputs, dict):
        return _dict_ids(layer, inputs)
    ids = _stacked_ids(layer, inputs)
    return [ids[:, j, :] for j in range(ids.shape[1])], [None] * ids.shape[1]


def _dict_ids(layer, inputs):
    raw_ids, raw_weights = layer.dict_inputs(inputs)
    out, weights = [], []
    for j, (n, s, i, w) in enumerate(zip(layer.features, layer.features.values(), raw_ids,
                                         raw_weights)):
        # TensorFlow's checks and names (its fused lookup's `sp_ids[j]`).
        ids = integer_ids(i, f"`sp_ids[{j}]`", _key_dtype(layer.tables[s.table]),
                          lower=False, via=np.int64)
        if ids.ndim not in (1, 2):
            raise ValueError(
                f"GroupEmbedding '{layer.name}': the ids of feature {n!r} must be "
                f"[batch] or [batch, L] (padded with -1). Received: shape "
                f"{tuple(ids.shape)}")
        out.append(ids[:, None] if ids.ndim == 1 else ids)
        if w is not None:
            w = float_weights(w, ids, f"GroupEmbedding '{layer.name}': the weights "
                                      f"{s.weight_feature!r} of feature {n!r}")
            w = w[:, None] if w.ndim == 1 else w
        weights.append(w)
    return out, weights


def _stacked_ids(layer, inputs):
    """One stacked ids tensor as [batch, F, L]."""
    layer.refuse_weight_features()
    if isinstance(inputs, (list, tuple)):
        raise ValueError(
            "Under the JAX backend GroupEmbedding takes inputs=a dict of ids or one stacked "
            "ids tensor (no (ids, table_ids) pair). Received: inputs=(ids, table_ids)")
    dtype = getattr(inputs, "dtype", None)
    shape = np.shape(inputs)
    layer.check_stacked(shape, np.dtype(dtype if dtype is not None
                                        else np.asarray(inputs).dtype).name)
    # TensorFlow's checks: the ids as int64, then as an int32 key once for
    # all features when every table has int32 keys.
    key_dtype = ("int32" if {_key_dtype(t) for t in layer.tables} == {"int32"}
                 else ffi.int_dtype().name)
    ids = integer_ids(inputs, f"GroupEmbedding '{layer.name}' ids", key_dtype, lower=False,
                      via=np.int64, via_what=f"GroupEmbedding '{layer.name}'")
    return ids[:, :, None] if ids.ndim == 2 else ids


def _kept(ids, weights, spec):
    """`ids` with those the feature drops set to -1 (ids < 0 are padding;
    with `"mean"` or `"sqrtn"` ids of weight <= 0 too) and, with a
    `default_id`, an example that keeps none reading it (weight 1) in its
    first slot; and the weights."""
    if weights is not None and spec.combiner != "sum":
        ids = jnp.where(weights > 0, ids, jnp.asarray(-1, ids.dtype))
    if spec.default_id is None:
        return ids, weights
    empty = jnp.logical_not(jnp.any(ids >= 0, axis=1))
    first = jnp.where(empty, jnp.asarray(spec.default_id, ids.dtype), ids[:, 0])
    ids = ids.at[:, 0].set(first)
    if weights is not None:
        weights = weights.at[:, 0].set(jnp.where(empty, 1.0, weights[:, 0]))
    return ids, weights


def _pooled(spec, table):
    """Whether a feature's rows are combined in the table call."""
    return isinstance(table, _JaxEmbeddingVariable) and not spec.sequence and not spec.max_norm


def _one_call(layer, training):
    """Whether one table call serves every feature: no table may train in
    this call (so none inserts and no gradient is needed), one key dtype,
    every feature pooled."""
    tables = layer.tables
    # pylint: disable-next=protected-access
    return (all(isinstance(t, _JaxEmbeddingVariable) and not t._may_train(training) for t in tables)
            and len({t.key_dtype for t in tables}) == 1
            and all(_pooled(s, tables[s.table]) for s in layer.features.values()))


def _one_training_call(layer, training):
    """Whether one training table call serves every feature: two or more
    features, each pooled from a table of its own that trains in this call
    and is first looked up in its step here, one key dtype, and threads to
    look features up side by side (on one thread a call a table is faster,
    `ffi.pool_threads`)."""
    tables, specs = layer.tables, list(layer.features.values())
    # pylint: disable=protected-access
    return (len(specs) >= 2 and len(tables) == len(specs) and ffi.pool_threads() >= 2
            and sorted(s.table for s in specs) == list(range(len(tables)))
            and all(isinstance(t, _JaxEmbeddingVariable) and t._may_train(training)
                    and not t._looked_up_this_step() for t in tables)
            and len({t.key_dtype for t in tables}) == 1
            and all(_pooled(s, tables[s.table]) for s in specs))


def _padded(kept, join):
    """The (ids [batch, L_f], weights or None) of features padded to one L
    (ids with -1, pruned; weights with 0, 1 where a feature has none) and
    joined by `join` (stacked as features, or concatenated as rows); the
    weights None when no feature has any."""
    length = max(int(i.shape[1]) for i, _ in kept)
    pads = [((0, 0), (0, length - int(i.shape[1]))) for i, _ in kept]
    ids = join([jnp.pad(i, p, constant_values=-1) for (i, _), p in zip(kept, pads)])
    if all(w is None for _, w in kept):
        return ids, None
    return ids, join([jnp.pad(jnp.ones(i.shape, jnp.float32) if w is None
                              else jnp.asarray(w).astype(jnp.float32), p)
                      for (i, w), p in zip(kept, pads)])


def _one_call_lookup(layer, inputs, training=None, train=False):
    """The lookup of every feature in one table call, their rows
    concatenated: the features' ids stacked [batch, F, L] for an inference
    lookup, [F, batch, L] for a training one (`train`), each feature from
    a table of its own, each table updated in the backward."""
    specs = list(layer.features.values())
    tables = [layer.tables[s.table] for s in specs]
    key_dtype = tables[0].key_dtype
    feature_ids, feature_weights = _feature_ids(layer, inputs)
    kept = [_kept(jnp.asarray(i).astype(key_dtype), w, s)
            for i, w, s in zip(feature_ids, feature_weights, specs)]
    combiners = [s.combiner for s in specs]
    if not train:
        ids, weights = _padded(kept, lambda parts: jnp.stack(parts, axis=1))
        rows = ffi.group_pooled_lookup([t.handle for t in tables], ids,
                                       [t.embedding_dim for t in tables], combiners, weights)
    else:
        ids, weights = _padded(kept, jnp.stack)
        rows = group_training_lookup(tables, ids, weights, combiners, training)
    return _split_output(layer, rows, tables)


def _split_output(layer, rows, tables):
    """The layer's output of the features' rows concatenated."""
    if layer.output_mode == "concat":
        return rows
    out, start = [], 0
    for t in tables:
        out.append(rows[:, start:start + t.embedding_dim])
        start += t.embedding_dim
    return out


def _rows_of(table, ids, training):
    """Rows [batch, L, dim] of ids [batch, L] (zeros for ids < 0)."""
    if isinstance(table, _JaxEmbeddingVariable):
        # pylint: disable-next=protected-access
        return table._rows(ids, training, prune=True)
    valid = keras.ops.expand_dims(ids >= 0, -1)
    rows = keras.ops.take(table.embeddings, keras.ops.where(ids >= 0, ids, 0), axis=0)
    return keras.ops.where(valid, keras.ops.cast(rows, "float32"), 0.0)


def _feature_rows(table, ids, weights, spec, training):
    """A sequence or max_norm feature (or one of a dense table), as
    TensorFlow's fused op computes it: each kept id's row clipped to
    `max_norm` (`tf.clip_by_norm`), times its weight, then combined or laid
    out in order of the kept ids ([batch, L, dim], zeros after the last)."""
    ops = keras.ops
    rows = _rows_of(table, ids, training)
    valid = ids >= 0
    w = ops.cast(valid, "float32")
    if weights is not None:
        w = ops.where(valid, weights, 0.0)
    if spec.max_norm:
        # A row within the norm passes as it is (its gradient too); the
        # squared norm's guard keeps the padding's zero rows finite.
        square = ops.sum(ops.square(rows), axis=-1, keepdims=True)
        over = square > spec.max_norm ** 2
        rows = rows * ops.where(over, spec.max_norm / ops.sqrt(ops.where(over, square, 1.0)),
                                1.0)
    rows = rows * ops.expand_dims(w, -1)
    if spec.sequence:
        # The kept ids first, in their order (a stable sort of "dropped").
        order = jnp.argsort(jnp.logical_not(valid), axis=1, stable=True)
        return ops.take_along_axis(rows, ops.expand_dims(order, -1), axis=1)
    total = ops.sum(rows, axis=1)
    return total if spec.combiner == "sum" else divided(total, denominator(w, spec.combiner))


def lookup(layer, inputs, training):
    """The layer's outputs: one `[batch, sum(dims)]` array for
    `output_mode="concat"`, else a list of per-feature outputs in the
    order of `features`."""
    if _one_call(layer, training):
        return _one_call_lookup(layer, inputs)
    if _one_training_call(layer, training):
        return _one_call_lookup(layer, inputs, training, train=True)
    feature_ids, feature_weights = _feature_ids(layer, inputs)
    specs = list(layer.features.values())
    outs = [None] * len(specs)
    for t, table in enumerate(layer.tables):
        key_dtype = _key_dtype(table)
        kinds = {}
        for j, s in enumerate(specs):
            if s.table != t:
                continue
            ids, w = _kept(integer_ids(feature_ids[j], f"`sp_ids[{j}]`", key_dtype,
                                       lower=False), feature_weights[j], s)
            if not _pooled(s, table):
                outs[j] = _feature_rows(table, ids, w, s, training)
                continue
            kinds.setdefault((s.combiner, w is not None), []).append((j, ids, w))
        for (combiner, weighted), features in kinds.items():
            # One pooled lookup of the table for its features of one
            # combiner (and weighted or not), combined in the table call. A
            # table's lookups of one step get one sparse update.
            ids, weights = _padded([(i, w) for _, i, w in features],
                                   lambda parts: jnp.concatenate(parts) if len(parts) > 1
                                   else parts[0])
            if ids.shape[1] == 1 and not weighted and not training:
                # One id per row, not training: any combiner of it is its
                # row (zeros for padding), a plain lookup. A training one
                # stays pooled: its update sums through the forward's
                # inverse; a plain lookup's would de-duplicate again.
                # pylint: disable-next=protected-access
                rows = table._rows(ids[:, 0], training, prune=True)
            else:
                # pylint: disable-next=protected-access
                rows = table._rows(ids, training, prune=True, combiner=combiner,
                                   weights=weights)
            start = 0
            for j, i, _ in features:
                outs[j] = rows[start:start + i.shape[0]]
                start += i.shape[0]
    if layer.output_mode == "concat":
        return jnp.concatenate(outs, axis=-1)
    return outs
