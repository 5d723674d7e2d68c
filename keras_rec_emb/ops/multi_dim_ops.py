"""DeepRec's `safe_embedding_lookup_multi_dim`: ids `[d0, ..., dk]` combined
along several axes (docs/semantics.md, 'Lookups: fused, grouped, strings')."""

import numpy as np
import tensorflow as tf

from keras_rec_emb._checks_core import check_bool, check_float
from keras_rec_emb.backend.tensorflow.checks import checked
from keras_rec_emb.backend.tensorflow.ids import _same_vector, int_ids
from keras_rec_emb.ops import embedding_ops

MULTI_DIM_COMBINERS = ("mean", "sqrtn", "sum", "max", "min", "tile")


def _as_sparse(x, what):
    if isinstance(x, tf.RaggedTensor):
        return x.to_sparse()
    if isinstance(x, tf.SparseTensor):
        return x
    raise TypeError(f"`{what}` must be a tf.SparseTensor or a tf.RaggedTensor. "
                    f"Received: {what}={x!r}")


def _combine(values, segments, num, combiner, weights, counts, pos, size, use_weights):
    """Combines `values` [n, width] into [num, width'] by segment: segments
    are 0..num-1, none empty; `weights` [n] (or None), `counts` [num], `pos`
    [n] each entry's index along the axis (of `size`, for "tile")."""
    if combiner == "tile":
        size = tf.cast(size, tf.int64)
        width = tf.shape(values, out_type=tf.int64)[1]
        tiled = tf.math.unsorted_segment_sum(values, segments * size + pos, num * size)
        return tf.reshape(tiled, tf.stack([num, size * width]))
    if combiner == "max":
        return tf.math.unsorted_segment_max(values, segments, num)
    if combiner == "min":
        return tf.math.unsorted_segment_min(values, segments, num)
    total = tf.math.unsorted_segment_sum(values, segments, num)
    if combiner == "sum":
        return total
    if use_weights:
        w = weights if combiner == "mean" else weights * weights
        denom = tf.math.unsorted_segment_sum(w, segments, num)
    else:
        denom = tf.cast(counts, values.dtype)
    if combiner == "sqrtn":
        denom = tf.sqrt(denom)
    return tf.math.divide_no_nan(total, denom[:, None])


