"""Argument and input checks shared by the layers and ops (private): those of
TensorFlow inputs; the ones that need no TensorFlow (and serve the JAX
backend too) live in `keras_rec_emb._checks_core`."""

import numpy as np
import tensorflow as tf

from keras_rec_emb import _checks_core
from keras_rec_emb._checks_core import check_float
from keras_rec_emb.backend.tensorflow import compat as _compat


def integer_ids(ids, what, dtype=tf.int64):
    """`ids` cast to `dtype`; a TypeError naming `what` if not integers, a
    ValueError (a failing assertion when traced) if an id does not fit
    `dtype`, where it would wrap onto another key."""
    if not ids.dtype.is_integer:
        if _compat.in_symbolic_build():  # shapes only: see _compat.in_symbolic_build
            return tf.zeros(tf.shape(ids), dtype)
        raise _checks_core.non_integer_ids_error(what, ids.dtype.name)
    if ids.dtype == dtype:
        return ids
    if _checks_core.ids_may_not_fit(ids.dtype.as_numpy_dtype, tf.as_dtype(dtype).as_numpy_dtype):
        ids = assert_ids_in_range(ids, dtype, what)  # refuse ids the keys cannot hold
    return tf.cast(ids, dtype)


def check_learning_rate(value, name="learning_rate"):
    """`_checks_core.check_learning_rate`, and a TensorFlow tensor or
    variable checked by its value when eager."""
    if isinstance(value, tf.Variable) or tf.is_tensor(value):
        if tf.executing_eagerly():
            check_float(name, float(np.asarray(value)), 0)
        return value
    return _checks_core.check_learning_rate(value, name)


def keys_in_range(keys, key_dtype, what):
    """NumPy `keys` cast to `key_dtype`; a ValueError if one does not fit (an
    int64 id would otherwise wrap onto another int32 key)."""
    keys = np.asarray(keys)
    numpy_dtype = tf.as_dtype(key_dtype).as_numpy_dtype
    _checks_core.check_ids_in_key_range(keys, numpy_dtype, what)
    return keys.astype(numpy_dtype)


def assert_ids_in_range(ids, key_dtype, what, lower=True):
    """Integer `ids` with a check (an assertion op when traced) that each fits
    `key_dtype`; `lower=False` checks only the upper bound (ids < 0 are
    padding that is pruned)."""
    key_dtype = tf.as_dtype(key_dtype)
    lo, hi = _checks_core.key_range(key_dtype.as_numpy_dtype)
    if not _checks_core.ids_may_not_fit(ids.dtype.as_numpy_dtype, key_dtype.as_numpy_dtype):
        return ids
    lower = lower and not ids.dtype.is_unsigned
    if tf.executing_eagerly():
        _checks_core.check_ids_in_key_range(ids.numpy(), key_dtype.as_numpy_dtype, what, lower)
        return ids
    checks = [tf.debugging.assert_less_equal(
        ids, tf.constant(hi, ids.dtype),
        message=f"{what} holds ids above the {key_dtype.name} key range "
                f"(max {hi}); use key_dtype='int64' or hash the ids into range")]
    if lower:
        checks.append(tf.debugging.assert_greater_equal(
            ids, tf.constant(lo, ids.dtype),
            message=f"{what} holds ids below the {key_dtype.name} key "
                    f"range (min {lo}); use key_dtype='int64'"))
    with tf.control_dependencies(checks):
        return tf.identity(ids)


def checked(value, ok, message, received):
    """`value` once the scalar bool `ok` holds: eagerly a ValueError
    (`message`, then `received()`) if not; traced, an assertion that runs
    before `value` is read."""
    if tf.executing_eagerly():
        if not bool(ok):
            raise ValueError(f"{message}. {received()}")
        return value
    with tf.control_dependencies([tf.debugging.assert_equal(ok, True, message=message)]):
        return tf.identity(value)


def checked_sparse_ids(sp, what):
    """`sp` ([batch, None] tf.SparseTensor) in canonical row-major order,
    with a check that every row index lies in [0, dense_shape[0]) (a row
    outside would be dropped while its id is still inserted)."""
    rows = sp.indices[:, 0]
    nrows = sp.dense_shape[0]
    if tf.executing_eagerly():
        r = rows.numpy()
        if r.size and (r.min() < 0 or r.max() >= int(nrows)):
            raise ValueError(
                f"{what} has row indices outside [0, {int(nrows)}) (dense_shape "
                f"{sp.dense_shape.numpy().tolist()}): {r[(r < 0) | (r >= int(nrows))][:3].tolist()}")
        return tf.sparse.reorder(sp)
    checks = [
        tf.debugging.assert_non_negative(rows, message=f"{what} has negative row indices"),
        tf.debugging.assert_less(rows, nrows,
                                 message=f"{what} has row indices >= dense_shape[0]"),
    ]
    with tf.control_dependencies(checks):
        return tf.sparse.reorder(tf.SparseTensor(tf.identity(sp.indices), sp.values,
                                                 sp.dense_shape))
