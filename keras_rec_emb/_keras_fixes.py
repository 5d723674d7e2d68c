"""The private Keras (and confluent-kafka) API that needs no TensorFlow,
used under both backends (private): `backend/tensorflow/compat.py` holds the
rest, imports TensorFlow (which the JAX backend must not need) and
re-exports these. Each entry says what it is and why the public API does
not do it.
"""

import functools
import weakref

import keras


def in_symbolic_build():
    """Whether Keras is running a layer only to infer shapes and build its
    state (`backend.compute_output_spec`, under Keras's `SymbolicScope`).

    Keras then feeds float32 placeholders whatever the real inputs' dtype
    (`Model.build_from_config`, every `.keras` load of a subclassed model, and
    `model.build(shape)`). An id layer that refused them would leave the model
    unbuilt, and Keras would skip loading its weights and optimizer state with
    only a warning; nothing there is executed, so the id layers accept any
    dtype in this scope. No public query exists.
    """
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def flatten_layers(model):
    """Every layer of `model`, nested ones included: public `model.layers`
    lists direct children only, and layers that hold layers do not all
    expose them."""
    return model._flatten_layers()  # pylint: disable=protected-access


def install_fix(versions, originals, owner, name, wrap, marker="_kre_fix"):
    """Replaces Keras's `owner.<name>` (a function, or a property's getter)
    by `wrap(keras_own)` once (idempotent), only when the installed Keras is
    one of `versions` (read the code it wraps again before adding one), and
    keeps Keras's own in `originals[name]`. Returns whether it is installed.
    Every correction of Keras in this module and in `backend/tensorflow/
    compat.py` is installed through it."""
    prop = vars(owner).get(name) if isinstance(owner, type) else None
    prop = prop if isinstance(prop, property) else None
    current = getattr(owner, name) if prop is None else prop.fget
    if getattr(current, marker, False):
        return True
    if keras.__version__ not in versions:
        return False
    originals[name] = current
    replacement = wrap(current)
    setattr(replacement, marker, True)
    setattr(owner, name, replacement if prop is None else property(replacement))
    return True


# Keras 3.15.1's `Sequential.build(input_shape)` (a Sequential without
# `keras.Input`) prepends an `InputLayer` of the first layer's
# `compute_dtype`, float32, which casts every batch: int64 ids above 2**24
# would lose their low bits (our layers refuse float ids, so `fit` failed).
# The correction gives that `InputLayer` the first layer's `ids_input_dtype`
# when it has one (our id layers); every other Sequential builds as Keras
# builds it. Installed by `fix_sequential_ids_input()` when
# `keras_rec_emb.layers` is imported.
KERAS_SEQUENTIAL_FIX_VERSIONS = ("3.15.1",)
KERAS_SEQUENTIAL_ORIGINALS = {}


def fix_sequential_ids_input():
    """Installs the correction described above (`install_fix`)."""
    from keras.src.backend.common.variables import standardize_shape
    from keras.src.layers.core.input_layer import InputLayer
    from keras.src.models.sequential import Sequential

    def wrap(keras_build):
        def build(self, input_shape=None):
            layers = self._layers  # pylint: disable=protected-access
            dtype = getattr(layers[0], "ids_input_dtype", None) if layers else None
            if dtype is not None and not isinstance(layers[0], InputLayer):
                try:
                    shape = standardize_shape(input_shape)
                except Exception:  # pylint: disable=broad-except
                    return keras_build(self, input_shape)  # not one tensor: Keras's rule
                self._layers = [InputLayer(batch_shape=shape, dtype=dtype)] + layers  # pylint: disable=protected-access
            return keras_build(self, input_shape)
        return build

    return install_fix(KERAS_SEQUENTIAL_FIX_VERSIONS, KERAS_SEQUENTIAL_ORIGINALS,
                       Sequential, "build", wrap)


