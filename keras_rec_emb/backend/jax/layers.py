"""`EmbeddingVariable`'s JAX half: its table, lookups and in-backward updates.

`keras_rec_emb.layers.EmbeddingVariable` is written once; under Keras's JAX
backend it takes `EmbeddingVariableBackend` below as its base: the table
(`keras_rec_emb.backend.jax.table.JaxTable`) made at `build`, the call's
lookup, and the machinery that trains the table.

The table is updated in the backward pass of its lookup, as TPU embedding
does: the lookup is a `jax.custom_vjp` whose backward applies the rows'
gradient with its optimizer's rule, inside the jitted training step,
ordered after the forward lookup by the table effect's token (`ffi`). Not
in `optimizer.apply`: Keras's JAX trainer differentiates with respect to
fixed-shape `trainable_variables` only, and the rows a batch reads from a
growing table are no such variable (carrying their gradient would take a
fixed-capacity buffer per table and a side channel for the keys); in the
backward it is one fused sparse apply per table and step.

The table's optimizer is the one `model.compile` got, found through the
layer's `anchor` (a zero-size trainable variable, the lookup's
differentiable input, so that `jax.grad` runs the backward at all) when it
builds (`keras_rec_emb.backend.jax.optimizers`), or the layer's own
(`optimizer=`); its step and learning rate are those of the training step
(`TableRule`). A table looked up several times in one step gets one update
with the gradients of all its lookups, equal ids summed, as under
TensorFlow (`_StepLookups`). Clipping, EMA, gradient accumulation and
loss scaling by the trainer are refused with an error: the backward sees
this table's gradient alone, before the trainer's optimizer could clip or
unscale it (`LossScaleOptimizer` unscales in the backward itself).
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb._checks_core import check_combiner_weights
from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.backend.jax.ids import check_combinable, float_weights, integer_ids, numpy_ids
from keras_rec_emb.backend.jax.optimizers import TableRule, register_anchor
from keras_rec_emb.backend.jax.table import JaxTable

# The layer's step counter in its weights store (see `_save_step`).
_STEP = "iterations"


def combine_last_axis(rows, keep, combiner, weights=None):
    """rows [..., L, dim] -> [..., dim] by `combiner`. `keep` (bool [..., L]
    or None: all) marks the ids that count; dropped ids have zero rows. With
    `weights` ([..., L]) each kept id weighs its weight, and for "mean" and
    "sqrtn" only ids of weight > 0 count (TensorFlow's rule); the
    denominator is `sum(w)` ("mean") or `sqrt(sum(w**2))` ("sqrtn"), and a
    row whose denominator is 0 gives zeros."""
    if weights is None:
        total = jnp.sum(rows, axis=-2)
        if combiner == "sum":
            return total
        if keep is not None:
            count = jnp.sum(keep.astype(rows.dtype), axis=-1, keepdims=True)
        else:
            count = jnp.full(total.shape[:-1] + (1,), rows.shape[-2], rows.dtype)
        count = jnp.maximum(count, 1.0)  # a row with no id gives zeros
        return total / (count if combiner == "mean" else jnp.sqrt(count))
    w = weights.astype(rows.dtype)
    if keep is not None:
        w = jnp.where(keep, w, 0.0)
    if combiner != "sum":
        w = jnp.where(w > 0, w, 0.0)
    total = jnp.sum(rows * w[..., None], axis=-2)
    return total if combiner == "sum" else divided(total, denominator(w, combiner))


def denominator(w, combiner):
    """The denominator of "mean" (`sum(w)`) or "sqrtn" (`sqrt(sum(w**2))`)
    over the last axis of the weights `w`, kept as an axis of 1."""
    denom = jnp.sum(w if combiner == "mean" else w * w, axis=-1, keepdims=True)
    return jnp.sqrt(denom) if combiner == "sqrtn" else denom


def divided(x, denom):
    """x / denom, and 0 where denom is 0 (a row without ids gives zeros)."""
    return jnp.where(denom > 0, x / jnp.where(denom > 0, denom, 1.0), 0.0)


def pooled_scale(ids, weights, combiner, prune):
    """Each id's share of its combined row, [..., L]: its weight (1
    without weights; 0 for padding with `prune`, and with "mean" and
    "sqrtn" for a weight <= 0) over the row's denominator (`combine_last_axis`'s,
    0 when that is 0). The gradient of the id's row is this share times the
    combined row's gradient."""
    w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    if prune:
        w = jnp.where(ids >= 0, w, 0.0)
    if combiner == "sum":
        return w
    w = jnp.where(w > 0, w, 0.0)
    return divided(w, denominator(w, combiner))


