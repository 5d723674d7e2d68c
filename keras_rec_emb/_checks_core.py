"""Argument checks that need no TensorFlow (private): shared by the layers,
options and optimizers of both backends (`backend/tensorflow/checks.py` adds
the checks of TensorFlow inputs).
"""

import inspect
import math
import numbers

import numpy as np

COMBINERS = ("sum", "mean", "sqrtn")


def check_combiner(combiner, allow_none=True):
    if (combiner is None and allow_none) or combiner in COMBINERS:
        return
    allowed = f"None or one of {COMBINERS}" if allow_none else f"one of {COMBINERS}"
    raise ValueError(f"`combiner` must be {allowed}. Received: combiner={combiner!r}")


# -- one vocabulary of argument checks (options, optimizers, ops, layers) -----
# Each raises `TypeError` for a value of the wrong kind and `ValueError` for
# one out of range; the message names the argument, what is allowed and the
# value received ("`x` must be ... Received: x=...").


def check_combiner_weights(layer, combiner, prune_invalid_ids, dtype):
    """The checks of per-id `weights` passed to EmbeddingVariable `layer`
    (its name) under either backend; `dtype` the weights' NumPy dtype or
    None (a Python list)."""
    if combiner is None:
        raise ValueError(
            f"EmbeddingVariable '{layer}': `weights` weigh the ids of a combine and need a "
            "`combiner` (\"sum\", \"mean\" or \"sqrtn\"). Received: weights with combiner=None")
    if combiner != "sum" and not prune_invalid_ids:
        raise ValueError(
            f"EmbeddingVariable '{layer}': with combiner={combiner!r}, ids whose weight is <= 0 "
            "are dropped from the lookup, which marks them as padding: that needs "
            "`prune_invalid_ids=True`. Received: weights with prune_invalid_ids=False")
    if dtype is not None and not (np.issubdtype(dtype, np.floating)
                                  or np.issubdtype(dtype, np.integer)):
        raise TypeError(f"EmbeddingVariable '{layer}': `weights` must be numbers. Received: "
                        f"weights of dtype {dtype}")


# A table's initializer matrix, [default_value_dim, embedding_dim] float32,
# is drawn whole when the table is built: past this many elements (8 GiB)
# XLA aborts the process and TensorFlow fails to allocate.
MAX_INITIALIZER_ELEMENTS = 2**31 - 1


def check_initializer_matrix(layer, default_value_dim, embedding_dim):
    """Refuses, before anything is allocated, a `[default_value_dim,
    embedding_dim]` initializer matrix of more than
    MAX_INITIALIZER_ELEMENTS elements for `layer` (its name)."""
    elements = int(default_value_dim) * int(embedding_dim)
    if elements > MAX_INITIALIZER_ELEMENTS:
        raise ValueError(
            f"EmbeddingVariable '{layer}': its initializer matrix [default_value_dim, "
            f"embedding_dim] = [{default_value_dim}, {embedding_dim}] would hold {elements} "
            f"floats ({elements * 4 / 2**30:.1f} GiB), more than the {MAX_INITIALIZER_ELEMENTS} "
            "(2**31 - 1) a table takes: lower `embedding_dim` or `default_value_dim` "
            "(InitializerOption). Received: "
            f"default_value_dim={default_value_dim}, embedding_dim={embedding_dim}")


# -- ids: the checks of both backends' id inputs (`_checks.integer_ids`,
# `_jax.ids.integer_ids`), one message each ---------------------------------

def is_integer_dtype(dtype):
    """Whether NumPy `dtype` holds integer ids (bool does not)."""
    return np.issubdtype(np.dtype(dtype), np.integer)


def non_integer_ids_error(what, dtype):
    """The TypeError for ids of non-integer `dtype` (its name) passed to `what`."""
    return TypeError(
        f"{what} expects integer ids (int32 or int64). Received ids of dtype "
        f"{dtype}. Hash strings or floats to integers first, e.g. "
        "with keras.layers.Hashing or tf.strings.to_hash_bucket_fast. (Exporting "
        "a subclassed model? Keras records only its input shapes: pass "
        "`input_signature` with integer tf.TensorSpecs for the ids.)")


def key_range(key_dtype):
    """(min, max) of the integer key dtype (a NumPy dtype or its name)."""
    info = np.iinfo(np.dtype(key_dtype))
    return int(info.min), int(info.max)


def ids_may_not_fit(id_dtype, key_dtype):
    """Whether ids of integer `id_dtype` may lie outside `key_dtype`'s range
    (int64 ids for int32 keys, uint64 ids for int64 keys): cast, they would
    wrap onto other keys."""
    lo, hi = key_range(key_dtype)
    ids_lo, ids_hi = key_range(id_dtype)
    return ids_lo < lo or ids_hi > hi