# A subclassed model's export signature. Keras 3.15.1 records only the
# shapes of its first call (`_build_shapes_dict`), and `get_input_signature`
# gives every input the model's float `input_dtype`: ids would be exported as
# float32, which our id layers refuse. The correction records the dtypes of
# the first call's tensors (`Layer._maybe_build`, where Keras records the
# shapes) for `input_specs(model)`. Installed by `record_model_input_dtypes()`
# when `keras_rec_emb.layers` is imported.
KERAS_INPUT_DTYPES_FIX_VERSIONS = ("3.15.1",)
KERAS_INPUT_DTYPES_ORIGINALS = {}
# model -> the dtypes of its first call's tensor arguments. Not an attribute:
# a layer's attributes are tracked, and Keras would wrap the structure.
_INPUT_DTYPES = weakref.WeakKeyDictionary()


def _symbolic_model_classes():
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    return Functional, Sequential


def _tensor_dtype(x):
    if x is None or not hasattr(x, "dtype") or not hasattr(x, "shape"):
        return None
    return keras.backend.standardize_dtype(x.dtype)


def record_model_input_dtypes():
    """Installs the correction described above (`install_fix`)."""
    from keras.src.layers.layer import Layer

    symbolic = _symbolic_model_classes()

    def wrap(keras_maybe_build):
        def _maybe_build(self, call_spec):
            if not self.built and isinstance(self, keras.Model) and not isinstance(self, symbolic):
                # The tensor arguments in Keras's order (`get_shapes_dict`'s).
                _INPUT_DTYPES[self] = [
                    keras.tree.map_structure(_tensor_dtype, value)
                    for name, value in call_spec.tensor_arguments_dict.items()
                    if name not in ("mask", "args", "kwargs")]
            return keras_maybe_build(self, call_spec)
        return _maybe_build

    return install_fix(KERAS_INPUT_DTYPES_FIX_VERSIONS, KERAS_INPUT_DTYPES_ORIGINALS,
                       Layer, "_maybe_build", wrap)


def input_specs(model):
    """The endpoint signature of a built model (`keras.InputSpec`s), as
    `model.export` computes it but with a subclassed model's inputs of the
    dtypes its first call had (see above). The helper is only in `keras.src`."""
    from keras.src.export.export_utils import get_input_signature

    specs = get_input_signature(model)
    dtypes = _INPUT_DTYPES.get(model)
    if isinstance(model, _symbolic_model_classes()) or not dtypes or len(dtypes) != len(specs):
        return specs

    def with_dtype(spec, dtype):
        if dtype is None or not isinstance(spec, keras.InputSpec):
            return spec
        return keras.InputSpec(shape=spec.shape, dtype=dtype, name=spec.name)

    try:
        return [keras.tree.map_structure(with_dtype, spec, dtype)
                for spec, dtype in zip(specs, dtypes)]
    except (TypeError, ValueError):  # a structure Keras's shapes flattened otherwise
        return specs


def data_adapter_base():
    """Keras's `DataAdapter` base class, which `fit`, `evaluate` and
    `predict` use as the input pipeline as it is. The JAX backend's datasets
    are adapters so that Keras iterates them as a `tf.data.Dataset` (a new
    pass per epoch, no `shuffle`, the pass's end ending the epoch), which a
    `keras.utils.PyDataset` (indexed) cannot be. Used by `backend/jax/data.py`."""
    from keras.src.trainers.data_adapters import data_adapter

    return data_adapter.DataAdapter


