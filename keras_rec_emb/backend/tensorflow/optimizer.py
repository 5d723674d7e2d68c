"""The TensorFlow backend's table plumbing of `keras_rec_emb.optimizers`.

The optimizers (written once, in keras_rec_emb/optimizers/) subclass Keras's
own through the running backend's `TableOptimizer` (`class Adam(
TableOptimizer, keras.optimizers.Adam)`), so dense variables and
`keras.layers.Embedding` take exactly Keras's path. This mixin intercepts
the seams where a table differs:

* `add_variable_from_reference`: a table's slot lives inside the table
  (`EmbeddingTable.add_slot`); a `TableSlot` stands in Keras's slot lists.
* `_backend_update_step`: table gradients (`tf.IndexedSlices` over keys) go
  to one fused C++ kernel per table, or one for all tables whose keys are
  distinct (a group lookup's); the rest to Keras.
* `_apply_weight_decay`: a table's decoupled weight decay is applied by the
  kernel to the rows updated in the step.
* `apply` / `_clip_gradients`: with clipping, a table's duplicate keys are
  summed first, so that clipping sees the row's true gradient;
  `global_clipnorm` counts a table's rows without densifying them (Keras
  densifies `IndexedSlices`, impossible for a hash table).
* `_kre_rows` / `_kre_gather` / `_kre_at_rows`: the rows of a dense
  variable's `tf.IndexedSlices` gradient, on which the DeepRec optimizers'
  shared math runs.

`LossScaleTables` is the table part of `keras_rec_emb.optimizers.
LossScaleOptimizer` here.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb._update_rules import RULES
from keras_rec_emb.backend.tensorflow import checks as _checks
from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.backend.tensorflow import variables as _variables
from keras_rec_emb.backend.tensorflow.op_args import named_outputs
from keras_rec_emb.backend.tensorflow.variables import is_table


class _TableUpdate:
    """One table's fused update of a step: `table.sparse_apply`'s arguments."""

    def __init__(self, table, keys, grads, rule, hyper, step, slots, distinct):
        self.table, self.keys, self.grads, self.rule = table, keys, grads, rule
        self.hyper, self.step, self.slots, self.distinct = hyper, step, slots, distinct

    def apply(self):
        # The table applies it (a distributed shard gathers the replicas'
        # gradients, or leaves the update to its owner: keras_rec_emb.distribute).
        self.table.sparse_apply(self.keys, self.grads, self.rule, self.hyper, self.step,
                                list(self.slots), distinct=self.distinct)

    def group(self):
        """The key of the one op that may update this table with others
        (`_ops.group_sparse_apply`), or None: tables with distinct keys, on
        one device, outside a tf.distribute strategy (a distributed shard
        gathers or hands off its update, or lives on a parameter server)."""
        if not (self.distinct and not tf.distribute.has_strategy()
                and type(self.table).sparse_apply is _variables.EmbeddingTable.sparse_apply):
            return None
        return (self.table.device, self.table.key_dtype, self.rule, tuple(self.hyper),
                self.slots, id(self.step))


def _apply_table_updates(updates):
    """Applies the `_TableUpdate`s: those of one group (`_TableUpdate.group`)
    in one op that updates their tables concurrently, the others one op per
    table (each table's update is the same either way)."""
    groups = {}
    for u in updates:
        key = u.group()
        groups.setdefault(key if key is not None else ("alone", id(u)), []).append(u)
    for key, members in groups.items():
        # A table twice in one op would be updated by two threads at once.
        if (key[0] == "alone" or len(members) == 1
                or len({id(u.table) for u in members}) < len(members)):
            for u in members:
                u.apply()
            continue
        first = members[0]
        with tf.device(first.table.device):  # with the tables (resource ops run there)
            _ops.group_sparse_apply([u.table.handle for u in members],
                                    [u.keys for u in members], [u.grads for u in members],
                                    first.rule, [u.hyper for u in members], first.step,
                                    first.slots)


class TableSlot:
    """Stands for an optimizer slot that lives inside an embedding table."""

    def __init__(self, table, name):
        self.table = table
        self.name = name

    def __repr__(self):
        return f"<TableSlot '{self.name}' of {self.table.name}>"


def _initial_value(initializer):
    """The constant a slot initializer fills with (slots are constants)."""
    init = keras.initializers.get(initializer)
    value = np.asarray(keras.ops.convert_to_numpy(init(shape=(2,), dtype="float32")))
    if value[0] != value[1]:
        raise ValueError(
            "Optimizer slots of embedding tables must start from a constant; "
            f"received initializer {initializer!r}"
        )
    return float(value[0])


def _sum_duplicates(grad):
    """A table gradient with the rows of equal keys summed."""
    unique, values = sum_duplicate_rows(grad)
    return tf.IndexedSlices(values, unique)


def sum_duplicate_rows(grad):
    """(unique indices, summed rows) of an IndexedSlices gradient."""
    unique, idx = tf.unique(grad.indices)
    return unique, tf.math.unsorted_segment_sum(grad.values, idx, tf.size(unique))


# Outputs that never hold a key twice, by op type: (output name, whether
# that holds for this op). The group lookup's `unique_ids` are its distinct
# ids in a training lookup (`insert`); an inference lookup may list every id
# (its pooled path, csrc/kernels/group_forward.cc). tf.unique's `y` always.
_DISTINCT_OUTPUTS = {
    "KRE>GroupLookup": ("unique_ids", lambda op: op.get_attr("insert")),
    "Unique": ("y", lambda op: True),
    "UniqueV2": ("y", lambda op: True),
}


def has_distinct_keys(grad):
    """Whether a table gradient's keys are known to hold no key twice (traced,
    its indices a training group lookup's distinct ids or a `tf.unique`'s
    output), so the fused apply may skip its dedupe. False when unknown."""
    indices = grad.indices
    op = getattr(indices, "op", None) if not tf.executing_eagerly() else None
    known = _DISTINCT_OUTPUTS.get(getattr(op, "type", None))
    if known is None:
        return False
    name, holds = known
    return holds(op) and any(t.value_index == indices.value_index
                             for t in named_outputs(op)[name])


def own_optimizer(table, model_optimizer):
    """The optimizer that updates `table` when `model_optimizer` applies the
    model's gradients: the table's own (`EmbeddingVariable(optimizer=...)`)
    or None for the model's."""
    own = table.optimizer
    return None if own is None or own is model_optimizer else own


def _is_table_grad(grad):
    # The lookup's gradient is the only IndexedSlices without a dense shape.
    return isinstance(grad, tf.IndexedSlices) and grad.dense_shape is None


class TableOptimizer:
    """Mixin placed before a Keras optimizer class; see the module docstring
    (and `optimizers.keras_optimizers.TableOptimizer` for `_table_update`)."""

    check_learning_rate = staticmethod(_checks.check_learning_rate)

    def _table_update(self, learning_rate, step):
        raise NotImplementedError

    # -- building ---------------------------------------------------------------
    def build(self, variables):
        if self.built:
            return
        tables = [v for v in variables if is_table(v)]
        if tables and self.use_ema:
            raise ValueError(
                f"{type(self).__name__}(use_ema=True) cannot keep a moving "
                "average of embedding tables (their rows change in number). "
                f"Tables: {[t.name for t in tables]}"
            )
        if tables and self.gradient_accumulation_steps:
            raise ValueError(
                f"{type(self).__name__}(gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}) is not supported with "
                f"embedding tables. Tables: {[t.name for t in tables]}"
            )
        for table in tables:
            # A stock wrapper around this optimizer (Keras's
            # LossScaleOptimizer) then gets a precise error from the table.
            table.table._table_optimizer = type(self).__name__
        super().build(variables)
        owned = {}  # a table's own optimizer: built once, for its table's variables
        for table in tables:  # (a distributed table's shards share one)
            own = own_optimizer(table.table, self)
            if own is not None:
                owned.setdefault(id(own), (own, []))[1].append(table)
        for own, own_tables in owned.values():
            with tf.init_scope():  # its slots, in its tables
                own.build(own_tables)

    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        if is_table(reference_variable):
            if own_optimizer(reference_variable.table, self) is not None:
                # Updated by its own optimizer, which makes its own slots.
                return TableSlot(reference_variable.table, name)
            # Built inside the first traced train step: like Keras variable
            # creation, slot creation is lifted out to run once, eagerly.
            with tf.init_scope():
                reference_variable.table.add_slot(name, _initial_value(initializer))
            return TableSlot(reference_variable.table, name)
        # Eagerly, so that Keras places the slot beside its variable (traced,
        # `colocate_vars_with` only colocates ops: a variable on a parameter
        # server would get its slots on the worker).
        with tf.init_scope():
            return super().add_variable_from_reference(
                reference_variable, name=name, initializer=initializer)

    def add_scalar_slots(self, variables, name, init, per_row=False):
        """One float of state per variable (per row of its first axis with
        `per_row`), or per row for a table: a list aligned with `variables`,
        of Keras variables and, for tables, width-1 `TableSlot`s."""
        slots = []
        for variable in variables:
            if is_table(variable):
                if own_optimizer(variable.table, self) is None:
                    with tf.init_scope():
                        variable.table.add_slot(name, init, width=1)
                slots.append(TableSlot(variable.table, name))
            else:
                with tf.init_scope(), tf.device(variable.value.device):  # beside it
                    slots.append(self.add_variable(
                        shape=tuple(variable.shape[:1]) if per_row else (),
                        initializer=keras.initializers.Constant(init),
                        name=f"{variable.path.replace('/', '_')}_{name}"))
        return slots

    def _var_key(self, variable):
        if is_table(variable):
            return variable.table._kre_id
        return super()._var_key(variable)

    # -- applying -----------------------------------------------------------
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        dense_grads, dense_vars, updates = [], [], []
        for grad, var in zip(grads, trainable_variables):
            if is_table(var):
                updates.append(self._table_update_of(grad, var, learning_rate))
            else:
                dense_grads.append(grad)
                dense_vars.append(var)
        _apply_table_updates(updates)
        if dense_vars:
            super()._backend_update_step(dense_grads, dense_vars, learning_rate)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Outside a tf.distribute strategy the one-replica sum is the
        # identity, but Keras's call wraps dense gradients in a
        # tf.custom_gradient registered in TensorFlow's global registry for
        # good: every traced train step, with the table handles it captures,
        # would stay alive (~2 MB and 9 handles per build/fit/save/load cycle).
        if not tf.distribute.has_strategy():
            return list(grads_and_vars)
        return super()._all_reduce_sum_gradients(grads_and_vars)

    def _table_update_of(self, grad, variable, learning_rate):
        """The `_TableUpdate` of a table's gradient (applied by
        `_apply_table_updates`)."""
        table = variable.table
        if not isinstance(grad, tf.IndexedSlices):
            raise TypeError(
                f"The gradient of embedding table '{table.name}' must be a "
                f"tf.IndexedSlices over keys; received {type(grad).__name__}"
            )
        lr = tf.cast(learning_rate, tf.float32)
        optimizer = own_optimizer(table, self)
        if optimizer is None:
            optimizer = self
        else:
            # The table's own optimizer counts the model's steps (its
            # schedule and bias corrections follow them) and brings its own
            # learning rate.
            optimizer.iterations.assign(self.iterations)
            lr = tf.cast(optimizer.learning_rate, tf.float32)
        decay = 0.0
        if optimizer.weight_decay is not None and _compat.uses_weight_decay(optimizer, variable):
            decay = optimizer._decay_factor(lr)  # pylint: disable=protected-access
        name, hyper = optimizer._table_update(lr, self.iterations)  # pylint: disable=protected-access
        rule = RULES[name]
        hyper = dict(hyper, learning_rate=lr, decay=decay)
        ordered = dict(zip(rule.hparam_names, rule.ordered(hyper)))
        distinct = has_distinct_keys(grad)
        keys = tf.cast(grad.indices, table.key_dtype)
        values = tf.reshape(tf.cast(grad.values, tf.float32), [-1, table.dim])
        return _TableUpdate(table, keys, values, name, ordered, self.iterations,
                            tuple(rule.slot_names(hyper)), distinct)

    def _decay_factor(self, learning_rate):
        """The fraction of a row that decoupled weight decay removes."""
        return tf.cast(learning_rate, tf.float32) * tf.cast(self.weight_decay, tf.float32)

    def _apply_weight_decay(self, variables):
        super()._apply_weight_decay([v for v in variables if not is_table(v)])

    # -- the rows of a dense variable's sparse gradient --------------------------
    def _kre_rows(self, gradient):
        """(rows, summed values) of a `tf.IndexedSlices` gradient; None for
        a dense one."""
        if isinstance(gradient, tf.IndexedSlices):
            return sum_duplicate_rows(gradient)
        return None

    @staticmethod
    def _kre_gather(variable, rows):
        return tf.gather(variable.value if isinstance(variable, keras.Variable) else variable,
                         rows)

    @staticmethod
    def _kre_at_rows(values, rows, dense_shape=None):
        return tf.IndexedSlices(values, rows, dense_shape)

    def _kre_saved_variables(self):
        return self.variables

    def apply(self, grads, trainable_variables=None):
        if self.clipnorm or self.clipvalue or self.global_clipnorm:
            variables = (_compat.built_variables(self) if trainable_variables is None
                         else list(trainable_variables))
            grads = [_sum_duplicates(g) if is_table(v) and g is not None else g
                     for g, v in zip(grads, variables)]
        return super().apply(grads, trainable_variables)

    def _clip_gradients(self, grads):
        if not (self.global_clipnorm and self.global_clipnorm > 0):
            return super()._clip_gradients(grads)
        # Keras's clip_by_global_norm, except that a table's rows are counted
        # as they are (duplicates were summed in `apply`), never densified.
        ops = keras.ops
        squared = [ops.sum(ops.square(g.values if _is_table_grad(g) else g))
                   for g in grads if g is not None]
        norm = ops.sqrt(ops.sum(ops.stack(squared)))
        clip = self.global_clipnorm
        scale = clip * ops.minimum(1.0 / norm, 1.0 / clip)
        scale = scale + (norm - norm)  # NaN/inf norms give NaN, as in Keras

        def scaled(g):
            if g is None:
                return None
            if _is_table_grad(g):
                return tf.IndexedSlices(g.values * scale, g.indices)
            return g * scale

        return [scaled(g) for g in grads]


class LossScaleTables:
    """The table part of `LossScaleOptimizer`: a table's `tf.IndexedSlices`
    gradient goes through Keras's unscaling and apply as it is (its rows
    are keyed by ids), and only its rows are checked for finiteness."""

    @staticmethod
    def _check_inner(inner_optimizer):
        return isinstance(inner_optimizer, TableOptimizer)

    def _var_key(self, variable):
        if is_table(variable):
            return variable.table._kre_id
        return super()._var_key(variable)

    def check_finite(self, grads):
        return super().check_finite([g.values if _is_table_grad(g) else g for g in grads])
