"""DeepRec's optimizers for large sparse models: AdamAsync, AdagradDecay, AdamW.

Each updates dense variables, `keras.layers.Embedding` (sparse
`tf.IndexedSlices` gradients, duplicate indices summed first) and embedding
tables (one fused kernel per table and step).
"""

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb._checks_core import (check_adagrad_decay, check_beta, check_bool,
                                        check_non_negative)
from keras_rec_emb.optimizers.base import (
    TableOptimizer,
    TableSlot,
    check_learning_rate,
    sum_duplicate_rows,
)
from keras_rec_emb.backend.tensorflow.variables import is_table
from keras_rec_emb.optimizers.keras_optimizers import Adam

ops = keras.ops
_register = keras.saving.register_keras_serializable(package="keras_rec_emb")

_BASE_ARGS = """
        **kwargs: the arguments of every Keras optimizer (`name`,
            `weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `loss_scale_factor`, ...; `use_ema` and
            `gradient_accumulation_steps` are refused when the model has
            embedding tables)."""


@_register
class AdamAsync(TableOptimizer, keras.optimizers.Optimizer):
    # A docstring built with + is an expression, not a docstring: assigned.
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
            `False`.""" + _BASE_ARGS + """

    Example:

    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> x = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(x))
    >>> model.compile(optimizer="adam_async", loss="mse")
    >>> history = model.fit(np.array([[1, 10**12], [7, 1]]), np.ones((2, 1)),
    ...                     verbose=0)
    """

    def __init__(self,
                 learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-8,
                 use_nesterov: bool = False, apply_sparse_rmsprop: bool = False,
                 name: str = "adam_async", **kwargs):
        check_learning_rate(learning_rate)
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

    def _table_update(self, learning_rate):
        return "adam_async", {"beta_1": self.beta_1, "beta_2": self.beta_2,
                              "epsilon": self.epsilon,
                              "use_nesterov": float(self.use_nesterov),
                              "apply_sparse_rmsprop": float(self.apply_sparse_rmsprop)}

    def update_step(self, gradient, variable, learning_rate):
        index = _compat.variable_index(self, variable)
        m, v = self._momentums[index], self._velocities[index]
        b1p, b2p = self._beta1_powers[index], self._beta2_powers[index]
        lr = ops.cast(learning_rate, variable.dtype)
        b1, b2 = self.beta_1, self.beta_2
        if isinstance(gradient, tf.IndexedSlices):
            rows, g = sum_duplicate_rows(gradient)
            m_rows, v_rows = tf.gather(m.value, rows), tf.gather(v.value, rows)
            if self.apply_sparse_rmsprop:
                v_rows = v_rows * b2 + g * g * (1 - b2)
                m_rows = m_rows * b1 + lr * g / ops.sqrt(v_rows + self.epsilon)
                self.assign(v, tf.IndexedSlices(v_rows, rows))
                self.assign(m, tf.IndexedSlices(m_rows, rows))
                self.assign_sub(variable, tf.IndexedSlices(m_rows, rows))
                return
            alpha = lr * ops.sqrt(1 - b2p) / (1 - b1p)
            m_rows = m_rows * b1 + g * (1 - b1)
            v_rows = v_rows * b2 + g * g * (1 - b2)
            step = g * (1 - b1) + b1 * m_rows if self.use_nesterov else m_rows
            self.assign(m, tf.IndexedSlices(m_rows, rows))
            self.assign(v, tf.IndexedSlices(v_rows, rows))
            self.assign_sub(variable, tf.IndexedSlices(
                step * alpha / (ops.sqrt(v_rows) + self.epsilon), rows))
        else:
            g = ops.cast(gradient, variable.dtype)
            alpha = lr * ops.sqrt(1 - b2p) / (1 - b1p)
            self.assign(m, m * b1 + g * (1 - b1))
            self.assign(v, v * b2 + g * g * (1 - b2))
            step = g * (1 - b1) + b1 * m if self.use_nesterov else m
            self.assign_sub(variable, step * alpha / (ops.sqrt(v) + self.epsilon))
        self.assign(b1p, b1p * b1)
        self.assign(b2p, b2p * b2)

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
    # A docstring built with + is an expression, not a docstring: assigned.
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

    So the first decay comes with the `accumulator_decay_step`-th update, and
    a row idle for several periods decays once when next updated, then once
    per update until its count catches up (as in DeepRec; not
    `rate ** periods`).

    Where it differs from DeepRec: `epsilon` (default `1e-7`, as Keras's
    Adagrad) is added under the square root; DeepRec has none. Pass
    `epsilon=0` for DeepRec's numbers bit for bit. Checkpoints written
    by keras_rec_emb 0.1.0 stored a dense variable's `decay_period` as one
    scalar (the last period it was decayed for); they still load (the
    scalar fills every row).

    Args:
        learning_rate: float >= 0, a schedule, or a callable. Defaults to
            `0.001`.
        initial_accumulator_value: float > 0. Starting value and floor of the
            accumulators. Defaults to `0.1`.
        accumulator_decay_step: int > 0. Period length in steps. Defaults to
            `100000`.
        accumulator_decay_rate: float in (0, 1]. Defaults to `0.9`.
        epsilon: float >= 0. Defaults to `1e-7`.""" + _BASE_ARGS + """

    Example:

    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> x = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(x))
    >>> opt = keras_rec_emb.optimizers.AdagradDecay(
    ...     0.1, accumulator_decay_step=1000, accumulator_decay_rate=0.5)
    >>> model.compile(optimizer=opt, loss="mse")
    >>> history = model.fit(np.array([[1, 10**12], [7, 1]]), np.ones((2, 1)),
    ...                     verbose=0)
    """

    def __init__(self, learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 0.001,
                 initial_accumulator_value: float = 0.1, accumulator_decay_step: int = 100000,
                 accumulator_decay_rate: float = 0.9, epsilon: float = 1e-7,
                 name: str = "adagrad_decay", **kwargs):
        check_learning_rate(learning_rate)
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
        self._decay_periods = []
        for variable in var_list:
            if is_table(variable):
                self._decay_periods.append(
                    self.add_scalar_slots([variable], "decay_period", 0.0)[0])
            else:
                shape = tuple(variable.shape[:1])
                self._decay_periods.append(self.add_variable(
                    shape=shape, initializer="zeros",
                    name=f"{variable.path.replace('/', '_')}_decay_period"))

    def load_own_variables(self, store):
        # keras_rec_emb 0.1.0 saved a dense variable's decay_period as one scalar (the
        # last period it was decayed for): it fills every row.
        if len(store.keys()) == len(self.variables):
            periods = {id(p) for p in self._decay_periods if not isinstance(p, TableSlot)}
            for i, variable in enumerate(self.variables):
                value = np.asarray(store[str(i)])
                if id(variable) in periods and value.shape != tuple(variable.shape):
                    if value.size != 1:
                        raise ValueError(
                            f"Cannot restore `decay_period` of shape {value.shape} into "
                            f"shape {tuple(variable.shape)}")
                    variable.assign(np.full(variable.shape, value.reshape(()), np.float32))
                else:
                    variable.assign(value)
            return
        super().load_own_variables(store)

    def _period(self):
        # DeepRec feeds its kernels global_step + 1.
        return ops.cast((self.iterations + 1) // self.accumulator_decay_step, "float32")

    def _table_update(self, learning_rate):
        return "adagrad_decay", {"epsilon": self.epsilon,
                                 "decay_rate": self.accumulator_decay_rate,
                                 "baseline": self.initial_accumulator_value,
                                 "period": self._period()}

    def update_step(self, gradient, variable, learning_rate):
        index = _compat.variable_index(self, variable)
        acc, last = self._accumulators[index], self._decay_periods[index]
        lr = ops.cast(learning_rate, variable.dtype)
        period = self._period()
        rate, floor = self.accumulator_decay_rate, self.initial_accumulator_value

        def decay(acc_rows, last_rows):
            # At most one decay per update of a row (DeepRec).
            need = period > last_rows
            shape = tf.concat([tf.shape(need), tf.ones(
                [tf.rank(acc_rows) - tf.rank(need)], tf.int32)], axis=0)
            need_rows = tf.reshape(need, shape)
            decayed = ops.where(need_rows, ops.maximum(acc_rows * rate, floor), acc_rows)
            return decayed, last_rows + ops.cast(need, last_rows.dtype)

        if isinstance(gradient, tf.IndexedSlices):
            rows, g = sum_duplicate_rows(gradient)
            acc_rows, last_rows = decay(tf.gather(acc.value, rows),
                                        tf.gather(last.value, rows))
            acc_rows = acc_rows + g * g
            self.assign(acc, tf.IndexedSlices(acc_rows, rows))
            self.assign(last, tf.IndexedSlices(last_rows, rows))
            self.assign_sub(variable, tf.IndexedSlices(
                lr * g / ops.sqrt(acc_rows + self.epsilon), rows))
        else:
            g = ops.cast(gradient, variable.dtype)
            acc_value, last_value = decay(acc.value, last.value)
            self.assign(acc, acc_value + g * g)
            self.assign(last, last_value)
            self.assign_sub(variable, lr * g / ops.sqrt(acc + self.epsilon))

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
    """Adam with decoupled weight decay (Loshchilov & Hutter), sparse-aware.

    `var -= learning_rate * weight_decay * var` (Keras's convention), or with
    `scale_weight_decay_by_learning_rate=False` DeepRec's (TF contrib's
    `AdamWOptimizer`, `DecoupledWeightDecayExtension`): `var -= weight_decay
    * var`, not scaled by the learning rate; then Keras's Adam update (the
    same as DeepRec's Adam: `lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) * m /
    (sqrt(v) + epsilon)`). For
    dense gradients the decay covers the whole variable, exactly as
    `keras.optimizers.AdamW`. For sparse gradients, both embedding tables and
    `tf.IndexedSlices` gradients of dense variables (`keras.layers.Embedding`),
    the decay applies only to the rows updated in this step: rows that are
    not looked up are neither trained nor shrunk. `exclude_from_weight_decay`
    works as in Keras.

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
        **kwargs: other `keras.optimizers.AdamW` arguments.

    Example:

    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> x = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(x))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.AdamW(0.01, 0.01),
    ...               loss="mse")
    >>> history = model.fit(np.array([[1, 10**12], [7, 1]]), np.ones((2, 1)),
    ...                     verbose=0)
    """

    def __init__(self, weight_decay: float = 0.004,
                 learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 0.001,
                 beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-8,
                 amsgrad: bool = False, scale_weight_decay_by_learning_rate: bool = True,
                 name: str = "adamw", **kwargs):
        check_learning_rate(learning_rate)
        check_non_negative("weight_decay", weight_decay)
        scale_weight_decay_by_learning_rate = check_bool(
            "scale_weight_decay_by_learning_rate", scale_weight_decay_by_learning_rate)
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay,
                         beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, amsgrad=amsgrad,
                         name=name, **kwargs)
        self.scale_weight_decay_by_learning_rate = scale_weight_decay_by_learning_rate

    _table_update = Adam._table_update

    def _decay_factor(self, learning_rate):
        wd = tf.cast(self.weight_decay, tf.float32)
        if self.scale_weight_decay_by_learning_rate:
            return tf.cast(learning_rate, tf.float32) * wd
        return wd

    def get_config(self):
        config = super().get_config()
        config["scale_weight_decay_by_learning_rate"] = \
            self.scale_weight_decay_by_learning_rate
        return config

    def _apply_weight_decay(self, variables):
        pass  # applied per variable in update_step, sparse-aware

    def update_step(self, gradient, variable, learning_rate):
        if isinstance(gradient, tf.IndexedSlices):
            # Repeated indices summed first: Adam then sees each row's true
            # gradient (as tables do).
            rows, values = sum_duplicate_rows(gradient)
            gradient = tf.IndexedSlices(values, rows, gradient.dense_shape)
        if _compat.uses_weight_decay(self, variable):
            factor = ops.cast(self._decay_factor(learning_rate), variable.dtype)
            if isinstance(gradient, tf.IndexedSlices):
                self.assign_sub(variable, tf.IndexedSlices(
                    tf.gather(variable, gradient.indices) * factor, gradient.indices))
            else:
                self.assign_sub(variable, variable * factor)
        super().update_step(gradient, variable, learning_rate)


# Usable by name in `model.compile(optimizer=...)` ("adamw" stays Keras's).
keras.saving.get_custom_objects().update(
    {"adam_async": AdamAsync, "adagrad_decay": AdagradDecay})
