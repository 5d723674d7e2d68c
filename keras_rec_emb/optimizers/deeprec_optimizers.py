"""DeepRec's optimizers for large sparse models: AdamAsync, AdagradDecay, AdamW.

Each updates dense variables, `keras.layers.Embedding` (sparse
`tf.IndexedSlices` gradients under TensorFlow, duplicate indices summed
first) and embedding tables (one fused kernel per table and step). The dense
math is written once in `keras.ops` on the rows a gradient touches (the whole
variable for a dense gradient); `TableOptimizer` of the running backend
supplies those rows (`_kre_rows`, `_kre_gather`, `_kre_at_rows`).
"""

import keras
import numpy as np

from keras_rec_emb import _keras_fixes
from keras_rec_emb._checks_core import (check_adagrad_decay, check_beta, check_bool,
                                        check_non_negative)
from keras_rec_emb.optimizers.keras_optimizers import Adam, TableOptimizer, example

ops = keras.ops
_register = keras.saving.register_keras_serializable(package="keras_rec_emb")
_LearningRate = float | keras.optimizers.schedules.LearningRateSchedule

_BASE_ARGS = """
        **kwargs: the arguments of every Keras optimizer (`name`,
            `weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `loss_scale_factor`, ...; `use_ema` and
            `gradient_accumulation_steps` are refused when the model has
            embedding tables; under JAX `clipnorm`, `clipvalue`,
            `global_clipnorm` and `loss_scale_factor` are refused too, the
            table being updated in its lookup's backward)."""


