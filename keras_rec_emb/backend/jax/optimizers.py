"""`keras_rec_emb.optimizers` under Keras's JAX backend.

Each class subclasses its Keras namesake (dense variables follow Keras
exactly) and, through `TableOptimizer`, also trains the embedding tables of
the model it is compiled with. How the compiled optimizer reaches a table:
each JAX `EmbeddingVariable` owns a zero-size trainable variable, its
`anchor`, which is among the variables `build` receives; `build` finds the
layers behind those anchors and attaches itself to each (adding its slots
to the table). The layer's training lookup then takes this optimizer's rule
and hyper-parameters, and its backward applies the rows' gradient to the
table with them (see `keras_rec_emb.backend.jax.layers` for why the update runs
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

from keras_rec_emb._checks_core import (check_adagrad_decay, check_beta, check_hyper_arguments,
                                        check_non_negative)
from keras_rec_emb.backend.jax import register, saving

_RULES_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "optimizers", "rules.py")

_register = register(package="keras_rec_emb")

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
                                  keras.optimizers.Adam, keras.optimizers.Ftrl, AdamAsync,
                                  AdagradDecay)):
        raise ValueError(
            "Under the JAX backend an embedding table is trained by keras_rec_emb.optimizers"
            ".SGD, Adagrad, Adam, Ftrl, AdamAsync, AdagradDecay or AdamW (or Keras's SGD, "
            f"Adagrad, Adam, Ftrl). Received: optimizer={optimizer!r} for {where}")
    if isinstance(optimizer, keras.optimizers.AdamW) and not isinstance(optimizer, AdamW):
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
        # A constant rate as the config gives it: the last resort of
        # `learning_rate` (see there).
        self.constant_learning_rate = None if self.schedule else float(lr)
        self.weight_decay = float(config.get("weight_decay") or 0.0)
        o = optimizer
        if isinstance(o, AdamAsync):
            self.name = "adam_async"
            self.slots = (("momentum", 0.0, None), ("velocity", 0.0, None),
                          ("beta1_power", float(o.beta_1), 1), ("beta2_power", float(o.beta_2), 1))
        elif isinstance(o, AdagradDecay):
            self.name = "adagrad_decay"
            self.slots = (("accumulator", o.initial_accumulator_value, None),
                          ("decay_period", 0.0, 1))
        elif isinstance(o, keras.optimizers.SGD):
            if o.momentum:
                self.name, self.slots = "momentum", (("momentum", 0.0, None),)
            else:
                self.name, self.slots = "sgd", ()
        elif isinstance(o, keras.optimizers.Adagrad):
            self.name = "adagrad"
            self.slots = (("accumulator", float(o.initial_accumulator_value), None),)
        elif isinstance(o, keras.optimizers.Adam):
            self.name = "adam"
            self.slots = (("momentum", 0.0, None), ("velocity", 0.0, None))
            if o.amsgrad:
                self.slots += (("velocity_hat", 0.0, None),)
        else:
            self.name = "ftrl_group" if getattr(o, "table_rule", "keras") == "deeprec" else "ftrl"
            self.slots = (("accumulator", float(o.initial_accumulator_value), None),
                          ("linear", 0.0, None))
        self.rule = rules()[self.name]

    def slot_names(self):
        return tuple(name for name, _, _ in self.slots)

    def new_step(self, own_rate=None):
        """Called (while tracing) by a table's first training lookup of a
        step: the optimizer forgets the learning rate of an earlier step.
        `own_rate`: the rate variable of the layer's own optimizer, in the
        layer's state, read here (in the forward pass, where the step's
        state is in scope; the backward runs outside it)."""
        if isinstance(self.optimizer, TableOptimizer):
            self.optimizer._kre_step_learning_rate = None  # pylint: disable=protected-access
        self.own_step_rate = None if own_rate is None else own_rate.value

    def learning_rate(self, step):
        """The rate at `step`: a schedule's value there; else the value of
        the optimizer's `learning_rate` variable in this training step,
        which its `scale_loss` saw (Keras's JAX trainer calls it after the
        forward pass, before the gradient, with the optimizer's variables
        of the step in scope, as `apply` has them for the dense weights:
        a rate assigned between steps or epochs, by a callback such as
        `ReduceLROnPlateau` or `LearningRateScheduler`, reaches the tables
        as it reaches the dense weights). A layer's own optimizer: its
        variable's value in the step's state, which `new_step` saw. Outside
        Keras's trainer, the variable's value when the step is traced."""
        if self.schedule is not None:
            return jnp.asarray(self.schedule(step), jnp.float32)
        rate = getattr(self.optimizer, "_kre_step_learning_rate", None)
        if rate is None:
            rate = getattr(self, "own_step_rate", None)
        if rate is None:
            rate = self.optimizer.learning_rate
            if isinstance(rate, keras.Variable):
                rate = rate.value
            elif callable(rate):
                rate = rate()
        if rate is None:
            rate = self.constant_learning_rate
        return jnp.asarray(rate, jnp.float32)

    def hyper(self, step):
        """The rule's hyper-parameters at `step`, in the kernel's order."""
        o, f32 = self.optimizer, jnp.float32
        lr = self.learning_rate(step)
        if self.name == "adam_async":
            extra = {"beta_1": o.beta_1, "beta_2": o.beta_2, "epsilon": o.epsilon,
                     "use_nesterov": float(o.use_nesterov),
                     "apply_sparse_rmsprop": float(o.apply_sparse_rmsprop)}
        elif self.name == "adagrad_decay":
            extra = {"epsilon": o.epsilon, "decay_rate": o.accumulator_decay_rate,
                     "baseline": o.initial_accumulator_value,
                     "period": ((step + 1) // o.accumulator_decay_step).astype(f32)}
        elif self.name == "momentum":
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
        decay = f32(self.weight_decay)
        if getattr(o, "scale_weight_decay_by_learning_rate", True):
            decay = lr * decay
        values = dict(extra, learning_rate=lr, decay=decay)
        return jnp.stack([jnp.asarray(v, f32) for v in self.rule.ordered(values)])


class TableOptimizer:
    """Mixin placed before a Keras optimizer class: `build` attaches the
    optimizer to the tables whose anchors it builds for (see the top).
    Its hyper-parameters are checked as the TensorFlow backend's are (Keras
    itself accepts e.g. a learning rate of -1)."""

    def __init__(self, *args, **kwargs):
        check_hyper_arguments(super().__init__, args, kwargs)
        super().__init__(*args, **kwargs)

    def build(self, variables):
        if self.built:
            return
        tables = tables_of(variables)
        if tables:
            check_supported(self, f"tables {[t.name for t in tables]}")
        super().build(variables)
        for table in tables:
            table.attach_optimizer(self)

    def scale_loss(self, loss):
        # Keras's JAX trainer calls this inside the training step, after the
        # forward pass and before the gradient, with this step's optimizer
        # variables in scope: the tables' update (in the backward) takes the
        # learning rate from here (TableRule.learning_rate).
        rate = self.learning_rate
        if isinstance(rate, keras.Variable):
            self._kre_step_learning_rate = rate.value
        return super().scale_loss(loss)

    # Saving: the TensorFlow backend's layout (keras_rec_emb/backend/jax/saving.py).
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


# -- DeepRec's optimizers: Keras has no namesake, their dense rule is here ----

class _ScalarSlots:
    """Per-variable state for DeepRec's optimizers: Keras variables for the
    dense weights; for a table's anchor, a placeholder (the state is a
    width-1 slot in the table, as under TensorFlow)."""

    def _index(self, variable):
        return self._kre_index[id(variable)]

    def _per_variable(self, var_list, name, init, shape_of):
        out = []
        for variable in var_list:
            if tables_of([variable]):
                out.append(None)  # in the table
                continue
            out.append(self.add_variable(
                shape=shape_of(variable), initializer=keras.initializers.Constant(init),
                name=f"{variable.path.replace('/', '_')}_{name}"))
        return out

    def _reference_slots(self, var_list, name, initializer="zeros"):
        out = []
        for variable in var_list:
            slot = self.add_variable_from_reference(variable, name, initializer=initializer)
            out.append(slot)
        return out


@_register
class AdamAsync(TableOptimizer, _ScalarSlots, keras.optimizers.Optimizer):
    # Built with +: assigned, as an expression is not a docstring.
    __doc__ = """DeepRec's AdamAsync under the JAX backend: Adam with per-variable
    (per-row for tables) bias-correction powers, `beta1_power` and
    `beta2_power`, starting at `beta_1` and `beta_2` and multiplied by them
    at each update of the variable (the TensorFlow backend's class, same
    rule; a JAX gradient is dense, so a dense variable always takes the
    dense formula). With `apply_sparse_rmsprop=True` tables take RMSProp.

    Args:
        learning_rate: float >= 0 or a schedule. Defaults to `0.001`.
        beta_1: float in [0, 1). Defaults to `0.9`.
        beta_2: float in [0, 1). Defaults to `0.999`.
        epsilon: float >= 0. Defaults to `1e-8`.
        use_nesterov: bool. Defaults to `False`.
        apply_sparse_rmsprop: bool, RMSProp for tables. Defaults to `False`.
        **kwargs: the arguments of `keras.optimizers.Optimizer`.
    """ + _EXAMPLE.format(name="AdamAsync", args="0.01")

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-8,
                 use_nesterov=False, apply_sparse_rmsprop=False, name="adam_async", **kwargs):
        check_beta("beta_1", beta_1)
        check_beta("beta_2", beta_2)
        check_non_negative("epsilon", epsilon)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.use_nesterov = bool(use_nesterov)
        self.apply_sparse_rmsprop = bool(apply_sparse_rmsprop)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._kre_index = {id(v): i for i, v in enumerate(var_list)}
        self._momentums = self._reference_slots(var_list, "momentum")
        self._velocities = self._reference_slots(var_list, "velocity")
        self._beta1_powers = self._per_variable(var_list, "beta1_power", self.beta_1,
                                                lambda v: ())
        self._beta2_powers = self._per_variable(var_list, "beta2_power", self.beta_2,
                                                lambda v: ())

    def update_step(self, gradient, variable, learning_rate):
        ops = keras.ops
        i = self._index(variable)
        m, v = self._momentums[i], self._velocities[i]
        b1p, b2p = self._beta1_powers[i], self._beta2_powers[i]
        if b1p is None:
            return  # a table's anchor: the table was updated in the lookup's backward
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        b1, b2 = self.beta_1, self.beta_2
        alpha = lr * ops.sqrt(1 - b2p) / (1 - b1p)
        self.assign(m, m * b1 + g * (1 - b1))
        self.assign(v, v * b2 + g * g * (1 - b2))
        step = g * (1 - b1) + b1 * m if self.use_nesterov else m
        self.assign_sub(variable, step * alpha / (ops.sqrt(v) + self.epsilon))
        self.assign(b1p, b1p * b1)
        self.assign(b2p, b2p * b2)

    def get_config(self):
        config = super().get_config()
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                       "use_nesterov": self.use_nesterov,
                       "apply_sparse_rmsprop": self.apply_sparse_rmsprop})
        return config


@_register
class AdagradDecay(TableOptimizer, _ScalarSlots, keras.optimizers.Optimizer):
    # Built with +: assigned, as an expression is not a docstring.
    __doc__ = """DeepRec's AdagradDecay under the JAX backend: Adagrad whose
    accumulator decays (`max(acc * rate, initial_accumulator_value)`) at most
    once per update of a row (of a dense variable's first axis), when the
    period `(iterations + 1) // accumulator_decay_step` passes the row's
    `decay_period` (the TensorFlow backend's class, same rule).

    Args:
        learning_rate: float >= 0 or a schedule. Defaults to `0.001`.
        initial_accumulator_value: float > 0, start and floor of the
            accumulators. Defaults to `0.1`.
        accumulator_decay_step: int > 0, the period in steps. Defaults to
            `100000`.
        accumulator_decay_rate: float in (0, 1]. Defaults to `0.9`.
        epsilon: float >= 0. Defaults to `1e-7`.
        **kwargs: the arguments of `keras.optimizers.Optimizer`.
    """ + _EXAMPLE.format(name="AdagradDecay", args="0.1, accumulator_decay_step=1000")

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1,
                 accumulator_decay_step=100000, accumulator_decay_rate=0.9, epsilon=1e-7,
                 name="adagrad_decay", **kwargs):
        v, s, r = check_adagrad_decay(initial_accumulator_value, accumulator_decay_step,
                                      accumulator_decay_rate)
        check_non_negative("epsilon", epsilon)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.initial_accumulator_value = v
        self.accumulator_decay_step = s
        self.accumulator_decay_rate = r
        self.epsilon = epsilon

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._kre_index = {id(v): i for i, v in enumerate(var_list)}
        self._accumulators = self._reference_slots(
            var_list, "accumulator",
            keras.initializers.Constant(self.initial_accumulator_value))
        self._decay_periods = self._per_variable(var_list, "decay_period", 0.0,
                                                 lambda v: tuple(v.shape[:1]))

    def update_step(self, gradient, variable, learning_rate):
        ops = keras.ops
        i = self._index(variable)
        acc, last = self._accumulators[i], self._decay_periods[i]
        if last is None:
            return  # a table's anchor: the table was updated in the lookup's backward
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        period = ops.cast((self.iterations + 1) // self.accumulator_decay_step, "float32")
        acc_value, last_value = acc.value, last.value
        need = period > last_value
        need_rows = ops.reshape(need, tuple(need.shape) + (1,) * (acc_value.ndim - need.ndim))
        decayed = ops.where(need_rows, ops.maximum(acc_value * self.accumulator_decay_rate,
                                                   self.initial_accumulator_value), acc_value)
        acc_value = decayed + g * g
        self.assign(acc, acc_value)
        self.assign(last, last_value + ops.cast(need, last_value.dtype))
        self.assign_sub(variable, lr * g / ops.sqrt(acc_value + self.epsilon))

    def get_config(self):
        config = super().get_config()
        config.update({"initial_accumulator_value": self.initial_accumulator_value,
                       "accumulator_decay_step": self.accumulator_decay_step,
                       "accumulator_decay_rate": self.accumulator_decay_rate,
                       "epsilon": self.epsilon})
        return config


@_register
class AdamW(TableOptimizer, keras.optimizers.AdamW):
    # Built with +: assigned, as an expression is not a docstring.
    __doc__ = """`keras.optimizers.AdamW` that also updates embedding tables (JAX
    backend): a table takes Adam's rule with the decoupled decay of the rows
    it updates.

    Args:
        weight_decay: float >= 0. Defaults to `0.004`, as
            `keras.optimizers.AdamW`. It comes first (before `learning_rate`,
            unlike Keras): `AdamW(0.01, 0.02)` is `weight_decay=0.01,
            learning_rate=0.02`.
        learning_rate: float >= 0 or a schedule. Defaults to `0.001`.
        scale_weight_decay_by_learning_rate: `True` only under JAX so far
            (Keras's `learning_rate * weight_decay * var`).
        **kwargs: the other arguments of `keras.optimizers.AdamW`.
    """ + _EXAMPLE.format(name="AdamW", args="0.01, 0.01")

    def __init__(self, weight_decay=0.004, learning_rate=0.001,
                 scale_weight_decay_by_learning_rate=True, **kwargs):
        check_non_negative("weight_decay", weight_decay)
        if scale_weight_decay_by_learning_rate is not True:
            raise ValueError(
                "Under the JAX backend AdamW supports scale_weight_decay_by_learning_rate="
                "True only (so far); False is TensorFlow-only for now. Received: "
                f"scale_weight_decay_by_learning_rate={scale_weight_decay_by_learning_rate!r}")
        kwargs.setdefault("name", "adamw")
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, **kwargs)
        self.scale_weight_decay_by_learning_rate = True

    def get_config(self):
        config = super().get_config()
        config["scale_weight_decay_by_learning_rate"] = True
        return config
