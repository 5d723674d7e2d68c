"""Optimizers that update dense variables, `keras.layers.Embedding` and
embedding tables (with a fused sparse kernel per table), under either
Keras backend."""

from keras_rec_emb import _keras_fixes
from keras_rec_emb.optimizers.deeprec_optimizers import AdagradDecay, AdamAsync, AdamW
from keras_rec_emb.optimizers.keras_optimizers import SGD, Adagrad, Adam, Ftrl
from keras_rec_emb.optimizers.loss_scale import LossScaleOptimizer
from keras_rec_emb.optimizers.loss_scale import rewrap_keras_auto_wrapper as _rewrap

__all__ = ["SGD", "Adagrad", "Adam", "Ftrl", "AdamAsync", "AdagradDecay", "AdamW",
           "LossScaleOptimizer"]

# Under "mixed_float16", `compile` wraps an optimizer of ours in our
# LossScaleOptimizer, not Keras's (see _keras_fixes.fix_compile_loss_scale).
_keras_fixes.fix_compile_loss_scale(_rewrap)


def __dir__():
    return list(__all__)  # the public names only, not the implementing modules