@_register
class AdamAsync(TableOptimizer, keras.optimizers.Optimizer):
    __doc__ = """Adam with per-variable (per-row for tables) bias-correction powers.

    DeepRec's AdamAsync: instead of deriving the bias correction from a
    global step, each variable keeps `beta1_power` and `beta2_power` slots
    (for an embedding table, one pair per row, so a row's correction follows
    its own number of updates), updated together with the variable:

        alpha = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g**2
        var -= alpha * m / (sqrt(v) + epsilon)       # or, with use_nesterov,
        var -= alpha * ((1 - beta_1) * g + beta_1 * m) / (sqrt(v) + epsilon)
        beta1_power *= beta_1; beta2_power *= beta_2

    Powers start at `beta_1` and `beta_2`. Sparse updates (tables, and
    `tf.IndexedSlices` gradients of dense variables) touch only the rows in
    the batch; a dense variable's powers advance once per step. With
    `apply_sparse_rmsprop=True`, sparse updates use RMSProp instead (no bias
    correction, powers unchanged):

        v = beta_2 * v + (1 - beta_2) * g**2
        m = beta_1 * m + lr * g / sqrt(v + epsilon)
        var -= m

    Args:
        learning_rate: float >= 0, a schedule, or a callable. Defaults to
            `0.001`.
        beta_1: float in [0, 1). Defaults to `0.9`.
        beta_2: float in [0, 1). Defaults to `0.999`.
        epsilon: float >= 0. Defaults to `1e-8`.
        use_nesterov: bool. Defaults to `False`.
        apply_sparse_rmsprop: bool. RMSProp for sparse updates. Defaults to
            `False`.""" + _BASE_ARGS + example("AdamAsync(0.01)")

    def __init__(self, learning_rate: _LearningRate = 0.001, beta_1: float = 0.9,
                 beta_2: float = 0.999, epsilon: float = 1e-8, use_nesterov: bool = False,
                 apply_sparse_rmsprop: bool = False, name: str = "adam_async", **kwargs):
        self.check_learning_rate(learning_rate)
        check_beta("beta_1", beta_1)
        check_beta("beta_2", beta_2)
        check_non_negative("epsilon", epsilon)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.use_nesterov = bool(use_nesterov)
        self.apply_sparse_rmsprop = bool(apply_sparse_rmsprop)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self.add_optimizer_variables(
            var_list, ["momentum", "velocity"])
        self._beta1_powers = self.add_scalar_slots(var_list, "beta1_power", self.beta_1)
        self._beta2_powers = self.add_scalar_slots(var_list, "beta2_power", self.beta_2)

    def _table_update(self, learning_rate, step):
        return "adam_async", {"beta_1": self.beta_1, "beta_2": self.beta_2,
                              "epsilon": self.epsilon,
                              "use_nesterov": float(self.use_nesterov),
                              "apply_sparse_rmsprop": float(self.apply_sparse_rmsprop)}

    def update_step(self, gradient, variable, learning_rate):
        index = _keras_fixes.variable_index(self, variable)  # as Keras's own update_steps
        b1p, b2p = self._beta1_powers[index], self._beta2_powers[index]
        lr = ops.cast(learning_rate, variable.dtype)
        b1, b2, eps = self.beta_1, self.beta_2, self.epsilon

        def rows(g, m, v, sparse):
            if sparse and self.apply_sparse_rmsprop:
                v = v * b2 + g * g * (1 - b2)
                m = m * b1 + lr * g / ops.sqrt(v + eps)
                return m, m, v
            alpha = lr * ops.sqrt(1 - b2p) / (1 - b1p)
            m = m * b1 + g * (1 - b1)
            v = v * b2 + g * g * (1 - b2)
            step = g * (1 - b1) + b1 * m if self.use_nesterov else m
            return step * alpha / (ops.sqrt(v) + eps), m, v

        sparse = _update_rows(self, gradient, variable,
                              [self._momentums[index], self._velocities[index]], rows)
        if not (sparse and self.apply_sparse_rmsprop):
            self.assign(b1p, b1p * b1)
            self.assign(b2p, b2p * b2)

    def load_own_variables(self, store):
        # keras_rec_emb 0.2.0's JAX AdamAsync saved every momentum, then every
        # velocity; TensorFlow's (and now both) interleave them per variable.
        # Told apart by shape: where they agree, the two layouts are the same.
        variables = self._kre_saved_variables()
        if len(store.keys()) == len(variables):
            saved = [np.asarray(store[str(i)]) for i in range(len(variables))]
            if any(a.shape != tuple(v.shape) for a, v in zip(saved, variables)):
                at = {id(v): k for k, v in enumerate(variables)}
                pairs = [(m, v) for m, v in zip(self._momentums, self._velocities)
                         if id(m) in at]
                first = [at[id(m)] for m, _ in pairs] + [at[id(v)] for _, v in pairs]
                old = sorted(first)
                order = list(range(len(variables)))
                for slot, k in zip(first, old):
                    order[slot] = k
                if all(saved[order[k]].shape == tuple(v.shape) for k, v in enumerate(variables)):
                    store = {str(k): saved[order[k]] for k in range(len(variables))}
        super().load_own_variables(store)

    def get_config(self):
        config = super().get_config()
        config.update({
            "beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
            "use_nesterov": self.use_nesterov,
            "apply_sparse_rmsprop": self.apply_sparse_rmsprop,
        })
        return config


