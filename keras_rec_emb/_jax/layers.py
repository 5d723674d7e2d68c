"""`EmbeddingVariable` under Keras's JAX backend (dense ids, no combiner).

Where the update happens. The table is updated in the backward pass of its
lookup, as TPU embedding does (and keras-rs's `TableConfig(optimizer=...)`
reflects): the lookup is a `jax.custom_vjp` whose backward applies the
rows' gradient to the table with the layer's own optimizer rule, inside the
jitted training step, ordered after the forward lookup by the table
effect's token (`ffi`). Not in `optimizer.apply`, because:

* Keras's JAX trainer differentiates the loss with respect to
  `trainable_variables` only, arrays of fixed shape. The rows a batch reads
  from a growing table have no such variable: carrying their gradient to
  the optimizer would take a fixed-capacity gradient buffer per table and a
  side channel for the batch's keys, and the optimizer's `stateless_apply`
  does not see the layer's state.
* The update is a side effect on the C++ table either way; in the backward
  it is one fused sparse apply per table and step, with no copy of the
  gradient through the trainer.

What follows: the table's optimizer is the layer's (`optimizer=`), not
`model.compile`'s, and its step counter is the layer's own `iterations`
(a non-trainable variable counting training calls), which drives learning
rate schedules and the rows' versions. Clipping (`clipnorm`, `clipvalue`,
`global_clipnorm`), EMA, gradient accumulation and loss scaling are
refused with an error: the backward sees this table's gradient alone,
before the trainer's optimizer could clip or unscale it. A zero-size
trainable variable (`anchor`) is the lookup's differentiable input, so
that `jax.grad` runs the backward at all; its gradient is empty.
"""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb._jax import ffi, saving

_RULES_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "optimizers", "rules.py")


@functools.cache
def rules():
    """keras_rec_emb/optimizers/rules.py's RULES, loaded from its file: the
    module is plain Python, but importing it through its package would
    import the TensorFlow optimizers."""
    spec = importlib.util.spec_from_file_location("keras_rec_emb_jax_rules", _RULES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RULES


class TableRule:
    """The sparse rule of a Keras optimizer: `keras.optimizers.SGD` (without
    momentum) or `keras.optimizers.Adagrad`, learning rate constant or a
    schedule."""

    _REFUSED = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "loss_scale_factor",
                "gradient_accumulation_steps")

    def __init__(self, optimizer):
        if not isinstance(optimizer, (keras.optimizers.SGD, keras.optimizers.Adagrad)):
            raise ValueError(
                "Under the JAX backend an EmbeddingVariable's `optimizer` must be "
                "keras.optimizers.SGD or keras.optimizers.Adagrad (so far). "
                f"Received: optimizer={optimizer!r}")
        config = optimizer.get_config()
        for name in self._REFUSED:
            if config.get(name) not in (None, False):
                raise ValueError(
                    f"Under the JAX backend the table is updated in the backward pass of its "
                    f"lookup, which does not support `{name}`. Received: {name}="
                    f"{config[name]!r}")
        if isinstance(optimizer, keras.optimizers.SGD) and (config["momentum"] or
                                                             config["nesterov"]):
            raise ValueError(
                "Under the JAX backend SGD's table rule has no momentum (so far). Received: "
                f"momentum={config['momentum']}, nesterov={config['nesterov']}")
        lr = config["learning_rate"]
        self.schedule = (keras.optimizers.schedules.deserialize(lr) if isinstance(lr, dict)
                         else None)
        self.learning_rate = None if self.schedule else float(lr)
        self.weight_decay = float(config.get("weight_decay") or 0.0)
        if isinstance(optimizer, keras.optimizers.SGD):
            self.rule, self.extra, self.slots = rules()["sgd"], {}, ()
        else:
            self.rule = rules()["adagrad"]
            self.extra = {"epsilon": float(config["epsilon"])}
            self.slots = (("accumulator", float(config["initial_accumulator_value"])),)

    def hyper(self, step):
        """The rule's hyper-parameters at `step`, in the kernel's order."""
        lr = (jnp.asarray(self.schedule(step), jnp.float32) if self.schedule is not None
              else jnp.float32(self.learning_rate))
        values = dict(self.extra, learning_rate=lr, decay=lr * self.weight_decay)
        return jnp.stack([jnp.asarray(v, jnp.float32) for v in self.rule.ordered(values)])