def _table_lookup(handle, ids, weights, dim, insert, prune, combiner):
    """Rows of `ids`, or with a `combiner` the combined rows of ids
    [rows, L] in one pooled call (no [rows, L, dim] array)."""
    if combiner is None:
        return ffi.lookup(handle, ids, dim, insert=insert, prune=prune)
    return ffi.pooled_lookup(handle, ids, dim, combiner, weights, insert=insert, prune=prune)


class _StepLookups:
    """The training lookups of one table in one training step.

    The step counts once and the table gets one fused update: the backward
    of each later lookup stashes its ids and gradient here, and that of the
    step's first lookup, which runs after them all (each later lookup takes
    the first one's zero-size `carry` output as an input), applies them
    together. `marker` is the value `iterations` holds after the first
    lookup: a call that reads it is in the same step (of the same trace).
    It is set only when the first lookup trains and cleared when its
    backward has applied the step: run eagerly, the next step reads the
    very array this one left in `iterations`, which must not make it a
    later lookup of this step."""

    def __init__(self, step):
        self.step = step
        self.marker = None
        self.carry = None
        self.pending = []
        self.training = False


def _first_lookup(layers, groups, conditional, primal, train_rows, parts_of):
    """lookup(ids, weights, anchors, steps) -> (rows, carries, trained), the
    step's first training lookup of each of `layers`' tables in one call
    (their `_StepLookups` `groups`, `anchors`, `steps`, and per table a
    carry and a `trained` flag); its backward applies each table's
    gradient, with those the step's later lookups stashed. `primal(ids,
    weights, insert)` gives the rows; `train_rows(ids, weights)` the rows
    that insert and, per table, None or the (inverse, distinct ids, count)
    of its pooled lookup, which its update then takes as they are;
    `parts_of(ids, weights, grads)` per table its part of the rows'
    gradient (`_apply_gradients`). With `conditional` (`training=None`,
    which a subclassed model's layer gets in `fit` as in `predict` when its
    `call` does not pass `training` on), differentiation decides: under
    `jax.grad` JAX runs the forward rule (insert; `trained` 1; the backward
    applies), otherwise the plain function (no insert; `trained` 0, so the
    step counters stay)."""

    def carries():
        return [jnp.zeros((0,), jnp.float32) for _ in layers]

    @jax.custom_vjp
    def lookup(ids, weights, anchors, steps):
        del anchors
        rows = primal(ids, weights, not conditional)
        return rows, carries(), [(jnp.zeros_like if conditional else jnp.ones_like)(s)
                                 for s in steps]

    def forward(ids, weights, anchors, steps):
        for layer, group in zip(layers, groups):
            if layer.table_rule is None:
                raise _no_optimizer_error(layer.name)
            group.training = True
        rows, distincts = train_rows(ids, weights)
        return ((rows, carries(), [jnp.ones_like(s) for s in steps]),
                (ids, weights, anchors, steps, distincts))

    def backward(saved, grads):
        ids, weights, anchors, steps, distincts = saved
        for layer, group, part, step, distinct in zip(layers, groups,
                                                      parts_of(ids, weights, grads[0]), steps,
                                                      distincts):
            parts = [part] + group.pending
            group.pending = []
            # pylint: disable-next=protected-access
            layer._apply_gradients(parts, step, None if len(parts) > 1 else distinct)
            group.marker, group.training = None, False  # the step is over
        return None, None, [jnp.zeros_like(a) for a in anchors], None

    lookup.defvjp(forward, backward)
    return lookup


