"""Integer ids in, under Keras's JAX backend: the checks of the TensorFlow
layers' ids (`keras_rec_emb.backend.tensorflow.checks.integer_ids`), with their messages
(`keras_rec_emb._checks_core`).

Non-integer ids are refused by dtype, static under `jit` too. Ids that may
not fit the keys are checked by value: a concrete array raises TensorFlow's
eager ValueError; a traced one gets a host check the lookup's ids depend
on, so the step fails (a `JaxRuntimeError`) before any wrapped id is looked
up, as TensorFlow's assertion op fails its graph.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb._checks_core import (check_ids_in_key_range, ids_may_not_fit,
                                        is_integer_dtype, non_integer_ids_error)
from keras_rec_emb._keras_fixes import in_symbolic_build


def integer_ids(ids, what, key_dtype, lower=True, via=None, via_what=None):
    """`ids` (array-like, JAX array or tracer) as a JAX array of
    `key_dtype`; a TypeError naming `what` if they are not integers, a
    ValueError (a failing step when traced) if one does not fit the keys.
    `lower=False` checks the upper bound only (ids < 0 are padding).
    `via`: a dtype the ids are first checked to fit, in full, as TensorFlow
    first casts them to int64 (`via_what`: the name for that check and the
    TypeError; default `what`)."""
    key_dtype = np.dtype(key_dtype)
    dtype = getattr(ids, "dtype", None)
    if dtype is None:
        ids = np.asarray(ids)
        dtype = ids.dtype
    dtype = np.dtype(dtype)
    if not is_integer_dtype(dtype):
        if in_symbolic_build():  # shapes only: see _keras_fixes.in_symbolic_build
            return jnp.zeros(np.shape(ids), key_dtype)
        raise non_integer_ids_error(via_what or what, dtype.name)
    if dtype == key_dtype:
        return jnp.asarray(ids)
    checks = [(key_dtype, what, lower and np.issubdtype(dtype, np.signedinteger))]
    if via is not None and ids_may_not_fit(dtype, via):
        checks.insert(0, (np.dtype(via), via_what or what, True))
    checks = [c for c in checks if ids_may_not_fit(dtype, c[0])]
    if not checks:
        return jnp.asarray(ids).astype(key_dtype)
    if not isinstance(ids, jax.core.Tracer):
        values = np.asarray(ids)
        for check_dtype, check_what, check_lower in checks:
            check_ids_in_key_range(values, check_dtype, check_what, check_lower)
        return jnp.asarray(values.astype(key_dtype))
    for check_dtype, check_what, check_lower in checks:
        ids = _traced_check(ids, check_dtype, check_what, check_lower)
    return ids.astype(key_dtype)


def _traced_check(ids, key_dtype, what, lower):
    info = np.iinfo(key_dtype)
    outside = ids > jnp.asarray(info.max, ids.dtype)
    if lower:
        outside = outside | (ids < jnp.asarray(info.min, ids.dtype))
    flat = outside.reshape(-1)
    sample = ids.reshape(-1)[jnp.argmax(flat)] if flat.size else jnp.zeros((), ids.dtype)

    def check(any_outside, sample):
        if bool(any_outside):
            check_ids_in_key_range(np.asarray([sample]), key_dtype, what, lower)
        return np.zeros((), ids.dtype)

    # The ids depend on the check's (zero) result, so the check runs first.
    zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), ids.dtype), jnp.any(flat), sample)
    return ids + zero


def numpy_ids(ids, what, key_dtype, lower=True):
    """NumPy 64-bit integer `ids` checked to fit `key_dtype` and cast to it in
    JAX's 32-bit mode, where Keras would narrow them before the layer's
    `call` (so the layers call it in `__call__`); anything else as it is."""
    if (not jax.config.jax_enable_x64 and isinstance(ids, np.ndarray)
            and is_integer_dtype(ids.dtype) and ids.dtype.itemsize == 8
            and ids_may_not_fit(ids.dtype, key_dtype)):
        check_ids_in_key_range(ids, key_dtype, what, lower)
        return ids.astype(key_dtype)
    return ids


def float_weights(weights, ids, what):
    """`weights` as float32, checked to have the shape of `ids` (one weight
    per id); `what` names them in the error."""
    weights = keras.ops.convert_to_tensor(weights, dtype="float32")
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"{what} must have the ids' shape {tuple(ids.shape)} (one weight per "
                         f"id). Received: weights of shape {tuple(weights.shape)}")
    return weights


def check_combinable(ids, combiner, what):
    """Refuses scalar ids when `combiner` (not None) combines their last axis."""
    if combiner is not None and ids.ndim < 1:
        raise ValueError(f"{what} with combiner={combiner!r} combines the last axis of the "
                         f"ids ([..., L]); received scalar ids of shape {tuple(ids.shape)}")
