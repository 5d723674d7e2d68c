"""The JAX backend's table plumbing of `keras_rec_emb.optimizers`.

The optimizers (written once, in keras_rec_emb/optimizers/) subclass their
Keras namesakes through this module's `TableOptimizer`, which also trains
the embedding tables of the model it is compiled with: its `build` finds
the layers behind the `anchor`s among its variables and attaches itself
to each (adding its slots to the table); the layer's training lookup then
applies the rows' gradient in its backward with this optimizer's rule
(`TableRule`; keras_rec_emb/backend/jax/layers.py says why there).

The step is the compiled optimizer's `iterations` (its `scale_loss` hands
it to the tables' rules): learning-rate schedules, Adam's bias correction
and the rows' versions follow it, as under TensorFlow, and a step that
`LossScaleOptimizer` skips advances none of them. Outside Keras's trainer
it is the layer's `iterations`, counting training calls. Under
`LossScaleOptimizer` the table divides its rows' gradient by the loss scale
`scale_loss` hands over (`LossScaleTables`), and skips a non-finite update.
"""

import weakref

import jax
import jax.numpy as jnp
import keras

from keras_rec_emb import _checks_core
from keras_rec_emb._update_rules import RULES
from keras_rec_emb.backend.jax import saving

# Settings the lookup's backward cannot honour: it sees one table's
# gradient, before the trainer could clip, average, accumulate or unscale it.
REFUSED = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "loss_scale_factor",
           "gradient_accumulation_steps")

# Keras's optimizers a table may take as its own (`EmbeddingVariable(
# optimizer=keras.optimizers.SGD(...))`): the rule is that of our namesake.
_KERAS_NAMESAKES = ("SGD", "Adagrad", "Adam", "Ftrl")
# Keras optimizer name -> the `_table_update` of our class of that name, for
# a table given Keras's own optimizer; filled by keras_rec_emb.optimizers
# (which imports this module) when it defines them.
NAMESAKE_UPDATES = {}
# A slot's initial value, by slot name: the optimizer attribute (else 0);
# and the slots of one float per row.
_SLOT_INIT = {"accumulator": "initial_accumulator_value", "beta1_power": "beta_1",
              "beta2_power": "beta_2"}
_WIDTH_ONE = ("beta1_power", "beta2_power", "decay_period")


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
    if not isinstance(optimizer, (TableOptimizer, *(getattr(keras.optimizers, name)
                                                    for name in _KERAS_NAMESAKES))):
        raise ValueError(
            "Under the JAX backend an embedding table is trained by keras_rec_emb.optimizers"
            ".SGD, Adagrad, Adam, Ftrl, AdamAsync, AdagradDecay or AdamW (or Keras's SGD, "
            f"Adagrad, Adam, Ftrl). Received: optimizer={optimizer!r} for {where}")
    if isinstance(optimizer, keras.optimizers.AdamW) and not isinstance(optimizer, TableOptimizer):
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
        if isinstance(optimizer, TableOptimizer):
            self._update = type(optimizer)._table_update
        else:
            self._update = next(NAMESAKE_UPDATES[name] for name in _KERAS_NAMESAKES
                                if isinstance(optimizer, getattr(keras.optimizers, name)))
        self.name, extra = self._update(optimizer, 1.0, 0)
        self.rule = RULES[self.name]
        self.slots = tuple(
            (name, float(getattr(optimizer, _SLOT_INIT[name])) if name in _SLOT_INIT else 0.0,
             1 if name in _WIDTH_ONE else None)
            for name in self.rule.slot_names(extra))

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
        self.loss_scale = None  # set by LossScaleOptimizer.scale_loss, after this
        self.optimizer_step = None  # set by TableOptimizer.scale_loss, after this
        self.own_step_rate = None if own_rate is None else own_rate.value

    def learning_rate(self, step):
        """The rate at `step`: a schedule's value there; else the optimizer's
        `learning_rate` in this step's state, which `scale_loss` (or, for a
        layer's own optimizer, `new_step`) saw, so a rate a callback assigns
        reaches the tables as it reaches the dense weights. Outside Keras's
        trainer, the variable's value when the step is traced."""
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

    def step(self, own_step):
        """The table's step in this training step: that of the optimizer
        that trains the model (its `iterations` in the step's state, which
        its `scale_loss` saw), which a step that `LossScaleOptimizer` skips
        does not advance, as under TensorFlow; outside Keras's trainer,
        `own_step` (the layer's `iterations` before the step)."""
        step = getattr(self, "optimizer_step", None)
        return own_step if step is None else step.astype(own_step.dtype)

    def hyper(self, step):
        """The rule's hyper-parameters at `step`, in the kernel's order."""
        o, f32 = self.optimizer, jnp.float32
        lr = self.learning_rate(step)
        _, extra = self._update(o, lr, step)
        decay = f32(self.weight_decay)
        if getattr(o, "scale_weight_decay_by_learning_rate", True):
            decay = lr * decay
        values = dict(extra, learning_rate=lr, decay=decay)
        return jnp.stack([jnp.asarray(v, f32) for v in self.rule.ordered(values)])

    def when_finite(self, parts, apply):
        """Runs `apply(parts)` (the step's ids, rows' gradient, ...); under
        `LossScaleOptimizer` with each gradient divided by the loss scale, and
        only when all are finite (as Keras's wrapper skips a step)."""
        scale = getattr(self, "loss_scale", None)
        if scale is None:
            apply(parts)
            return
        parts = [(p[0], p[1].astype(jnp.float32) / scale, *p[2:]) for p in parts]
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p[1])) for p in parts]))
        jax.lax.cond(finite, lambda: apply(parts), lambda: None)


