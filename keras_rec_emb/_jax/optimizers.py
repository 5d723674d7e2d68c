"""`keras_rec_emb.optimizers` under Keras's JAX backend.

Each class subclasses its Keras namesake (dense variables follow Keras
exactly) and, through `TableOptimizer`, also trains the embedding tables of
the model it is compiled with. How the compiled optimizer reaches a table:
each JAX `EmbeddingVariable` owns a zero-size trainable variable, its
`anchor`, which is among the variables `build` receives; `build` finds the
layers behind those anchors and attaches itself to each (adding its slots
to the table). The layer's training lookup then takes this optimizer's rule
and hyper-parameters, and its backward applies the rows' gradient to the
table with them (see `keras_rec_emb._jax.layers` for why the update runs
there and not in `apply`).

The step is the layer's `iterations` (a non-trainable variable counting
training calls, in the model's state under `jit`), which equals the
optimizer's `iterations` when the layer is called once per training step:
learning-rate schedules and Adam's bias correction follow it, as they
follow the optimizer's step under TensorFlow.
"""

import functools
import importlib.util
import os
import weakref

import jax.numpy as jnp
import keras

from keras_rec_emb._jax import saving

_RULES_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "optimizers", "rules.py")

_register = keras.saving.register_keras_serializable(package="keras_rec_emb")

# Settings the lookup's backward cannot honour: it sees one table's
# gradient, before the trainer could clip, average, accumulate or unscale it.
REFUSED = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "loss_scale_factor",
           "gradient_accumulation_steps")


