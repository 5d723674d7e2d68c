"""Argument and input checks shared by the layers and ops (private)."""

import math
import numbers

import numpy as np
import tensorflow as tf

from keras_rec_emb import _compat

COMBINERS = ("sum", "mean", "sqrtn")


def integer_ids(ids, what, dtype=tf.int64):
    """`ids` cast to `dtype`, or a TypeError naming `what` if not integers
    (a ValueError, or a failing assertion when traced, if an id does not fit
    `dtype`: int64 ids would wrap onto other int32 keys)."""
    if not ids.dtype.is_integer:
        if _compat.in_symbolic_build():  # shapes only: see _compat.in_symbolic_build
            return tf.zeros(tf.shape(ids), dtype)
        raise TypeError(
            f"{what} expects integer ids (int32 or int64). Received ids of dtype "
            f"{ids.dtype.name}. Hash strings or floats to integers first, e.g. "
            "with keras.layers.Hashing or tf.strings.to_hash_bucket_fast. (Exporting "
            "a subclassed model? Keras records only its input shapes: pass "
            "`input_signature` with integer tf.TensorSpecs for the ids.)"
        )
    if ids.dtype == dtype:
        return ids
    if ids.dtype.size > dtype.size:  # refuse ids the narrower keys cannot hold
        ids = assert_ids_in_range(ids, dtype, what)
    return tf.cast(ids, dtype)


def check_combiner(combiner, allow_none=True):
    if (combiner is None and allow_none) or combiner in COMBINERS:
        return
    allowed = f"None or one of {COMBINERS}" if allow_none else f"one of {COMBINERS}"
    raise ValueError(f"`combiner` must be {allowed}. Received: combiner={combiner!r}")


# -- one vocabulary of argument checks (options, optimizers, ops, layers) -----
# Each raises `TypeError` for a value of the wrong kind and `ValueError` for
# one out of range; the message names the argument, what is allowed and the
# value received ("`x` must be ... Received: x=...").


def _fail(name, allowed, value, error=ValueError):
    raise error(f"`{name}` must be {allowed}. Received: {name}={value!r}")


def is_int(value):
    """Whether `value` is a Python or NumPy integer (bools are not)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
        value, (bool, np.bool_))


def check_int(name, value, minimum=None, maximum=None, allow_none=False):
    """`value` as an int, after checking it is an integer in
    [`minimum`, `maximum`] (each bound optional)."""
    if value is None and allow_none:
        return None
    allowed = _int_range(minimum, maximum)
    if allow_none:
        allowed = f"None or {allowed}"
    if not is_int(value):
        _fail(name, allowed, value, TypeError)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        _fail(name, allowed, value)
    return int(value)


def _int_range(minimum, maximum):
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {maximum}]"
    if minimum is not None:
        return {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}")
    if maximum is not None:
        return f"an integer <= {maximum}"
    return "an integer"


def check_float(name, value, minimum=None, maximum=None, min_open=False, max_open=False,
                allow_none=False):
    """`value` as a float, after checking it is a finite real number in the
    given range (`min_open`/`max_open` exclude the bound)."""
    if value is None and allow_none:
        return None
    lo = "" if minimum is None else ("> " if min_open else ">= ") + f"{minimum}"
    hi = "" if maximum is None else ("< " if max_open else "<= ") + f"{maximum}"
    if minimum is not None and maximum is not None:
        bounds = f"in {'(' if min_open else '['}{minimum}, {maximum}{')' if max_open else ']'}"
    else:
        bounds = lo or hi
    allowed = "a finite float" + (f" {bounds}" if bounds else "")
    if minimum == 0 and min_open and maximum is None:
        allowed = "a positive finite float"
    elif minimum == 0 and not min_open and maximum is None:
        allowed = "a non-negative finite float"
    if allow_none:
        allowed = f"None or {allowed}"
    if not isinstance(value, (numbers.Real, np.floating, np.integer)) or isinstance(
            value, (bool, np.bool_)):
        _fail(name, allowed, value, TypeError)
    v = float(value)
    if (not math.isfinite(v)
            or minimum is not None and (v <= minimum if min_open else v < minimum)
            or maximum is not None and (v >= maximum if max_open else v > maximum)):
        _fail(name, allowed, value)
    return v


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        _fail(name, "a bool", value, TypeError)
    return bool(value)


def check_learning_rate(value, name="learning_rate"):
    """A learning rate: a finite float >= 0, or a Keras
    `LearningRateSchedule` / callable (checked when called)."""
    import keras

    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule) or callable(value):
        return value
    if isinstance(value, (tf.Variable, keras.Variable)) or tf.is_tensor(value):
        v = float(np.asarray(value)) if tf.executing_eagerly() else None
        if v is not None:
            check_float(name, v, 0)
        return value
    return check_float(name, value, 0)


def key_range(dtype):
    """(min, max) of the integer key dtype."""
    info = np.iinfo(tf.as_dtype(dtype).as_numpy_dtype)
    return int(info.min), int(info.max)


def keys_in_range(keys, key_dtype, what):
    """NumPy `keys` cast to `key_dtype`; a ValueError if one does not fit (an
    int64 id would otherwise wrap onto another int32 key)."""
    keys = np.asarray(keys)
    lo, hi = key_range(key_dtype)
    if keys.size and (keys.min() < lo or keys.max() > hi):
        bad = keys[(keys < lo) | (keys > hi)][:3].tolist()
        raise ValueError(
            f"{what} holds ids outside the {tf.as_dtype(key_dtype).name} key range "
            f"[{lo}, {hi}], e.g. {bad}. Use a table with key_dtype='int64' or hash "
            "the ids into range first")
    return keys.astype(tf.as_dtype(key_dtype).as_numpy_dtype)


def assert_ids_in_range(ids, key_dtype, what, lower=True):
    """int64 `ids` with a check (an assertion op when traced) that each fits
    `key_dtype`; `lower=False` checks only the upper bound (ids < 0 are
    padding that is pruned)."""
    lo, hi = key_range(key_dtype)
    if ids.dtype.size <= tf.as_dtype(key_dtype).size:
        return ids
    if tf.executing_eagerly():
        v = ids.numpy()
        if v.size and (v.max() > hi or lower and v.min() < lo):
            bad = v[(v > hi) | ((v < lo) if lower else False)][:3].tolist()
            raise ValueError(
                f"{what} holds ids outside the {tf.as_dtype(key_dtype).name} key "
                f"range [{lo}, {hi}], e.g. {bad}. Use a table with key_dtype='int64' "
                "or hash the ids into range first")
        return ids
    checks = [tf.debugging.assert_less_equal(
        ids, tf.constant(hi, ids.dtype),
        message=f"{what} holds ids above the {tf.as_dtype(key_dtype).name} key range "
                f"(max {hi}); use key_dtype='int64' or hash the ids into range")]
    if lower:
        checks.append(tf.debugging.assert_greater_equal(
            ids, tf.constant(lo, ids.dtype),
            message=f"{what} holds ids below the {tf.as_dtype(key_dtype).name} key "
                    f"range (min {lo}); use key_dtype='int64'"))
    with tf.control_dependencies(checks):
        return tf.identity(ids)


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
