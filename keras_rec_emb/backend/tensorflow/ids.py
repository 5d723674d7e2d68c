"""Integer ids in every form the package takes them (dense, ragged, sparse, with
optional weights or masks): the one normalizer of the layers and of the fused
group lookup."""

from typing import NamedTuple

import keras
import tensorflow as tf

from keras_rec_emb.backend.tensorflow.checks import checked, checked_sparse_ids, integer_ids
from keras_rec_emb.backend.tensorflow.embed_reduce import combine_dense, combine_rows, combine_sparse


def embed_ids(layer, inputs, embed_flat, combiner, extra=None, key_dtype=tf.int64):
    """The input handling of EmbeddingVariable, MultiHashEmbedding and AdaptiveEmbedding.

    `embed_flat(flat_ids, flat_extra)` returns `[n, dim]` rows of ids cast to
    `key_dtype` (refused if they do not fit). Dense ids give `ids.shape + (dim,)`
    (the last axis combined with a combiner); ragged `[B, None]` ids give ragged
    rows or `[B, dim]`; sparse ids need a combiner. `extra` (per-id, e.g. a mask)
    is flattened alongside."""
    what = f"{type(layer).__name__} '{layer.name}'"
    inputs = checked_id_shape(inputs, what, combiner)

    def checked(ids):
        return integer_ids(ids, what, key_dtype)

    if isinstance(inputs, tf.RaggedTensor):
        flat_extra = None if extra is None else _flat_like(extra, inputs.values)
        rows = embed_flat(checked(inputs.values), flat_extra)
        if combiner is None:
            return inputs.with_values(rows)
        return combine_rows(rows, inputs.value_rowids(), inputs.nrows(), combiner)
    if isinstance(inputs, tf.SparseTensor):
        if extra is not None:  # reordered alike below
            extra = tf.SparseTensor(inputs.indices, _flat_like(extra, inputs.values),
                                    inputs.dense_shape)
            extra = checked_sparse_ids(extra, f"{what} mask").values
        inputs = checked_sparse_ids(inputs, f"{what} ids")
        rows = embed_flat(checked(inputs.values), extra)
        return combine_sparse(rows, inputs, combiner)
    ids = checked(inputs)
    flat_extra = None if extra is None else _flat_like(extra, ids)
    rows = embed_flat(tf.reshape(ids, [-1]), flat_extra)
    dim = rows.shape[-1]
    shape = tf.concat([tf.shape(ids, out_type=tf.int64), [dim]], 0)
    rows = tf.ensure_shape(tf.reshape(rows, shape), ids.shape.concatenate([dim]))
    return rows if combiner is None else combine_dense(rows, combiner)


def checked_id_shape(inputs, what, combiner):
    """`inputs` (dense ones as a tensor) once their shape is checked for
    layer `what` with `combiner`: ragged `[batch, None]`; sparse `[batch,
    None]`, with a combiner; dense not scalar, with one."""
    if isinstance(inputs, tf.RaggedTensor):
        if inputs.ragged_rank != 1 or inputs.shape.rank != 2:
            raise ValueError(
                f"{what} takes ragged ids of shape [batch, None]. Received "
                f"shape {inputs.shape} with ragged_rank {inputs.ragged_rank}"
            )
        return inputs
    if isinstance(inputs, tf.SparseTensor):
        if inputs.shape.rank != 2:
            raise ValueError(
                f"{what} takes sparse ids of shape [batch, None]. Received "
                f"shape {inputs.shape}"
            )
        if combiner is None:
            raise ValueError(
                f"{what} needs a `combiner` to embed tf.SparseTensor ids. "
                "Received combiner=None"
            )
        return inputs
    inputs = tf.convert_to_tensor(inputs)
    if combiner is not None and inputs.shape.rank is not None and inputs.shape.rank < 1:
        raise ValueError(
            f"{what} with a combiner combines the last axis of the ids; "
            f"received scalar ids of shape {inputs.shape}"
        )
    return inputs


def _flat_like(extra, ids):
    """`extra` (dense, ragged or sparse, like the ids) as a flat tensor."""
    if isinstance(extra, tf.RaggedTensor):
        extra = extra.flat_values
    elif isinstance(extra, tf.SparseTensor):
        extra = extra.values
    extra = tf.reshape(tf.convert_to_tensor(extra), [-1])
    tf.debugging.assert_equal(tf.size(extra), tf.size(ids),
                              message="the mask must have one entry per id")
    return extra


def output_spec(layer, inputs, dim, combiner):
    """compute_output_spec of the layers above."""
    shape = tuple(inputs.shape)
    shape = shape[:-1] + (dim,) if combiner is not None else shape + (dim,)
    ragged = bool(getattr(inputs, "ragged", False)) and combiner is None
    return keras.KerasTensor(shape, dtype=layer.compute_dtype, ragged=ragged)


# -- the fused group lookup: flat ids and row splits ---------------------------
class FlatIds(NamedTuple):
    """One feature's ids in the fused lookup's form (flat values, < 0 padding, and
    row splits), as GroupEmbedding's stacked input gives them; `in_range`: known
    to fit every table's key dtype, so no per-feature range check is added."""

    values: tf.Tensor
    splits: tf.Tensor
    in_range: bool = False


def int_ids(values, what):
    return integer_ids(values, f"`{what}`")


