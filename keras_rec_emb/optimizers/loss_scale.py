"""Dynamic loss scaling for mixed precision with embedding tables."""

import keras

from keras_rec_emb import _backend

if _backend.is_jax():
    from keras_rec_emb.backend.jax.optimizers import LossScaleTables
else:
    from keras_rec_emb.backend.tensorflow.optimizer import LossScaleTables


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class LossScaleOptimizer(LossScaleTables, keras.optimizers.LossScaleOptimizer):
    """`keras.optimizers.LossScaleOptimizer` for models with embedding tables.

    Under the `"mixed_float16"` policy, gradients of a float16 loss are
    scaled up so that small ones do not underflow; this wrapper scales the
    loss, unscales every gradient (a table's `tf.IndexedSlices` rows
    included), skips the step and halves the scale when a gradient is not
    finite, and doubles it after `dynamic_growth_steps` finite steps, exactly
    as Keras's. Keras's own wrapper cannot read a table's gradient (its rows
    are keyed by ids, not positions), so where `compile` wraps an optimizer
    by itself under `"mixed_float16"`, an optimizer of
    `keras_rec_emb.optimizers` is wrapped in this one instead (named
    `"loss_scale_optimizer"`, Keras's defaults): `compile(optimizer=
    keras_rec_emb.optimizers.Adagrad(...))` just works. Pass this one to
    `compile` yourself to choose `initial_scale` or `dynamic_growth_steps`;
    Keras uses it as is.

    Tables stay float32 (their rows are cast to the layer's compute dtype,
    float16, after the lookup; the float16 gradient is applied to the
    float32 rows), like Keras's own float32 master weights.

    Under JAX a table is updated in the backward pass of its lookup, before
    the step's other gradients exist: there it divides its rows' gradient
    by the loss scale in effect in the step, and skips its update when that
    gradient is not finite (the dense weights skip when any gradient is
    not finite, as in Keras; a table's zero-size anchor carries no value
    into that check). The scale then halves or grows as in Keras.

    Args:
        inner_optimizer: an optimizer of `keras_rec_emb.optimizers`.
        initial_scale: float. The initial loss scale. Defaults to `2**15`.
        dynamic_growth_steps: int. Steps with finite gradients after which
            the scale doubles. Defaults to `2000`.
        name: str or `None`.
        **kwargs: as `keras.optimizers.LossScaleOptimizer`.

    Example:

    >>> keras.mixed_precision.set_global_policy("mixed_float16")
    >>> ids = keras.Input(shape=(2,), dtype="int32")
    >>> x = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")(ids)
    >>> out = keras.layers.Dense(1, dtype="float32")(x)
    >>> model = keras.Model(ids, out)
    >>> model.compile(loss="mse", optimizer=keras_rec_emb.optimizers.Adagrad(0.1))
    >>> type(model.optimizer).__name__, type(model.optimizer.inner_optimizer).__name__
    ('LossScaleOptimizer', 'Adagrad')
    >>> history = model.fit(np.array([[1, 10**6], [7, 1]]), np.ones((2, 1)),
    ...                     verbose=0)
    >>> model.compile(loss="mse", optimizer=keras_rec_emb.optimizers.LossScaleOptimizer(
    ...     keras_rec_emb.optimizers.SGD(0.1), dynamic_growth_steps=1000))
    >>> history = model.fit(np.array([[1, 10**6], [7, 1]]), np.ones((2, 1)),
    ...                     verbose=0)
    >>> keras.mixed_precision.set_global_policy("float32")
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer,
                 initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000,
                 name: str | None = None, **kwargs):
        if not self._check_inner(inner_optimizer):
            raise TypeError(
                "`inner_optimizer` must be an optimizer of `keras_rec_emb.optimizers` "
                "(for a model without embedding tables, use "
                "keras.optimizers.LossScaleOptimizer). Received: "
                f"inner_optimizer={inner_optimizer!r}")
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)


def rewrap_keras_auto_wrapper(optimizer):
    """Our `LossScaleOptimizer` in place of the `keras.optimizers.
    LossScaleOptimizer` that `compile` has just put around an optimizer of
    ours (same inner optimizer, name and settings); `None` for any other
    optimizer (Keras's wrapper is right for it). Installed by
    `_compat.fix_compile_loss_scale`."""
    if (type(optimizer) is not keras.optimizers.LossScaleOptimizer
            or not LossScaleTables._check_inner(optimizer.inner_optimizer)
            or optimizer.built):
        return None
    return LossScaleOptimizer(optimizer.inner_optimizer,
                              initial_scale=optimizer.initial_scale,
                              dynamic_growth_steps=optimizer.dynamic_growth_steps,
                              name=optimizer.name)