@functools.lru_cache(maxsize=None)
def _training_lookup(handle, dim, rule, hparam_names, slots):
    """lookup(ids, anchor, hyper, step): rows, inserting; its backward
    applies the rows' gradient to the table (see the top)."""

    @jax.custom_vjp
    def lookup(ids, anchor, hyper, step):
        del anchor, hyper, step
        return ffi.lookup(handle, ids, dim, insert=True)

    def forward(ids, anchor, hyper, step):
        return ffi.lookup(handle, ids, dim, insert=True), (ids, anchor, hyper, step)

    def backward(saved, grads):
        ids, anchor, hyper, step = saved
        ffi.apply(handle, ids, grads.astype(jnp.float32), hyper, step, rule, hparam_names, slots)
        return None, jnp.zeros_like(anchor), jnp.zeros_like(hyper), None

    lookup.defvjp(forward, backward)
    return lookup


@keras.saving.register_keras_serializable(package="keras_rec_emb", name="EmbeddingVariable")
class EmbeddingVariable(keras.layers.Layer):
    """Rows of a growing hash table for integer ids of any shape, under
    Keras's JAX backend (the TensorFlow backend's `EmbeddingVariable` with
    `combiner=None`).

    Args:
        embedding_dim: int >= 1, the row width.
        optimizer: `keras.optimizers.SGD` or `keras.optimizers.Adagrad`: the
            table's own update rule, applied in the backward pass of the
            lookup (the model's optimizer trains the other weights).
        initializer: draws the `[default_value_dim, embedding_dim]` matrix
            whose row `id mod default_value_dim` a new id starts from.
        key_dtype: "int32" (JAX's default) or "int64" (with JAX's x64 mode).
        default_value_dim: int >= 1, rows of that matrix.
        num_shards: the table's lock shards, in [1, 65536].
    """

    def __init__(self, embedding_dim, optimizer, initializer="truncated_normal",
                 key_dtype="int32", default_value_dim=4096, num_shards=32, **kwargs):
        super().__init__(**kwargs)
        if (isinstance(embedding_dim, bool) or not isinstance(embedding_dim, (int, np.integer))
                or embedding_dim <= 0):
            raise ValueError("`embedding_dim` must be a positive integer. Received: "
                             f"embedding_dim={embedding_dim!r}")
        if key_dtype not in ffi.KEY_DTYPES:
            raise ValueError(f"`key_dtype` must be one of {ffi.KEY_DTYPES}. Received: "
                             f"key_dtype={key_dtype!r}")
        if int(default_value_dim) < 1:
            raise ValueError("`default_value_dim` must be >= 1. Received: "
                             f"default_value_dim={default_value_dim!r}")
        self.embedding_dim = int(embedding_dim)
        self.optimizer = optimizer
        self.table_rule = TableRule(optimizer)
        self.initializer = keras.initializers.get(initializer)
        self.key_dtype = key_dtype
        self.default_value_dim = int(default_value_dim)
        self.num_shards = int(num_shards)
        self.handle = None
        self.default_values = None

    def build(self, input_shape=None):
        with jax.ensure_compile_time_eval():
            self.default_values = np.asarray(self.initializer(
                shape=(self.default_value_dim, self.embedding_dim), dtype="float32"))
        self.handle = ffi.create(self.default_values, key_dtype=self.key_dtype,
                                 num_shards=self.num_shards)
        for name, init in self.table_rule.slots:
            ffi.add_slot(self.handle, name, self.embedding_dim, init)
        self.anchor = self.add_weight(shape=(0,), initializer="zeros", name="anchor")
        self.iterations = self.add_weight(shape=(), initializer="zeros", dtype="int32",
                                          trainable=False, name="iterations")
        self.built = True

    def call(self, ids, training=None):
        ids = keras.ops.convert_to_tensor(ids, dtype=self.key_dtype)
        if not (training and self.trainable):
            return ffi.lookup(self.handle, ids, self.embedding_dim, insert=False)
        step = self.iterations.value
        rule = self.table_rule
        lookup = _training_lookup(self.handle, self.embedding_dim, rule.rule.name,
                                  rule.rule.hparam_names, tuple(n for n, _ in rule.slots))
        rows = lookup(ids, self.anchor.value, rule.hyper(step), step)
        self.iterations.assign(step + 1)
        return rows

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.embedding_dim)

    def export(self):
        """The table's admitted ids with their rows, frequencies, versions
        and slot rows (NumPy arrays)."""
        return ffi.export(self.handle, self.key_dtype, self.embedding_dim)

    def size(self):
        """The number of ids in the table."""
        return int(np.asarray(ffi.size(self.handle))[0])

    # -- saving: the TensorFlow backend's format (see `saving`) ----------------
    def save_own_variables(self, store):
        saving.save_table(self, store)

    def load_own_variables(self, store):
        saving.load_table(self, store)

    def get_config(self):
        return saving.layer_config(self, super().get_config())

    @classmethod
    def from_config(cls, config):
        return cls(**saving.layer_kwargs(config))
