"""`AdaptiveEmbedding`'s JAX half: the forward of
`keras_rec_emb.layers.AdaptiveEmbedding` (written once) under Keras's JAX
backend, `AdaptiveBackend` below.

The TensorFlow backend's promotion (backend/tensorflow/adaptive.py) with
the same tables, sentinels and config (_adaptive_spec.py). Under `jit`
shapes are fixed: a sized `jnp.unique`, masks and `where` replace
`tf.unique`, `boolean_mask` and `dynamic_stitch`; promoted rows are written
by `ffi.merge_rows`. One `custom_vjp` holds the training step: its backward
gives the static table the gradient of the ids it served and applies the
others' to `dynamic` with its optimizer's rule.

Ids < 0 are the JAX tables' padding: served by the static table only, never
counted or promoted. Where a batch reads a static row twice, Adagrad's
numbers differ from TensorFlow's as `MultiHashEmbedding`'s do (multi_hash.py).
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb.backend.jax import ffi, hashing
from keras_rec_emb.backend.jax.ids import check_combinable, integer_ids, numpy_ids
from keras_rec_emb.backend.jax.layers import combine_last_axis

_NOT_PROMOTED, _NEWLY_PROMOTED, _PROMOTED = 0, 1, 2


def _train_forward(layer, ids, mask, static):
    """The training step's forward on flat ids: (rows, residuals)."""
    handle, dim = layer.dynamic.handle, layer.embedding_dim
    counting = layer.promote_threshold is not None
    valid = ids >= 0
    # 1. Count (the admitting lookup reads the no-permission NaN, a read-only
    # probe after it the +inf initial row of the ids it admitted).
    probe = ffi.lookup(handle, ids, dim, insert=counting, prune=True)[:, 0]
    if counting:
        after = ffi.lookup(handle, ids, dim, insert=False, prune=True)[:, 0]
        newly = jnp.isnan(probe) & jnp.isinf(after)
    else:
        newly = jnp.zeros_like(valid)
    code = jnp.where(jnp.isfinite(probe), _PROMOTED,
                     jnp.where(newly, _NEWLY_PROMOTED, _NOT_PROMOTED))
    code = jnp.where(valid, code, _NOT_PROMOTED)
    n = ids.shape[0]
    uniq, idx = jnp.unique(ids, size=n, fill_value=-1, return_inverse=True)
    idx = idx.reshape(-1)
    occurrences = jax.ops.segment_sum(jnp.ones_like(idx), idx, n)
    present = (occurrences > 0) & (uniq >= 0)
    status = jnp.where(present, jax.ops.segment_max(code, idx, n), _NOT_PROMOTED)
    # 2. Copy the static rows of newly promoted ids (and of ids the mask sends
    # to the table that have no row yet) into the table.
    to_copy = status == _NEWLY_PROMOTED
    forced = jnp.zeros_like(to_copy)
    if mask is not None:
        wants = jax.ops.segment_max(mask.astype(jnp.int32), idx, n) > 0
        forced = present & (status == _NOT_PROMOTED) & wants
        to_copy = to_copy | forced
    if counting:  # -1 keeps the table's count; a forced id this batch's
        freqs = jnp.where(forced, occurrences, -1)
    else:  # the serving lookup counts
        freqs = jnp.zeros_like(occurrences)
    values = jax.lax.stop_gradient(static[layer.static_bucket(uniq)])
    ffi.merge_rows(handle, uniq, values.astype(jnp.float32), freqs, to_copy & present)
    # 3. Serve: each table only sees the ids it serves.
    use_ev = (mask != 0) if mask is not None else status[idx] > _NOT_PROMOTED
    use_ev = use_ev & valid
    ev_keys = jnp.where(use_ev, ids, -1)
    ev_rows = ffi.lookup(handle, ev_keys, dim, insert=not counting, prune=True)
    buckets = layer.static_bucket(ids)
    rows = jnp.where(use_ev[:, None], ev_rows, static[buckets].astype(jnp.float32))
    return rows, (ev_keys, use_ev, buckets)