def _table_first_lookup(layer, dim, prune, conditional, group, combiner=None):
    """`_first_lookup` of one layer's table: lookup(ids, weights, anchors,
    steps) -> (rows, [carry], [trained])."""
    handle = layer.handle

    def primal(ids, weights, insert):
        return _table_lookup(handle, ids, weights, dim, insert, prune, combiner)

    def forward(ids, weights):
        if combiner is None:
            return primal(ids, weights, True), [None]
        # The distinct ids and the inverse go to the backward, which then
        # updates each distinct id without deduplicating again.
        rows, *distinct = ffi.pooled_lookup_distinct(handle, ids, dim, combiner, weights,
                                                     prune=prune)
        return rows, [distinct]

    def parts_of(ids, weights, grads):
        return [(ids, grads, prune, combiner, weights)]

    return _first_lookup([layer], [group], conditional, primal, forward, parts_of)


def group_training_lookup(tables, ids, weights, combiners, training):
    """The step's first training lookups of `tables` (EmbeddingVariable
    layers), each pooling one feature by its combiner, in one table call
    (`ffi.group_pooled_lookup_distinct`): ids [F, rows, L] (feature f's
    for `tables[f]`, padding -1) and weights of their shape or None ->
    rows [rows, sum of their dims]. Each table's step, update and later
    lookups in the step are those of its `_rows`."""
    handles = [t.handle for t in tables]
    dims = [t.embedding_dim for t in tables]
    conditional = training is None
    for t in tables:
        if not conditional and t.table_rule is None:
            raise _no_optimizer_error(t.name)
    steps = [t.iterations.value for t in tables]
    groups = [_StepLookups(step) for step in steps]

    def primal(ids, weights, insert):
        if insert:
            return ffi.group_pooled_lookup_distinct(handles, ids, dims, combiners, weights)[0]
        return ffi.group_pooled_lookup(
            handles, jnp.moveaxis(ids, 0, 1), dims, combiners,
            None if weights is None else jnp.moveaxis(weights, 0, 1))

    def train_rows(ids, weights):
        rows, inverse, distinct, count = ffi.group_pooled_lookup_distinct(
            handles, ids, dims, combiners, weights)
        return rows, [(inverse[f], distinct[f], count[f]) for f in range(len(tables))]

    def parts_of(ids, weights, grads):
        parts, start = [], 0
        for f, dim in enumerate(dims):
            parts.append((ids[f], grads[:, start:start + dim], True, combiners[f],
                          None if weights is None else weights[f]))
            start += dim
        return parts

    lookup = _first_lookup(tables, groups, conditional, primal, train_rows, parts_of)
    rows, carries, trained = lookup(ids, weights, [t.anchor.value for t in tables], steps)
    for table, group, carry, step in zip(tables, groups, carries, trained):
        # pylint: disable-next=protected-access
        table._begin_step(group, carry, step)
    return rows


def _later_lookup(layer, dim, prune, conditional, group, combiner=None):
    """lookup(ids, weights, anchor, carry, step) -> rows, a later training lookup of
    the step (see _StepLookups): its backward stashes the rows' gradient
    for the first lookup's backward."""
    handle = layer.handle

    @jax.custom_vjp
    def lookup(ids, weights, anchor, carry, step):
        del anchor, carry, step
        return _table_lookup(handle, ids, weights, dim, not conditional, prune, combiner)

    def forward(ids, weights, anchor, carry, step):
        del step
        rows = _table_lookup(handle, ids, weights, dim, True, prune, combiner)
        return rows, (ids, weights, anchor, carry)

    def backward(saved, grads):
        ids, weights, anchor, carry = saved
        group.pending.append((ids, grads, prune, combiner, weights))
        return None, None, jnp.zeros_like(anchor), jnp.zeros_like(carry), None

    lookup.defvjp(forward, backward)
    return lookup