def ids_outside_key_range_error(what, key_dtype, bad):
    """The ValueError for ids `bad` (a few of them) outside `key_dtype`'s range."""
    lo, hi = key_range(key_dtype)
    return ValueError(
        f"{what} holds ids outside the {np.dtype(key_dtype).name} key "
        f"range [{lo}, {hi}], e.g. {bad}. Use a table with key_dtype='int64' "
        "or hash the ids into range first")


def check_ids_in_key_range(values, key_dtype, what, lower=True):
    """NumPy integer `values` checked to fit `key_dtype` (`lower=False`: the
    upper bound only; ids < 0 are padding that is pruned); a ValueError
    names a few that do not."""
    values = np.asarray(values)
    lo, hi = key_range(key_dtype)
    if not values.size:
        return
    over = values > hi
    if lower and np.issubdtype(values.dtype, np.signedinteger):
        over = over | (values < lo)
    if over.any():
        raise ids_outside_key_range_error(what, key_dtype, values[over][:3].tolist())


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


def positive_int(name, value, allow_none=False):
    """`value` as an int (or None, with `allow_none`); a ValueError for any
    value but a positive integer (bools included)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        _fail(name, "None or a positive integer" if allow_none else "a positive integer", value)
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
    `LearningRateSchedule` / callable (checked when called). An array or
    variable is checked by its value."""
    import keras

    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule) or callable(value):
        return value
    if isinstance(value, keras.Variable) or (hasattr(value, "__array__")
                                             and not isinstance(value, numbers.Number)):
        check_float(name, float(np.asarray(value)), 0)
        return value
    return check_float(name, value, 0)


# -- the optimizers' hyper-parameters ------------------------------------------

def check_beta(name, value):
    """A decay rate of Adam's moments: a float in [0, 1)."""
    return check_float(name, value, 0, 1, max_open=True)


def check_non_negative(name, value):
    return check_float(name, value, 0)


def check_adagrad_decay(initial_accumulator_value, accumulator_decay_step,
                        accumulator_decay_rate):
    """AdagradDecay's own arguments, as (float, int, float)."""
    v, s, r = initial_accumulator_value, accumulator_decay_step, accumulator_decay_rate
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ValueError("`initial_accumulator_value` must be a float > 0. "
                         f"Received: initial_accumulator_value={v!r}")
    if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
        raise ValueError("`accumulator_decay_step` must be a positive integer. "
                         f"Received: accumulator_decay_step={s!r}")
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r <= 1:
        raise ValueError("`accumulator_decay_rate` must be a float in (0, 1]. "
                         f"Received: accumulator_decay_rate={r!r}")
    return float(v), s, float(r)


# Hyper-parameters checked for every optimizer of this package (Keras itself
# accepts e.g. a learning rate of -1 or NaN and trains to garbage).
HYPER_CHECKS = {
    "beta_1": lambda v: check_beta("beta_1", v),
    "beta_2": lambda v: check_beta("beta_2", v),
    "epsilon": lambda v: check_float("epsilon", v, 0),
    "momentum": lambda v: check_float("momentum", v, 0, 1),
    "initial_accumulator_value": lambda v: check_float("initial_accumulator_value", v, 0),
    "weight_decay": lambda v: check_float("weight_decay", v, 0, allow_none=True),
    "l1_regularization_strength": lambda v: check_float("l1_regularization_strength", v, 0),
    "l2_regularization_strength": lambda v: check_float("l2_regularization_strength", v, 0),
    "l2_shrinkage_regularization_strength": lambda v: check_float(
        "l2_shrinkage_regularization_strength", v, 0),
    "beta": lambda v: check_float("beta", v, 0),
}


def check_hyper_arguments(base_init, args, kwargs, learning_rate=check_learning_rate):
    """Checks the hyper-parameters of a call `base_init(*args, **kwargs)`
    (a Keras optimizer's `__init__`, defaults included) by `HYPER_CHECKS`;
    `learning_rate` checks the learning rate. A tensor or variable other
    than the learning rate is left to Keras; a call that does not bind is
    left for Keras to report."""
    try:
        bound = inspect.signature(base_init).bind_partial(*args, **kwargs)
    except TypeError:
        return
    bound.apply_defaults()
    for name, value in bound.arguments.items():
        if name == "learning_rate":
            learning_rate(value)
        elif name in HYPER_CHECKS and isinstance(value, (int, float, np.number)):
            HYPER_CHECKS[name](value)
