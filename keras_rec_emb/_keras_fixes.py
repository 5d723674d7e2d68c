"""The private Keras API that needs no TensorFlow, used under both backends
(private): `_compat.py` holds the rest, and imports TensorFlow, which the
JAX backend must not need; `_compat` re-exports these. Each entry says what
it is and why the public API does not do it.
"""

import keras


def in_symbolic_build():
    """Whether Keras is running a layer only to infer shapes and build its
    state (`backend.compute_output_spec`, under Keras's `SymbolicScope`).

    Keras then feeds float32 placeholders of the recorded shapes whatever
    the real inputs' dtype: `Model.build_from_config` (every `.keras` load of
    a subclassed model) and `model.build(shape)` make
    `backend.KerasTensor(shape)` with the default float dtype. An id layer
    that refused them would leave the model unbuilt, and Keras would then
    skip loading its dense weights and optimizer state (with only a
    warning). Nothing computed there is executed, so the id layers accept
    any dtype in this scope (`_checks.integer_ids`). No public query exists.
    Used by `_checks.integer_ids`, `layers.GroupEmbedding` and
    `_jax.ids.integer_ids`.
    """
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


# Keras 3.15.1's `Sequential.build(input_shape)` (a Sequential without
# `keras.Input`, built from its first batch inside `fit`, by `predict`, or by
# `model.build(shape)`) prepends an `InputLayer` whose dtype is the first
# layer's `compute_dtype`, float32: the functional model it builds then
# casts every batch to float32 before the first layer, so int64 ids above
# 2**24 would lose their low bits (our layers refuse float ids, so `fit`
# failed instead). The correction gives that `InputLayer` the dtype of ids,
# the first layer's `ids_input_dtype`, when it has one (our id layers);
# every other Sequential builds as Keras builds it. Installed once by
# `fix_sequential_ids_input()` (called when `keras_rec_emb.layers` is
# imported), only for the versions in `KERAS_SEQUENTIAL_FIX_VERSIONS`
# (read `Sequential.build` again before adding one).
KERAS_SEQUENTIAL_FIX_VERSIONS = ("3.15.1",)
# Keras's `Sequential.build` that the correction wraps (filled when installed).
KERAS_SEQUENTIAL_ORIGINALS = {}


def _sequential_classes():
    from keras.src.layers.core.input_layer import InputLayer
    from keras.src.models.sequential import Sequential
    from keras.src.backend.common.variables import standardize_shape

    return Sequential, InputLayer, standardize_shape


def fix_sequential_ids_input():
    """Installs the correction described above (idempotent). Returns whether
    it is installed (False for a Keras version not listed)."""
    sequential, input_layer, standardize_shape = _sequential_classes()
    if getattr(sequential.build, "_kre_fix", False):
        return True
    if keras.__version__ not in KERAS_SEQUENTIAL_FIX_VERSIONS:
        return False
    keras_build = sequential.build
    KERAS_SEQUENTIAL_ORIGINALS["build"] = keras_build

    def build(self, input_shape=None):
        layers = self._layers  # pylint: disable=protected-access
        dtype = getattr(layers[0], "ids_input_dtype", None) if layers else None
        if dtype is not None and not isinstance(layers[0], input_layer):
            try:
                shape = standardize_shape(input_shape)
            except Exception:  # pylint: disable=broad-except
                return keras_build(self, input_shape)  # not one tensor: Keras's rule
            self._layers = [input_layer(batch_shape=shape, dtype=dtype)] + layers  # pylint: disable=protected-access
        return keras_build(self, input_shape)

    build._kre_fix = True  # pylint: disable=protected-access
    sequential.build = build
    return True


# Keras 3.15.1's `Trainer.compile` wraps the optimizer in its own
# `keras.optimizers.LossScaleOptimizer` under the "mixed_float16" policy
# (`auto_scale_loss=True`). That wrapper cannot update a table: it keys
# variables by identity and densifies gradients to check them (a table's
# gradient has no dense shape). The correction hands an optimizer that Keras
# has just wrapped so to `rewrap` (set by `keras_rec_emb.optimizers`: our
# `LossScaleOptimizer` around an optimizer of ours, `None` for any other),
# so `compile(optimizer=kre.optimizers.Adagrad(...))` just works as it does
# for Keras's optimizers; a wrapper the user passed is kept as given.
# Installed once by `fix_compile_loss_scale(rewrap)` (called when
# `keras_rec_emb.optimizers` is imported), only for the versions in
# `KERAS_COMPILE_FIX_VERSIONS` (read `Trainer.compile` again before adding
# one).
KERAS_COMPILE_FIX_VERSIONS = ("3.15.1",)
# Keras's `Trainer.compile` that the correction wraps (filled when installed).
KERAS_COMPILE_ORIGINALS = {}


def _trainer_class():
    from keras.src.trainers.trainer import Trainer
    from keras.src.utils import tracking

    return Trainer, tracking.no_automatic_dependency_tracking


def fix_compile_loss_scale(rewrap):
    """Installs the correction described above (idempotent). Returns whether
    it is installed (False for a Keras version not listed)."""
    trainer, no_tracking = _trainer_class()
    if getattr(trainer.compile, "_kre_fix", False):
        return True
    if keras.__version__ not in KERAS_COMPILE_FIX_VERSIONS:
        return False
    keras_compile = trainer.compile
    KERAS_COMPILE_ORIGINALS["compile"] = keras_compile

    @no_tracking
    def compile(self, optimizer="rmsprop", *args, **kwargs):  # pylint: disable=keyword-arg-before-vararg
        keras_compile(self, optimizer, *args, **kwargs)
        made = getattr(self, "optimizer", None)
        if made is not None and made is not optimizer:  # Keras's own wrapper
            replacement = rewrap(made)
            if replacement is not None:
                self.optimizer = replacement

    compile.__doc__ = keras_compile.__doc__
    compile.__wrapped__ = keras_compile
    compile._kre_fix = True  # pylint: disable=protected-access
    trainer.compile = compile
    return True