def jax_iterator(numpy_iterator):
    """`numpy_iterator`'s elements as JAX arrays, as Keras's own adapters
    hand them to the JAX trainer (`data_adapter_utils.get_jax_iterator`).
    Used by `backend/jax/data.py`."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils.get_jax_iterator(numpy_iterator)


# -- confluent-kafka --------------------------------------------------------------


def kafka():
    """The `confluent_kafka` module, imported on first use: it is the optional
    `kafka` extra, so `import keras_rec_emb` must not need it. Raises an
    ImportError naming the extra when it is missing. Used by `data/kafka.py`."""
    try:
        import confluent_kafka  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError(
            "Kafka datasets need confluent-kafka, an optional dependency of keras-rec-emb: "
            f"install it with `pip install \"keras-rec-emb[kafka]\"`. ({e})") from e
    return confluent_kafka


class LazyKafka:
    """Stands for the `confluent_kafka` module in `data/kafka.py`: the first
    attribute read imports it (see `kafka()`), so that module imports without
    the `kafka` extra and its Kafka classes raise the clear ImportError."""

    def __getattr__(self, name):
        return getattr(kafka(), name)


@functools.cache
def _kafka_error_code(name):
    """The librdkafka error code whose `KafkaError(code).name()` is `name`:
    its internal codes (-200..-100) are public only as underscored class
    attributes, so they are found through the public constructor."""
    kafka_error = kafka().KafkaError
    return next(code for code in range(-200, -99) if kafka_error(code).name() == name)


def __getattr__(name):
    # librdkafka's codes for a broker connection lost (retried by librdkafka)
    # and for reaching the end of a partition (`enable.partition.eof`). Read
    # on first use, as the module is optional. Used by `data/kafka.py`.
    if name == "KAFKA_TRANSPORT":
        return _kafka_error_code("_TRANSPORT")
    if name == "KAFKA_PARTITION_EOF":
        return _kafka_error_code("_PARTITION_EOF")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Keras 3.15.1's `Trainer.compile` wraps the optimizer in its own
# `LossScaleOptimizer` under the "mixed_float16" policy, which cannot update
# a table: it keys variables by identity and densifies gradients to check
# them. The correction hands an optimizer Keras has just wrapped to `rewrap`
# (from `keras_rec_emb.optimizers`: our `LossScaleOptimizer` around an
# optimizer of ours, `None` for any other), so `compile` works as it does for
# Keras's optimizers; a wrapper the user passed is kept. Installed by
# `fix_compile_loss_scale(rewrap)` when `keras_rec_emb.optimizers` is imported.
KERAS_COMPILE_FIX_VERSIONS = ("3.15.1",)
KERAS_COMPILE_ORIGINALS = {}


def fix_compile_loss_scale(rewrap):
    """Installs the correction described above (`install_fix`)."""
    from keras.src.trainers.trainer import Trainer
    from keras.src.utils import tracking

    def wrap(keras_compile):
        @tracking.no_automatic_dependency_tracking
        def compile(self, optimizer="rmsprop", *args, **kwargs):  # pylint: disable=keyword-arg-before-vararg
            keras_compile(self, optimizer, *args, **kwargs)
            made = getattr(self, "optimizer", None)
            if made is not None and made is not optimizer:  # Keras's own wrapper
                replacement = rewrap(made)
                if replacement is not None:
                    self.optimizer = replacement

        compile.__doc__ = keras_compile.__doc__
        compile.__wrapped__ = keras_compile
        return compile

    return install_fix(KERAS_COMPILE_FIX_VERSIONS, KERAS_COMPILE_ORIGINALS,
                       Trainer, "compile", wrap)


# Keras 3.15.1's JAX trainer builds an unbuilt model, loss or metrics (the
# first `fit` or `evaluate`) from one batch that `Trainer._symbolic_build`
# reads from the epoch iterator, which it then resets. A stream's new pass (a
# Kafka dataset's) starts after what the first consumed, so no step trained
# on that batch. The correction takes it from the dataset's `_kre_peek()`
# (`backend/jax/data.py`), which keeps its pass, that batch first, as the
# epoch's. Any other input builds as Keras builds it. Installed by
# `fix_symbolic_build_peek()` when `backend/jax/data.py` is imported.
KERAS_SYMBOLIC_BUILD_FIX_VERSIONS = ("3.15.1",)
KERAS_SYMBOLIC_BUILD_ORIGINALS = {}


class _PeekOnce:
    """Stands for the epoch iterator in `Trainer._symbolic_build`: its one
    step's data iterator is itself, whose `next()` is the dataset's
    `_kre_peek()` (StopIteration for an empty dataset, as Keras's own)."""

    def __init__(self, peek):
        self._peek = peek

    def __iter__(self):
        return iter([(0, 0, self)])

    def __next__(self):
        return self._peek()


def fix_symbolic_build_peek():
    """Installs the correction described above (`install_fix`)."""
    from keras.src.trainers.trainer import Trainer

    def wrap(keras_symbolic_build):
        def _symbolic_build(self, iterator=None, data_batch=None):
            peek = getattr(getattr(iterator, "data_adapter", None), "_kre_peek", None)
            if data_batch is None and peek is not None:
                iterator = _PeekOnce(peek)
            return keras_symbolic_build(self, iterator=iterator, data_batch=data_batch)

        _symbolic_build.__wrapped__ = keras_symbolic_build
        return _symbolic_build

    return install_fix(KERAS_SYMBOLIC_BUILD_FIX_VERSIONS, KERAS_SYMBOLIC_BUILD_ORIGINALS,
                       Trainer, "_symbolic_build", wrap)


# Keras 3.15.1's JAX `predict` builds an unbuilt model on one batch of a pass
# of the data and predicts on a new pass: for a stream, one batch short. The
# correction builds it on the batch of the dataset's `_kre_peek()`, which the
# prediction then starts with. Installed by `fix_predict_build_peek()` when
# `backend/jax/data.py` is imported.
KERAS_PREDICT_BUILD_FIX_VERSIONS = ("3.15.1",)
KERAS_PREDICT_BUILD_ORIGINALS = {}


def fix_predict_build_peek():
    """Installs the correction described above (`install_fix`)."""
    from keras.src import backend
    from keras.src.backend.config import is_nnx_enabled
    from keras.src.backend.jax.trainer import JAXTrainer
    from keras.src.trainers.data_adapters import data_adapter_utils

    def wrap(keras_predict):
        @functools.wraps(keras_predict)
        def predict(self, x, *args, **kwargs):
            peek = getattr(x, "_kre_peek", None)
            if peek is not None and not all(layer.built for layer in flatten_layers(self)):
                try:
                    batch = peek()
                except StopIteration:  # an empty pass: Keras's own
                    batch = None
                if batch is not None:
                    inputs, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
                    if is_nnx_enabled():
                        self(inputs)
                    else:
                        with backend.StatelessScope():
                            self(inputs)
            return keras_predict(self, x, *args, **kwargs)

        return predict

    return install_fix(KERAS_PREDICT_BUILD_FIX_VERSIONS, KERAS_PREDICT_BUILD_ORIGINALS,
                       JAXTrainer, "predict", wrap)


def variable_index(optimizer, variable):
    """The index of `variable` in the optimizer's slot lists, as Keras's own
    `update_step`s find it (`Optimizer._get_variable_index`; no public
    accessor). Used by `optimizers/deeprec_optimizers.py`."""
    return optimizer._get_variable_index(variable)  # pylint: disable=protected-access


def uses_weight_decay(optimizer, variable):
    """Whether `variable` takes weight decay, honouring
    `exclude_from_weight_decay` (`Optimizer._use_weight_decay`; no public
    accessor). Used by the TensorFlow table optimizer and `AdamW`."""
    return optimizer._use_weight_decay(variable)  # pylint: disable=protected-access


# Keras 3.15.1's JAX trainer jits its train, test and predict steps with
# its module's `jit` (`jax.jit` unless Flax NNX is on). The correction
# hands each jitted step to `dispatch(jitted)`
# (`backend/jax/dispatch.OrderedJit`: JAX refuses its C++ dispatch to
# computations holding table calls, and its Python dispatch costs about
# 2 ms a step of a model with 26 tables). Installed by
# `dispatch_jax_trainer_steps(dispatch)` when `keras_rec_emb.layers` is
# imported under JAX; NNX's jit is left as it is.
KERAS_JAX_JIT_FIX_VERSIONS = ("3.15.1",)
KERAS_JAX_JIT_ORIGINALS = {}


def dispatch_jax_trainer_steps(dispatch):
    """Installs the correction described above (`install_fix`)."""
    import jax
    from keras.src.backend.jax import trainer

    def wrap(keras_jit):
        def jit(fun, *args, **kwargs):
            jitted = keras_jit(fun, *args, **kwargs)
            return dispatch(jitted) if keras_jit is jax.jit else jitted
        return jit

    return install_fix(KERAS_JAX_JIT_FIX_VERSIONS, KERAS_JAX_JIT_ORIGINALS, trainer, "jit",
                       wrap)