def _no_optimizer_error(name):
    # Else a stock Keras optimizer would train the dense weights and
    # silently leave the table as it is.
    return ValueError(
        f"EmbeddingVariable '{name}' is called in training with no optimizer "
        "for its table: compile the model with one of keras_rec_emb.optimizers "
        "(SGD, Adagrad, Adam, Ftrl, AdamAsync, AdagradDecay, AdamW), which trains "
        "the table and the dense weights, or give the layer its own (`optimizer=`). "
        "Received: the table has no optimizer")


def default_key_dtype():
    """`key_dtype=None`: ids as wide as JAX holds them (int64 in its 64-bit
    mode, which the package turns on), so that none wraps."""
    return ffi.int_dtype().name


def register_layer_class(cls):
    """Nothing to register: no Functional-model fusion under JAX."""
    del cls


class EmbeddingVariableBackend:
    """What `EmbeddingVariable` does its own way under JAX (its base there)."""

    # -- init and build -------------------------------------------------------
    def _init_backend(self):
        self.table_rule = None

    def _resolve_optimizer(self, optimizer):
        """A fresh copy of the table's own optimizer, as under TensorFlow
        (each table keeps its own state: one optimizer given to several
        layers trains each with a copy of its own; a rate set later goes
        to `layer.optimizer`), and the rule that trains the table with it;
        else that of the optimizer that builds for `anchor`
        (`attach_optimizer`)."""
        if optimizer is not None:
            optimizer = type(optimizer).from_config(optimizer.get_config())
            self.table_rule = TableRule(optimizer, f"EmbeddingVariable '{self.name}'")
            # Built for no variable (the table holds the slots): its state
            # (slot lists, a loss scale's variables) is what it is under
            # TensorFlow, which builds it, and what its loading expects.
            optimizer.build([])
        return optimizer

    @staticmethod
    def _draw(initializer, shape):
        with jax.ensure_compile_time_eval():
            return np.asarray(initializer(shape=shape, dtype="float32"))

    def _make_table(self, default_values):
        self.table = JaxTable(f"{self.name}/embeddings", self.embedding_dim, self.key_dtype,
                              default_values, self.ev_option, trainable=self.trainable)
        self.anchor = self.add_weight(shape=(0,), initializer="zeros", name="anchor")
        register_anchor(self.anchor, self)
        if self.table_rule is not None:
            self._add_slots(self.table_rule)
        self.iterations = self.add_weight(shape=(), initializer="zeros", dtype="int32",
                                          trainable=False, name="iterations")
        rate = None if self.table_optimizer is None else self.table_optimizer.learning_rate
        if isinstance(rate, keras.Variable):
            # The own optimizer's rate joins the layer's state, so that a
            # jitted step reads it from the step's state: a rate assigned
            # later reaches the table at the next step (TableRule.new_step).
            self._kre_own_learning_rate = rate

    @property
    def handle(self):
        """The table's FFI handle (None before `build`)."""
        return None if self.table is None else self.table.handle

    @property
    def default_values(self):
        """The initializer matrix (None before `build`)."""
        return None if self.table is None else self.table.default_values

    @property
    def _kre_slot_specs(self):
        return [] if self.table is None else self.table.slot_specs

    def _add_slots(self, rule):
        for name, init, width in rule.slots:
            self.table.add_slot(name, init, width)

    def attach_optimizer(self, optimizer):
        """Called by a keras_rec_emb optimizer's `build` when it builds for
        this layer's `anchor`: it trains the table from the next traced
        training step on, unless the layer has its own optimizer."""
        if self.table_optimizer is not None:
            return
        if self.table is None:
            self.build()
        self.table_rule = TableRule(optimizer, f"EmbeddingVariable '{self.name}'")
        self._add_slots(self.table_rule)

    # -- saving: the step counter beside the table's parts ---------------------
    # Saved as `iterations` (the TensorFlow layer does not read it), so that
    # a reloaded model resumes at its step even when the last steps stamped
    # no version (ids all filtered, padding or evicted).
    def _save_step(self, store):
        store[_STEP] = np.asarray(int(self.iterations.value), np.int64)

    def _load_step(self, store, data):
        self._kre_step_unsaved = _STEP not in list(store.keys())
        if not self._kre_step_unsaved:
            self.iterations.assign(int(np.asarray(store[_STEP])))
            return
        # A file without the step (saved under TensorFlow, whose tables take
        # the model optimizer's): the model optimizer's step, when it loads
        # (TableOptimizer.load_own_variables); until then, or without one, the
        # step after the last one that stamped a version, admitted or filtered.
        versions = np.concatenate([np.asarray(data.get(name, np.zeros(0, np.int64)), np.int64)
                                   .ravel() for name in ("versions", "versions_filtered")])
        self.iterations.assign(int(versions.max()) + 1 if versions.size else 0)

    # -- forward --------------------------------------------------------------
    def __call__(self, ids, *args, **kwargs):
        return super().__call__(numpy_ids(ids, f"EmbeddingVariable '{self.name}'",
                                          self.key_dtype), *args, **kwargs)

    def _call(self, ids, weights, training):
        ids = integer_ids(ids, f"EmbeddingVariable '{self.name}'", self.key_dtype)
        check_combinable(ids, self.combiner, f"EmbeddingVariable '{self.name}'")
        if weights is not None:
            weights = self._checked_weights(ids, weights)
            if self.combiner != "sum":
                # Dropped ids are padding for the lookup: not inserted,
                # counted or updated.
                ids = jnp.where(weights > 0, ids, jnp.asarray(-1, ids.dtype))
        if self.combiner is None or ids.shape[-1] == 0:
            return self._combine(ids, self._rows(ids, training), weights)
        # One pooled lookup of the ids as [rows, L]: looked up and combined
        # in the table call, no [..., L, dim] array of rows.
        flat = ids.reshape(-1, ids.shape[-1])
        out = self._rows(flat, training, combiner=self.combiner,
                         weights=None if weights is None else weights.reshape(flat.shape))
        return out.reshape(*ids.shape[:-1], self.embedding_dim)

    def _checked_weights(self, ids, weights):
        dtype = getattr(weights, "dtype", None)
        check_combiner_weights(self.name, self.combiner, self.prune_invalid_ids,
                               None if dtype is None else np.dtype(dtype))
        return float_weights(weights, ids, f"EmbeddingVariable '{self.name}': `weights`")

    def _combine(self, ids, rows, weights=None):
        """Combines the last axis of `ids`: rows [..., L, dim] -> [..., dim];
        pruned ids (< 0, `prune_invalid_ids`) have zero rows and do not count."""
        if self.combiner is None:
            return rows
        keep = (ids >= 0) if self.prune_invalid_ids else None
        return combine_last_axis(rows, keep, self.combiner, weights)

    def _may_train(self, training):
        """Whether a lookup with this `training` may train the table: when
        it is trainable and `training` is true, or None (then
        differentiation decides)."""
        return self.trainable and (training is None or bool(training))

    def _rows(self, ids, training, prune=None, combiner=None, weights=None):
        """Rows of `ids` (training as `call` says); `prune` overrides
        `prune_invalid_ids` (a GroupEmbedding always drops ids < 0). With a
        `combiner`, the rows of ids [rows, L] combined ([rows, dim]), with
        per-id `weights` (or None), in one pooled table call."""
        prune = self.prune_invalid_ids if prune is None else bool(prune)
        # With training=None, training or not is decided by differentiation
        # (see _first_lookup).
        conditional = training is None and self.trainable
        if not self._may_train(training):
            return _table_lookup(self.handle, ids, weights, self.embedding_dim, False, prune,
                                 combiner)
        if not conditional and self.table_rule is None:
            raise _no_optimizer_error(self.name)
        current = self.iterations.value
        if self._looked_up_this_step():
            # Looked up again in the same step: one step, one update.
            group = self._kre_step_lookups
            lookup = _later_lookup(self, self.embedding_dim, prune, conditional, group, combiner)
            return lookup(ids, weights, self.anchor.value, group.carry, group.step)
        group = _StepLookups(current)
        lookup = _table_first_lookup(self, self.embedding_dim, prune, conditional, group,
                                     combiner)
        rows, carries, trained = lookup(ids, weights, [self.anchor.value], [current])
        self._begin_step(group, carries[0], trained[0])
        return rows

    def _looked_up_this_step(self):
        """Whether a training lookup of this step (of this trace) ran."""
        group = getattr(self, "_kre_step_lookups", None)
        return group is not None and group.marker is not None and (
            group.marker is self.iterations.value)

    def _begin_step(self, group, carry, trained):
        """After the step's first lookup (`_first_lookup`): the step counter
        moved by `trained`, and `group` (its `carry`) the one later lookups
        of this step join."""
        group.carry = carry
        self.iterations.assign(group.step + trained)
        group.marker = self.iterations.value if group.training else None
        self._kre_step_lookups = group
        self._new_step()

    def _new_step(self):
        """Tells the table's rule (while tracing) that a training step's
        first lookup ran (TableRule.new_step)."""
        if self.table_rule is not None:
            self.table_rule.new_step(getattr(self, "_kre_own_learning_rate", None))

    def _apply_gradients(self, parts, step, distinct=None):
        """One fused update of the table at `step` (in the backward of the
        step's first lookup) with the gradients of `parts`, (ids, rows'
        gradient, prune, combiner, weights) of each lookup of the step
        (combiner None: rows; else combined rows of ids [rows, L]): equal
        ids summed. `distinct`: None, or for one combined lookup the
        (inverse, distinct ids, count) of its `ffi.pooled_lookup_distinct`.
        Under a LossScaleOptimizer, unscaled and only when finite
        (`TableRule.when_finite`)."""
        self.table_rule.when_finite(parts, lambda parts: self._apply_rows(parts, step, distinct))

    def _apply_rows(self, parts, step, distinct):
        rule = self.table_rule
        step = rule.step(step)
        hyper = rule.hyper(step)
        names = (rule.rule.name, rule.rule.hparam_names, rule.slot_names())
        if distinct is not None:
            (_, grads, _, combiner, weights), = parts
            inverse, ids, count = distinct
            ffi.apply_distinct(self.handle, ids, count, inverse, grads.astype(jnp.float32), hyper,
                               step, *names, combiner=combiner, weights=weights)
            return
        for prune in sorted({p[2] for p in parts}):
            mine = [p for p in parts if p[2] == prune]
            first = mine[0]
            if first[3] is not None and all(
                    p[3] == first[3] and p[0].shape[1] == first[0].shape[1]
                    and (p[4] is None) == (first[4] is None) for p in mine):
                # Combined lookups alike: each id's share of its row's
                # gradient is made in the apply.
                weights = (None if first[4] is None
                           else jnp.concatenate([p[4] for p in mine]))
                ffi.apply_pooled(self.handle, jnp.concatenate([p[0] for p in mine]),
                                 jnp.concatenate([p[1].astype(jnp.float32) for p in mine]),
                                 hyper, step, *names, combiner=first[3], weights=weights,
                                 prune=prune)
                continue
            ids, grads = [], []
            for i, g, _, combiner, weights in mine:
                if combiner is not None:  # each id's share of its row's gradient
                    g = g[:, None, :] * pooled_scale(i, weights, combiner, prune)[..., None]
                ids.append(i.reshape(-1))
                grads.append(g.reshape(-1, self.embedding_dim).astype(jnp.float32))
            ffi.apply(self.handle, jnp.concatenate(ids), jnp.concatenate(grads), hyper, step,
                      *names, prune=prune)