@_register
class AdagradDecay(TableOptimizer, keras.optimizers.Optimizer):
    __doc__ = """Adagrad whose accumulator decays once per period of the global step.

    DeepRec's AdagradDecay, for models trained on an unbounded stream: the
    accumulator of plain Adagrad grows without bound and stops learning.
    DeepRec's rule exactly (its kernels receive `global_step + 1`; here the
    global step is the optimizer's `iterations`): each row (a dense
    variable as a whole for a dense gradient; each row of a sparse gradient,
    `keras.layers.Embedding` included; each row of an embedding table)
    keeps a decay count `decay_period` (DeepRec's `accumulator_decay_power`),
    and when updated:

        period = (iterations + 1) // accumulator_decay_step
        if period > decay_period:          # at most one decay per update
            acc = max(acc * rate, initial_accumulator_value)
            decay_period += 1
        acc += g**2
        var -= lr * g / sqrt(acc + epsilon)

    `epsilon=0` gives DeepRec's numbers bit for bit. See docs/semantics.md,
    'Optimizers and mixed precision'.

    Args:
        learning_rate: float >= 0, a schedule, or a callable. Defaults to
            `0.001`.
        initial_accumulator_value: float > 0. Starting value and floor of the
            accumulators. Defaults to `0.1`.
        accumulator_decay_step: int > 0. Period length in steps. Defaults to
            `100000`.
        accumulator_decay_rate: float in (0, 1]. Defaults to `0.9`.
        epsilon: float >= 0. Defaults to `1e-7`.""" + _BASE_ARGS + example(
        "AdagradDecay(0.1, accumulator_decay_step=1000, accumulator_decay_rate=0.5)")

    def __init__(self, learning_rate: _LearningRate = 0.001,
                 initial_accumulator_value: float = 0.1, accumulator_decay_step: int = 100000,
                 accumulator_decay_rate: float = 0.9, epsilon: float = 1e-7,
                 name: str = "adagrad_decay", **kwargs):
        self.check_learning_rate(learning_rate)
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
        self._accumulators = self.add_optimizer_variables(
            var_list, "accumulator",
            initializer=keras.initializers.Constant(self.initial_accumulator_value))
        # One decay count per row (DeepRec's accumulator_decay_power): a
        # table's width-1 slot, a [rows] variable for a dense variable.
        self._decay_periods = self.add_scalar_slots(var_list, "decay_period", 0.0,
                                                    per_row=True)

    def load_own_variables(self, store):
        # keras_rec_emb 0.1.0 saved a dense variable's decay_period as one scalar (the
        # last period it was decayed for): it fills every row.
        variables = self._kre_saved_variables()
        if len(store.keys()) == len(variables):
            periods = {id(p) for p in self._decay_periods if not _is_placeholder(p)}
            values = {}
            for i, variable in enumerate(variables):
                value = np.asarray(store[str(i)])
                if id(variable) in periods and value.shape != tuple(variable.shape):
                    if value.size != 1:
                        raise ValueError(
                            f"Cannot restore `decay_period` of shape {value.shape} into "
                            f"shape {tuple(variable.shape)}")
                    value = np.full(variable.shape, value.reshape(()), np.float32)
                values[str(i)] = value
            store = values
        super().load_own_variables(store)

    def _period(self, step):
        # DeepRec feeds its kernels global_step + 1.
        return ops.cast((step + 1) // self.accumulator_decay_step, "float32")

    def _table_update(self, learning_rate, step):
        return "adagrad_decay", {"epsilon": self.epsilon,
                                 "decay_rate": self.accumulator_decay_rate,
                                 "baseline": self.initial_accumulator_value,
                                 "period": self._period(step)}

    def update_step(self, gradient, variable, learning_rate):
        index = _keras_fixes.variable_index(self, variable)  # as Keras's own update_steps
        lr = ops.cast(learning_rate, variable.dtype)
        period = self._period(self.iterations)
        rate, floor = self.accumulator_decay_rate, self.initial_accumulator_value

        def rows(g, acc, last, sparse):
            # At most one decay per update of a row (DeepRec).
            need = period > last
            need_rows = ops.reshape(need, tuple(ops.shape(need))
                                    + (1,) * (len(ops.shape(acc)) - len(ops.shape(need))))
            acc = ops.where(need_rows, ops.maximum(acc * rate, floor), acc) + g * g
            return lr * g / ops.sqrt(acc + self.epsilon), acc, last + ops.cast(need, last.dtype)

        _update_rows(self, gradient, variable,
                     [self._accumulators[index], self._decay_periods[index]], rows)

    def get_config(self):
        config = super().get_config()
        config.update({
            "initial_accumulator_value": self.initial_accumulator_value,
            "accumulator_decay_step": self.accumulator_decay_step,
            "accumulator_decay_rate": self.accumulator_decay_rate,
            "epsilon": self.epsilon,
        })
        return config


@_register
class AdamW(TableOptimizer, keras.optimizers.AdamW):
    __doc__ = """Adam with decoupled weight decay (Loshchilov & Hutter), sparse-aware.

    `var -= learning_rate * weight_decay * var` (Keras's convention), or with
    `scale_weight_decay_by_learning_rate=False` DeepRec's `var -= weight_decay
    * var`; then Keras's Adam update (the same as DeepRec's Adam). Sparse
    gradients decay only the rows they update. See docs/semantics.md,
    'Optimizers and mixed precision'.

    Args:
        weight_decay: float >= 0. Defaults to `0.004`, as
            `keras.optimizers.AdamW`. It comes first (before `learning_rate`,
            unlike Keras): `AdamW(0.01, 0.02)` is `weight_decay=0.01,
            learning_rate=0.02`.
        learning_rate: float >= 0, a schedule, or a callable. Defaults to
            `0.001`.
        beta_1: float. Defaults to `0.9`.
        beta_2: float. Defaults to `0.999`.
        epsilon: float. Defaults to `1e-8`.
        amsgrad: bool. Defaults to `False`.
        scale_weight_decay_by_learning_rate: bool. `True` (Keras):
            the decay is `learning_rate * weight_decay * var`; `False`
            (DeepRec, TF contrib): `weight_decay * var`. Defaults to `True`.
        **kwargs: other `keras.optimizers.AdamW` arguments.""" + example("AdamW(0.01, 0.01)")

    def __init__(self, weight_decay: float = 0.004, learning_rate: _LearningRate = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-8,
                 amsgrad: bool = False, scale_weight_decay_by_learning_rate: bool = True,
                 name: str = "adamw", **kwargs):
        check_non_negative("weight_decay", weight_decay)
        scale_weight_decay_by_learning_rate = check_bool(
            "scale_weight_decay_by_learning_rate", scale_weight_decay_by_learning_rate)
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay,
                         beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, amsgrad=amsgrad,
                         name=name, **kwargs)
        self.scale_weight_decay_by_learning_rate = scale_weight_decay_by_learning_rate

    _table_update = Adam._table_update

    def _decay_factor(self, learning_rate):
        wd = ops.cast(self.weight_decay, "float32")
        if self.scale_weight_decay_by_learning_rate:
            return ops.cast(learning_rate, "float32") * wd
        return wd

    def get_config(self):
        config = super().get_config()
        config["scale_weight_decay_by_learning_rate"] = \
            self.scale_weight_decay_by_learning_rate
        return config

    def _apply_weight_decay(self, variables):
        pass  # applied per variable in update_step, sparse-aware

    def update_step(self, gradient, variable, learning_rate):
        sparse = self._kre_rows(gradient)
        if sparse is not None:
            # Repeated indices summed first: Adam then sees each row's true
            # gradient (as tables do).
            rows, values = sparse
            gradient = self._kre_at_rows(values, rows, gradient.dense_shape)
        if _keras_fixes.uses_weight_decay(self, variable):  # honours exclude_from_weight_decay
            factor = ops.cast(self._decay_factor(learning_rate), variable.dtype)
            if sparse is None:
                self.assign_sub(variable, variable * factor)
            else:
                self.assign_sub(variable, self._kre_at_rows(
                    self._kre_gather(variable, rows) * factor, rows))
        super().update_step(gradient, variable, learning_rate)