def safe_embedding_lookup_multi_dim(params, sp_ids, sp_weights=None, combiners=("mean",),
                                    name=None, max_norm=None, weight_axis=1, prune=True, *,
                                    training=False):
    """Looks up ids `[d0, ..., dk]` and combines them along several axes.

    DeepRec's `safe_embedding_lookup_multi_dim`: `combiners[i]` combines one
    of the last `len(combiners)` axes, the innermost last; axes before them are
    kept. See docs/semantics.md, 'Lookups: fused, grouped, strings'.

    Args:
        params: an embedding parameter, as in `embedding_lookup_sparse`
            (an `EmbeddingVariable`, an `EmbeddingTable` or a dense
            `[vocab, dim]` variable).
        sp_ids: `tf.SparseTensor` or `tf.RaggedTensor` of integer ids, rank
            `k + 1 >= 2` (static), `k >= len(combiners)`.
        sp_weights: `None` or per-id weights with the same indices.
        combiners: a string or a list of strings from `"mean"`, `"sqrtn"`,
            `"sum"`, `"max"`, `"min"`, `"tile"`, one per combined axis.
            Defaults to `("mean",)`.
        name: str or `None`. Name of the fused lookup op.
        max_norm: `None` or float > 0. Rows are clipped to this L2 norm
            before weighting.
        weight_axis: int in `[1, k]` (or negative, from the end). The axis
            whose mean and sqrtn divide by the weights. Defaults to `1`.
        prune: bool. Drop ids < 0 (and, when no axis sums, ids of weight <= 0).
            Defaults to `True`.
        training: bool. Insert unseen ids into a table. Defaults to `False`.

    Returns:
        float32 tensor `[d0, ..., d(k - len(combiners)), width]`: `width` is
        the rows' dim times the length of every `"tile"` axis.

    Example:

    >>> matrix = keras.Variable(np.arange(8, dtype="float32").reshape(4, 2))
    >>> ids = tf.ragged.constant([[[0, 1], [2]], [[3]]], dtype=tf.int64)
    >>> keras_rec_emb.ops.safe_embedding_lookup_multi_dim(
    ...     matrix, ids, combiners=["mean", "sum"]).numpy()
    array([[3. , 4.5],
           [6. , 7. ]], dtype=float32)
    """
    if isinstance(combiners, str):
        combiners = [combiners]
    if not isinstance(combiners, (list, tuple)) or not combiners:
        raise ValueError("`combiners` must be a non-empty list of strings from "
                         f"{MULTI_DIM_COMBINERS}. Received: combiners={combiners!r}")
    for c in combiners:
        if c not in MULTI_DIM_COMBINERS:
            raise ValueError(f"`combiners` entries must be one of {MULTI_DIM_COMBINERS}. "
                             f"Received: combiners={list(combiners)!r}")
    combiners = list(combiners)
    prune = check_bool("prune", prune)
    training = check_bool("training", training)
    max_norm = check_float("max_norm", max_norm, 0, min_open=True, allow_none=True)
    sp = _as_sparse(sp_ids, "sp_ids")
    rank = sp.shape.rank
    if rank is None or rank < len(combiners) + 1:
        raise ValueError(
            f"`sp_ids` must have a static rank of at least len(combiners) + 1 = "
            f"{len(combiners) + 1}. Received shape {sp.shape} with combiners={combiners!r}")
    k = rank - 1
    if isinstance(weight_axis, bool) or not isinstance(weight_axis, (int, np.integer)) \
            or not -k <= weight_axis <= k or weight_axis == 0:
        raise ValueError(f"`weight_axis` must be an axis of the ids in [1, {k}] (or "
                         f"[-{k}, -1]). Received: weight_axis={weight_axis!r}")
    weight_axis = int(weight_axis) % rank
    sp = tf.sparse.reorder(sp)
    ids = int_ids(sp.values, "sp_ids")
    indices, shape = sp.indices, sp.dense_shape
    weights = None
    if sp_weights is not None:
        sw = tf.sparse.reorder(_as_sparse(sp_weights, "sp_weights"))
        if not (sw.values.dtype.is_floating or sw.values.dtype.is_integer):
            raise TypeError("`sp_weights` must be numeric. Received dtype "
                            f"{sw.values.dtype.name}")
        weights = tf.cast(checked(
            sw.values, _same_vector(sw.indices, indices),
            "`sp_weights` must have the indices of `sp_ids` (one weight per id)",
            lambda: (f"Received {int(tf.shape(indices)[0])} ids and "
                     f"{int(tf.shape(sw.indices)[0])} weights")), tf.float32)
    if prune:
        keep = ids >= 0
        if weights is not None and "sum" not in combiners:
            keep = tf.logical_and(keep, weights > 0)
        ids, indices = tf.boolean_mask(ids, keep), tf.boolean_mask(indices, keep)
        if weights is not None:
            weights = tf.boolean_mask(weights, keep)
    # Each id's entry on axis k - 1: its flat index over axes 0..k-1.
    entry = indices[:, 0]
    for a in range(1, k):
        entry = entry * shape[a] + indices[:, a]
    first = k - len(combiners) + 1  # the first combined axis
    segments, segment_of, counts = tf.unique_with_counts(entry, out_idx=tf.int64)
    num = tf.size(segments, out_type=tf.int64)
    combiner = combiners[-1]
    use_weights = weights is not None and weight_axis == k
    fused = combiner == "sum" or (combiner in ("mean", "sqrtn") and (
        weights is None or (use_weights and prune and "sum" not in combiners)))
    if fused:
        # The entries' ids as ragged rows: one fused lookup and combine.
        splits = tf.concat([[0], tf.cumsum(tf.cast(counts, tf.int64))], 0)
        rows = tf.RaggedTensor.from_row_splits(ids, splits, validate=False)
        w = None if weights is None else [tf.RaggedTensor.from_row_splits(
            weights, splits, validate=False)]
        values = embedding_ops.group_embedding_lookup_sparse(
            [params], [rows], [combiner], sp_weights=w, name=name, max_norm=max_norm,
            prune_invalid_ids=False, training=training)[0]
        static_width = values.shape[-1]
    else:
        one = tf.RaggedTensor.from_row_splits(
            ids, tf.range(tf.size(ids, out_type=tf.int64) + 1), validate=False)
        rows = embedding_ops.group_embedding_lookup_sparse(
            [params], [one], ["sum"], name=name, max_norm=max_norm, prune_invalid_ids=False,
            training=training)[0]
        if weights is not None:
            rows = rows * weights[:, None]
        values = _combine(rows, segment_of, num, combiner, weights, counts, indices[:, k],
                          shape[k], use_weights)
        static_width = rows.shape[-1]
    if weights is not None:
        weights = tf.math.unsorted_segment_mean(weights, segment_of, num)
    if combiner == "tile":
        static_width = None if sp.shape[k] is None or static_width is None \
            else static_width * sp.shape[k]
    # The outer combined axes, innermost first, over the present entries.
    for a in range(k - 1, first - 1, -1):
        size = shape[a]
        parent, pos = segments // size, segments % size
        segments, segment_of, counts = tf.unique_with_counts(parent, out_idx=tf.int64)
        num = tf.size(segments, out_type=tf.int64)
        combiner = combiners[a - first]
        values = _combine(values, segment_of, num, combiner, weights, counts, pos, size,
                          weights is not None and weight_axis == a)
        if weights is not None:
            weights = tf.math.unsorted_segment_mean(weights, segment_of, num)
        if combiner == "tile":
            static_width = None if sp.shape[a] is None or static_width is None \
                else static_width * sp.shape[a]
    # Present entries of the kept axes 0..first-1 into the dense output.
    kept = shape[:first]
    width = tf.shape(values, out_type=tf.int64)[1]
    out = tf.scatter_nd(segments[:, None], values, tf.stack([tf.reduce_prod(kept), width]))
    out = tf.reshape(out, tf.concat([kept, [width]], 0))
    return tf.ensure_shape(out, sp.shape[:first].concatenate([static_width]))