@functools.cache
def rules():
    """keras_rec_emb/optimizers/rules.py's RULES, loaded from its file: the
    module is plain Python, but importing it through its package would
    import the TensorFlow optimizers."""
    spec = importlib.util.spec_from_file_location("keras_rec_emb_jax_rules", _RULES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RULES


# id(anchor variable) -> (weakref to the anchor, weakref to its layer).
_ANCHORS = {}


def register_anchor(anchor, layer):
    """Declares `anchor` the variable through which optimizers find `layer`."""
    key = id(anchor)
    _ANCHORS[key] = (weakref.ref(anchor, lambda _: _ANCHORS.pop(key, None)),
                     weakref.ref(layer))


def tables_of(variables):
    """The JAX EmbeddingVariable layers whose anchors are among `variables`."""
    found = []
    for variable in variables:
        entry = _ANCHORS.get(id(variable))
        if entry is not None and entry[0]() is variable and entry[1]() is not None:
            found.append(entry[1]())
    return found


def check_supported(optimizer, where):
    """Refuses an optimizer whose settings the table update cannot honour,
    or that has no table rule; `where` says which tables."""
    if not isinstance(optimizer, (keras.optimizers.SGD, keras.optimizers.Adagrad,
                                  keras.optimizers.Adam, keras.optimizers.Ftrl)):
        raise ValueError(
            "Under the JAX backend an embedding table is trained by keras_rec_emb.optimizers"
            ".SGD, Adagrad, Adam or Ftrl (or their Keras namesakes) so far. "
            f"Received: optimizer={optimizer!r} for {where}")
    if isinstance(optimizer, keras.optimizers.AdamW) and not isinstance(optimizer, Adam):
        raise ValueError(
            "Under the JAX backend keras.optimizers.AdamW has no table rule so far. "
            f"Received: optimizer={optimizer!r} for {where}")
    config = optimizer.get_config()
    for name in REFUSED:
        if config.get(name) not in (None, False):
            raise ValueError(
                f"Under the JAX backend an embedding table is updated in the backward pass "
                f"of its lookup, which does not support `{name}`. Received: {name}="
                f"{config[name]!r} for {where}")


class TableRule:
    """The fused sparse rule of `optimizer` for one table: its slots and,
    per step, its hyper-parameters (as keras_rec_emb/optimizers'
    `_table_update` gives them under TensorFlow)."""

    def __init__(self, optimizer, where="this table"):
        check_supported(optimizer, where)
        self.optimizer = optimizer
        config = optimizer.get_config()
        lr = config["learning_rate"]
        self.schedule = (keras.optimizers.schedules.deserialize(lr) if isinstance(lr, dict)
                         else None)
        # A constant rate as it is when the table's rule is made (the
        # optimizer's own variables are not in the traced step's state, and
        # Keras's JAX trainer empties them while it trains).
        self.constant_learning_rate = None if self.schedule else float(lr)
        self.weight_decay = float(config.get("weight_decay") or 0.0)
        o = optimizer
        if isinstance(o, keras.optimizers.SGD):
            if o.momentum:
                self.name, self.slots = "momentum", (("momentum", 0.0),)
            else:
                self.name, self.slots = "sgd", ()
        elif isinstance(o, keras.optimizers.Adagrad):
            self.name = "adagrad"
            self.slots = (("accumulator", float(o.initial_accumulator_value)),)
        elif isinstance(o, keras.optimizers.Adam):
            self.name = "adam"
            self.slots = (("momentum", 0.0), ("velocity", 0.0))
            if o.amsgrad:
                self.slots += (("velocity_hat", 0.0),)
        else:
            self.name = "ftrl_group" if getattr(o, "table_rule", "keras") == "deeprec" else "ftrl"
            self.slots = (("accumulator", float(o.initial_accumulator_value)),
                          ("linear", 0.0))
        self.rule = rules()[self.name]

    def slot_names(self):
        return tuple(name for name, _ in self.slots)

    def learning_rate(self, step):
        if self.schedule is not None:
            return jnp.asarray(self.schedule(step), jnp.float32)
        return jnp.float32(self.constant_learning_rate)

    def hyper(self, step):
        """The rule's hyper-parameters at `step`, in the kernel's order."""
        o, f32 = self.optimizer, jnp.float32
        lr = self.learning_rate(step)
        if self.name == "momentum":
            extra = {"momentum": o.momentum, "nesterov": float(o.nesterov)}
        elif self.name == "adagrad":
            extra = {"epsilon": o.epsilon}
        elif self.name == "adam":
            t = (step + 1).astype(f32)
            b1, b2 = f32(o.beta_1), f32(o.beta_2)
            alpha = lr * jnp.sqrt(1 - jnp.power(b2, t)) / (1 - jnp.power(b1, t))
            extra = {"alpha": alpha, "beta_1": o.beta_1, "beta_2": o.beta_2,
                     "epsilon": o.epsilon, "amsgrad": float(o.amsgrad)}
        elif self.name in ("ftrl", "ftrl_group"):
            extra = {"learning_rate_power": o.learning_rate_power,
                     "l1": o.l1_regularization_strength,
                     "l2_plus_beta": o.l2_regularization_strength + o.beta / (2.0 * lr),
                     "l2_shrinkage": o.l2_shrinkage_regularization_strength}
        else:
            extra = {}
        values = dict(extra, learning_rate=lr, decay=lr * f32(self.weight_decay))
        return jnp.stack([jnp.asarray(v, f32) for v in self.rule.ordered(values)])


class TableOptimizer:
    """Mixin placed before a Keras optimizer class: `build` attaches the
    optimizer to the tables whose anchors it builds for (see the top)."""

    def build(self, variables):
        if self.built:
            return
        tables = tables_of(variables)
        if tables:
            check_supported(self, f"tables {[t.name for t in tables]}")
        super().build(variables)
        for table in tables:
            table.attach_optimizer(self)

    # Saving: the TensorFlow backend's layout (keras_rec_emb/_jax/saving.py).
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        variable = super().add_variable_from_reference(reference_variable, name=name,
                                                       initializer=initializer)
        if tables_of([reference_variable]):
            saving.mark_anchor_slot(self, variable)
        return variable

    def save_own_variables(self, store):
        saving.save_optimizer(self, store)

    def load_own_variables(self, store):
        saving.load_optimizer(self, store)


_EXAMPLE = """
    Example:

    >>> ids = keras.Input(shape=(2,), dtype="int32")
    >>> x = keras_rec_emb.layers.EmbeddingVariable(4)(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(x)))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.{name}({args}),
    ...               loss="mse")
    >>> history = model.fit(np.array([[1, 10**6], [7, 1]]), np.ones((2, 1)),
    ...                     verbose=0)
"""


def _doc(name, rule, args):
    return (
        f"`keras.optimizers.{name}` that also updates embedding tables (JAX backend).\n\n"
        f"    Dense variables follow Keras's {name} exactly. A table's rows are\n"
        f"    updated in the backward pass of its lookup, equal keys summed: {rule}\n"
        "    Slots live inside the table and are saved with it. `clipnorm`,\n"
        "    `clipvalue`, `global_clipnorm`, `use_ema`, `loss_scale_factor` and\n"
        "    `gradient_accumulation_steps` are refused when it trains a table.\n\n"
        f"    Its arguments are those of `keras.optimizers.{name}`.\n"
        + _EXAMPLE.format(name=name, args=args))


@_register
class SGD(TableOptimizer, keras.optimizers.SGD):
    __doc__ = _doc("SGD", "`row -= lr * g`\n    (or the momentum / Nesterov update "
                   "with a per-row `momentum` slot).", "0.1")


@_register
class Adagrad(TableOptimizer, keras.optimizers.Adagrad):
    __doc__ = _doc("Adagrad", "`accumulator += g**2;\n    row -= lr * g / sqrt(accumulator + "
                   "epsilon)`.", "0.1")


@_register
class Adam(TableOptimizer, keras.optimizers.Adam):
    __doc__ = _doc("Adam", "Keras's Adam formula\n    with the bias correction of the step, on "
                   "per-row `momentum` and `velocity`\n    (and `velocity_hat` with `amsgrad`) "
                   "slots.", "0.01")


_FTRL_TABLE_RULES = ("keras", "deeprec")


@_register
class Ftrl(TableOptimizer, keras.optimizers.Ftrl):
    __doc__ = _doc("Ftrl", "Keras's element-wise\n    FTRL-proximal formula "
                   "(`table_rule=\"keras\"`) or DeepRec's group rule\n    "
                   "(`table_rule=\"deeprec\"`), on per-row `accumulator` and `linear` "
                   "slots.\n\n    Args:\n        table_rule: `\"keras\"` or `\"deeprec\"`, the "
                   "rule for embedding\n            tables. Defaults to `\"keras\"`.\n"
                   "        **kwargs: the arguments of `keras.optimizers.Ftrl`.",
                   "0.1")

    def __init__(self, *args, table_rule="keras", **kwargs):
        if table_rule not in _FTRL_TABLE_RULES:
            raise ValueError(f"`table_rule` must be one of {_FTRL_TABLE_RULES}. Received: "
                             f"table_rule={table_rule!r}")
        super().__init__(*args, **kwargs)
        self.table_rule = table_rule

    def get_config(self):
        config = super().get_config()
        config["table_rule"] = self.table_rule
        return config
