"""Optimizers that update dense variables, `keras.layers.Embedding` and
embedding tables (with a fused sparse kernel per table)."""

from keras_rec_emb import _backend

if _backend.is_jax():
    # Under Keras's JAX backend, without TensorFlow (keras_rec_emb/backend/jax).
    from keras_rec_emb.backend.jax.optimizers import (
        SGD,
        Adagrad,
        AdagradDecay,
        Adam,
        AdamAsync,
        AdamW,
        Ftrl,
    )

    __all__ = ["SGD", "Adagrad", "Adam", "Ftrl", "AdamAsync", "AdagradDecay", "AdamW"]
    from keras_rec_emb.backend.jax import tensorflow_only_getattr

    __getattr__ = tensorflow_only_getattr("keras_rec_emb.optimizers", ("LossScaleOptimizer",),
                                          __all__)
else:
    from keras_rec_emb.optimizers.deeprec_optimizers import AdagradDecay, AdamAsync, AdamW
    from keras_rec_emb.optimizers.keras_optimizers import SGD, Adagrad, Adam, Ftrl
    from keras_rec_emb.backend.tensorflow import compat as _compat
    from keras_rec_emb.optimizers.loss_scale import LossScaleOptimizer
    from keras_rec_emb.optimizers.loss_scale import rewrap_keras_auto_wrapper as _rewrap

    __all__ = ["SGD", "Adagrad", "Adam", "Ftrl", "AdamAsync", "AdagradDecay", "AdamW",
               "LossScaleOptimizer"]

    # Under "mixed_float16", `compile` wraps an optimizer of ours in our
    # LossScaleOptimizer, not Keras's (see _compat.fix_compile_loss_scale).
    _compat.fix_compile_loss_scale(_rewrap)


def __dir__():
    return list(__all__)  # the public names only, not the implementing modules