class TableOptimizer:
    """Mixin placed before a Keras optimizer class (see the top): the
    anchors' slots are left out of its saved variables, and a dense step
    skips the anchors (their tables were updated in the backward)."""

    check_learning_rate = staticmethod(_checks_core.check_learning_rate)

    def build(self, variables):
        if self.built:
            return
        tables = tables_of(variables)
        if tables:
            check_supported(self, f"tables {[t.name for t in tables]}")
        super().build(variables)
        # The tables this optimizer trains (weakly: a layer may go first).
        self._kre_tables = [weakref.ref(t) for t in tables]
        for table in tables:
            table.attach_optimizer(self)

    def scale_loss(self, loss):
        # Called in the training step, before the gradient, with the step's
        # optimizer variables in scope: the tables' update (in the backward)
        # takes its learning rate and step from here (TableRule).
        rate = self.learning_rate
        if isinstance(rate, keras.Variable):
            self._kre_step_learning_rate = rate.value
        for rule in _table_rules(self):
            rule.optimizer_step = self.iterations.value
        return super().scale_loss(loss)

    # Saving: the TensorFlow backend's layout (keras_rec_emb/backend/jax/saving.py).
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        variable = super().add_variable_from_reference(reference_variable, name=name,
                                                       initializer=initializer)
        if tables_of([reference_variable]):
            saving.mark_anchor_slot(self, variable)
        return variable

    def add_scalar_slots(self, variables, name, init, per_row=False):
        """One float of state per dense variable (per row of its first axis
        with `per_row`), in a list aligned with `variables`: None for a
        table's anchor (the table holds it, a width-1 slot)."""
        return [None if tables_of([v]) else self.add_variable(
            shape=tuple(v.shape[:1]) if per_row else (),
            initializer=keras.initializers.Constant(init),
            name=f"{v.path.replace('/', '_')}_{name}") for v in variables]

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        kept = [(g, v) for g, v in zip(grads, trainable_variables) if not tables_of([v])]
        if kept:
            super()._backend_update_step(*map(list, zip(*kept)), learning_rate)

    def _kre_rows(self, gradient):
        return None  # a JAX gradient is dense

    def _kre_saved_variables(self):
        return saving.saved_variables(self)

    def save_own_variables(self, store):
        saving.save_optimizer(self, store)

    def load_own_variables(self, store):
        saving.load_optimizer(self, store)
        # A table from a file saved under TensorFlow has no step of its own
        # there (TensorFlow's follow the model optimizer's): it takes this one.
        for ref in getattr(self, "_kre_tables", ()):
            table = ref()
            if table is not None and getattr(table, "_kre_step_unsaved", False):
                table.iterations.assign(self.iterations.value)
                table._kre_step_unsaved = False  # pylint: disable=protected-access


class LossScaleTables:
    """The table part of `LossScaleOptimizer`: its `scale_loss` hands the
    step's loss scale to its tables' rules (`TableRule.when_finite`)."""

    @staticmethod
    def _check_inner(inner_optimizer):
        return isinstance(inner_optimizer, TableOptimizer)

    def build(self, var_list):
        super().build(var_list)
        self._kre_tables = [weakref.ref(t) for t in tables_of(var_list)]

    def scale_loss(self, loss):
        loss = self.inner_optimizer.scale_loss(loss)  # the step's learning rate, for the tables
        scale = self.dynamic_scale.value if self.built else self.initial_scale
        for rule in _table_rules(self):
            rule.loss_scale = scale
        return super().scale_loss(loss)


def _table_rules(optimizer):
    """The rules of the live tables `optimizer` built for (`_kre_tables`)."""
    rules = (getattr(ref(), "table_rule", None) for ref in getattr(optimizer, "_kre_tables", ()))
    return [rule for rule in rules if rule is not None]