def collapse_outer(ids, what):
    """Rank > 2 ids as `[d0 * ... * dn-1, dn]`, as TF's safe_embedding_lookup_sparse
    takes them, and `outer` (dynamic and static `[d0, ..., dn-1]`, None for rank
    <= 2) to give the output back its shape."""
    if isinstance(ids, FlatIds):
        return ids, None
    if isinstance(ids, tf.SparseTensor):
        rank = ids.shape.rank
        if rank is None or rank <= 2:
            return ids, None
        shape = ids.dense_shape
        flat = tf.sparse.reshape(ids, tf.stack([tf.reduce_prod(shape[:-1]), shape[-1]]))
        return flat, (shape[:-1], ids.shape[:-1])
    if isinstance(ids, tf.RaggedTensor):
        return ids, None
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank is None or ids.shape.rank <= 2:
        return ids, None
    shape = tf.shape(ids, out_type=tf.int64)
    flat = tf.reshape(ids, tf.stack([tf.reduce_prod(shape[:-1]), shape[-1]]))
    return flat, (shape[:-1], ids.shape[:-1])


def flat_ids_and_splits(ids, what):
    """Returns (flat int64 ids, int64 row splits) of [B, None] ids."""
    if isinstance(ids, FlatIds):
        return ids.values, ids.splits
    if isinstance(ids, tf.RaggedTensor):
        if ids.ragged_rank != 1:
            raise ValueError(
                f"`{what}` must be a [batch, None] tf.RaggedTensor. Received "
                f"ragged_rank {ids.ragged_rank} and shape {ids.shape}"
            )
        return int_ids(ids.values, what), tf.cast(ids.row_splits, tf.int64)
    if isinstance(ids, tf.SparseTensor):
        if ids.shape.rank is None or ids.shape.rank < 2:
            raise ValueError(
                f"`{what}` must be a tf.SparseTensor of rank >= 2 "
                f"([d0, ..., dn]). Received shape {ids.shape}"
            )
        # Rows are read in index order: reorder first (a row index outside
        # [0, dense_shape[0]) is an error, not a silently dropped row).
        ids = checked_sparse_ids(ids, f"`{what}`")
        return int_ids(ids.values, what), sparse_row_splits(ids)
    ids = tf.convert_to_tensor(ids)
    int_ids(ids, what)
    if ids.shape.rank not in (1, 2):
        raise ValueError(
            f"`{what}` must be a tf.RaggedTensor, a tf.SparseTensor or a "
            f"dense [batch] / [batch, length] tensor. Received shape {ids.shape}"
        )
    # Every row has `length` ids, so the splits are a range. (Not
    # RaggedTensor.from_tensor: its ~20 small ops per feature, times 26
    # features, cost a GroupEmbedding more per step than the fused lookup
    # saves; see benchmarks/fit_epoch.py.)
    batch = tf.shape(ids, out_type=tf.int64)[0]
    if ids.shape.rank == 1:
        return int_ids(ids, what), tf.range(batch + 1, dtype=tf.int64)
    length = ids.shape[1] if ids.shape[1] is not None else tf.shape(ids, out_type=tf.int64)[1]
    values = int_ids(tf.reshape(ids, [-1]), what)  # int64, as the op takes
    return values, tf.range(batch + 1, dtype=tf.int64) * length


def sparse_row_splits(sp):
    """Row splits of a row-major ordered [batch, None] tf.SparseTensor."""
    return tf.concat([[0], tf.cumsum(tf.math.bincount(
        sp.indices[:, 0], minlength=sp.dense_shape[0], maxlength=sp.dense_shape[0],
        dtype=tf.int64))], 0)


def _same_vector(a, b):
    """Scalar bool tensor: `a` and `b` (any shapes) hold the same elements."""
    a, b = tf.reshape(a, [-1]), tf.reshape(b, [-1])
    n = tf.minimum(tf.size(a), tf.size(b))
    return tf.logical_and(tf.equal(tf.size(a), tf.size(b)),
                          tf.reduce_all(tf.equal(a[:n], b[:n])))


def weights_values(w, ids, splits, what, what_ids):
    """Flat float32 weights of `w`, checked to have the structure of `ids`
    (same row lengths; same indices for sparse ones): weights are paired
    with ids by position, so another structure would weight the wrong ids."""
    if w is None:
        return tf.zeros([0], tf.float32)
    if isinstance(w, tf.SparseTensor):
        w = checked_sparse_ids(w, f"`{what}`")
        values, w_splits = w.values, sparse_row_splits(w)
    elif isinstance(w, tf.RaggedTensor):
        if w.ragged_rank != 1:
            raise ValueError(f"`{what}` must be a [batch, None] tf.RaggedTensor. "
                             f"Received ragged_rank {w.ragged_rank}")
        values, w_splits = w.values, tf.cast(w.row_splits, tf.int64)
    else:
        w = tf.convert_to_tensor(w)
        if w.shape.rank == 1:
            w = tf.expand_dims(w, 1)
        if w.shape.rank != 2:
            raise ValueError(f"`{what}` must be [batch, length] weights like the ids. "
                             f"Received shape {w.shape}")
        r = tf.RaggedTensor.from_tensor(w)
        values, w_splits = r.values, tf.cast(r.row_splits, tf.int64)
    if not (values.dtype.is_floating or values.dtype.is_integer):
        raise TypeError(f"`{what}` must be numeric. Received dtype {values.dtype.name}")
    values = tf.cast(values, tf.float32)
    same = _same_vector(w_splits, splits)
    if isinstance(w, tf.SparseTensor) and isinstance(ids, tf.SparseTensor):
        same = tf.logical_and(same, _same_vector(tf.sparse.reorder(ids).indices, w.indices))
    message = (f"`{what}` must have the structure of `{what_ids}` (one weight per "
               "id, the same row lengths and, for tf.SparseTensor, the same indices)")
    return checked(values, same, message, lambda: (
        f"Received {int(splits[-1])} ids with row splits {splits.numpy().tolist()[:8]} and "
        f"{int(tf.size(values))} weights with row splits {w_splits.numpy().tolist()[:8]}"))