def _is_placeholder(slot):
    """Whether `slot` stands for state inside a table (None, or a `TableSlot`)."""

    return slot is None or not isinstance(slot, keras.Variable)


def _update_rows(optimizer, gradient, variable, slots, rows):
    """Applies `rows(g, *slot values, sparse) -> (delta, *new slot values)`
    to the rows of a sparse gradient (equal indices summed) or to the whole
    variable; returns whether the gradient was sparse."""
    sparse = optimizer._kre_rows(gradient)  # pylint: disable=protected-access
    if sparse is None:
        g = ops.cast(gradient, variable.dtype)
        delta, *new = rows(g, *[s.value for s in slots], False)
        for slot, value in zip(slots, new):
            optimizer.assign(slot, value)
        optimizer.assign_sub(variable, delta)
        return False
    at, g = sparse
    gather, at_rows = optimizer._kre_gather, optimizer._kre_at_rows  # pylint: disable=protected-access
    delta, *new = rows(g, *[gather(s, at) for s in slots], True)
    for slot, value in zip(slots, new):
        optimizer.assign(slot, at_rows(value, at))
    optimizer.assign_sub(variable, at_rows(delta, at))
    return True


# Usable by name in `model.compile(optimizer=...)` ("adamw" stays Keras's).
keras.saving.get_custom_objects().update(
    {"adam_async": AdamAsync, "adagrad_decay": AdagradDecay})