def _serve(layer, ids, mask, static):
    """Inference on flat ids: ids with a row in the table read it (those the
    mask sends there), the others their static bucket; nothing changes."""
    probe = ffi.lookup(layer.dynamic.handle, ids, layer.embedding_dim, insert=False,
                       prune=True)
    use_ev = jnp.isfinite(probe[:, 0]) & (ids >= 0)
    if mask is not None:
        use_ev = use_ev & (mask != 0)
    static_rows = static[layer.static_bucket(ids)].astype(jnp.float32)
    return jnp.where(use_ev[:, None], probe, static_rows)


def _step(layer, conditional, with_mask):
    """step(ids, mask, static, step) -> (rows, trained): a training step
    whose backward updates both tables; with `conditional`, only when
    differentiated (else it serves, `trained` 0)."""

    @jax.custom_vjp
    def step_fn(ids, mask, static, step):
        mask = mask if with_mask else None
        if conditional:
            return _serve(layer, ids, mask, static), jnp.zeros_like(step)
        return _train_forward(layer, ids, mask, static)[0], jnp.ones_like(step)

    def forward(ids, mask, static, step):
        rows, saved = _train_forward(layer, ids, mask if with_mask else None, static)
        return (rows, jnp.ones_like(step)), (saved, static, step)

    def backward(residuals, grads):
        (ev_keys, use_ev, buckets), static, step = residuals
        g = grads[0].astype(jnp.float32)
        if layer.dynamic.table_rule is not None:
            layer.dynamic._apply_gradients(  # pylint: disable=protected-access
                [(ev_keys, jnp.where(use_ev[:, None], g, 0.0), True, None, None)], step)
        static_grad = jnp.zeros(static.shape, jnp.float32).at[buckets].add(
            jnp.where(use_ev[:, None], 0.0, g))
        return None, None, static_grad.astype(static.dtype), None

    step_fn.defvjp(forward, backward)
    return step_fn


class AdaptiveBackend:
    """What `AdaptiveEmbedding` does its own way under JAX (dense ids; ids
    < 0 served by the static table only)."""

    SUPPORTS_JIT = True

    def static_bucket(self, ids):
        """Row of the static table of each id: `fingerprint64(id) mod
        hash_bucket_size` (shape of `ids`)."""
        return hashing.hash_to_range(jnp.asarray(ids), self.hash_bucket_size)

    def compute_output_spec(self, inputs, adaptive_mask=None, training=None):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape),
                                 dtype=self.compute_dtype)

    def __call__(self, inputs, *args, **kwargs):
        return super().__call__(numpy_ids(inputs, f"AdaptiveEmbedding '{self.name}'",
                                          self.dynamic.key_dtype), *args, **kwargs)

    def call(self, inputs, adaptive_mask=None, training=None):
        ids = integer_ids(inputs, f"AdaptiveEmbedding '{self.name}'", self.dynamic.key_dtype,
                          via=np.int64)
        check_combinable(ids, self.combiner, f"AdaptiveEmbedding '{self.name}'")
        mask = None
        if adaptive_mask is not None:
            mask = jnp.asarray(adaptive_mask)
            if mask.shape != ids.shape:
                raise ValueError(
                    f"`adaptive_mask` must have the shape of the ids {tuple(ids.shape)}. "
                    f"Received: adaptive_mask of shape {tuple(mask.shape)}")
            mask = mask.reshape(-1).astype(jnp.int32)
        flat = ids.reshape(-1)
        static = self.static_embeddings.value
        conditional = training is None and self.trainable
        if not (conditional or (training and self.trainable)):
            rows = _serve(self, flat, mask, static)
        else:
            counter = self.dynamic.iterations
            step = counter.value
            self.dynamic._new_step()  # pylint: disable=protected-access
            fn = _step(self, conditional, mask is not None)
            rows, trained = fn(flat, mask if mask is not None else jnp.zeros_like(flat),
                               static, step)
            counter.assign(step + trained)
        rows = rows.reshape(ids.shape + (self.embedding_dim,)).astype(self.compute_dtype)
        return rows if self.combiner is None else combine_last_axis(rows, None, self.combiner)
