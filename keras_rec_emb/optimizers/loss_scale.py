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

    Scales the loss and unscales every gradient (a table's rows included),
    skipping steps and adjusting the scale exactly as Keras's, whose own
    wrapper cannot read a table's gradient. `compile` under
    `"mixed_float16"` wraps an optimizer of `keras_rec_emb.optimizers` in
    this one by itself; pass it yourself to choose `initial_scale` or
    `dynamic_growth_steps`. See docs/semantics.md, 'Optimizers and mixed
    precision'.

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
    """Ours in place of the Keras `LossScaleOptimizer` that `compile` just put
    around an optimizer of ours; `None` for any other (Keras's is right)."""
    if (type(optimizer) is not keras.optimizers.LossScaleOptimizer
            or not LossScaleTables._check_inner(optimizer.inner_optimizer)
            or optimizer.built):
        return None
    return LossScaleOptimizer(optimizer.inner_optimizer,
                              initial_scale=optimizer.initial_scale,
                              dynamic_growth_steps=optimizer.dynamic_growth_steps,
                              name=optimizer.name)
