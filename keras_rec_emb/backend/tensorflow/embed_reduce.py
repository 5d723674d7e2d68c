"""Combining embedding rows (sum / mean / sqrtn, optionally weighted): the
one reduction every layer, the fused group lookup's stock twin and the
functional ops share (private)."""

import tensorflow as tf


def combine_rows(rows, segment_ids, num_segments, combiner, weights=None):
    """Reduces `rows` [n, dim] into [num_segments, dim] by `segment_ids`.

    `sum`, `mean` (divide by the number, or total weight, of ids in the
    segment) or `sqrtn` (divide by the square root of the sum of squared
    weights). Empty segments give zeros.
    """
    if weights is not None:
        rows = rows * tf.expand_dims(weights, -1)
        w = weights
    else:
        w = tf.ones(tf.shape(segment_ids), rows.dtype)
    total = tf.math.unsorted_segment_sum(rows, segment_ids, num_segments)
    if combiner == "sum":
        return total
    if combiner == "mean":
        denom = tf.math.unsorted_segment_sum(w, segment_ids, num_segments)
    else:
        denom = tf.sqrt(tf.math.unsorted_segment_sum(w * w, segment_ids, num_segments))
    return tf.math.divide_no_nan(total, tf.expand_dims(denom, -1))


def combine_dense(rows, combiner):
    """Reduces the last-but-one axis of `rows` [..., L, dim] by `combiner`;
    `L = 0` gives zeros (as empty ragged rows do), not NaN."""
    total = tf.reduce_sum(rows, axis=-2)
    if combiner == "sum":
        return total
    length = tf.cast(tf.shape(rows)[-2], rows.dtype)
    return tf.math.divide_no_nan(total, length if combiner == "mean" else tf.sqrt(length))


def combine_sparse(rows, sp_ids, combiner):
    """`combine_rows` for the rows of `tf.SparseTensor` ids [B, None] (any
    index order; checked by `checked_sparse_ids`)."""
    return combine_rows(rows, sp_ids.indices[:, 0], sp_ids.dense_shape[0], combiner)
