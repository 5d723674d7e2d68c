"""`EmbeddingVariable` under Keras's JAX backend (dense ids, no combiner).

Where the update happens. The table is updated in the backward pass of its
lookup, as TPU embedding does (and keras-rs's `TableConfig(optimizer=...)`
reflects): the lookup is a `jax.custom_vjp` whose backward applies the
rows' gradient to the table with its optimizer's rule, inside the
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

What follows: the table's optimizer is the one `model.compile` got (one
of `keras_rec_emb.optimizers`, as under TensorFlow), found through the
layer's `anchor` when it builds (`keras_rec_emb.backend.jax.optimizers`), or the
layer's own (`optimizer=`). Its step counter is the layer's `iterations`
(a non-trainable variable counting training steps, so in the model's state
under `jit`), which drives learning rate schedules, Adam's bias correction
and the rows' versions. A table looked up several times in one step (a
layer called on two inputs) counts the step once and gets one update with
the gradients of all its lookups, equal ids summed, as under TensorFlow
(`_StepLookups`). A constant learning rate is the optimizer's
`learning_rate` variable in that step (the layer's own optimizer's is in
the layer's state for that), so a rate assigned between steps
(`ReduceLROnPlateau`, `LearningRateScheduler`) reaches the tables
(`TableRule.learning_rate`). Clipping (`clipnorm`, `clipvalue`,
`global_clipnorm`), EMA, gradient accumulation and loss scaling are
refused with an error: the backward sees this table's gradient alone,
before the trainer's optimizer could clip or unscale it. A zero-size
trainable variable (`anchor`) is the lookup's differentiable input, so
that `jax.grad` runs the backward at all; its gradient is empty.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb._checks_core import (check_combiner_weights, check_initializer_matrix,
                                        check_int)
from keras_rec_emb.backend.jax import ffi, file_tier, register, saving
from keras_rec_emb.backend.jax.ids import integer_ids, numpy_ids
from keras_rec_emb.backend.jax.optimizers import TableRule, register_anchor
from keras_rec_emb.options import EmbeddingVariableOption, InitializerOption

COMBINERS = (None, "sum", "mean", "sqrtn")


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
    if combiner == "sum":
        return total
    denom = jnp.sum(w if combiner == "mean" else w * w, axis=-1, keepdims=True)
    if combiner == "sqrtn":
        denom = jnp.sqrt(denom)
    return jnp.where(denom > 0, total / jnp.where(denom > 0, denom, 1.0), 0.0)


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
    denom = jnp.sum(w if combiner == "mean" else w * w, axis=-1, keepdims=True)
    if combiner == "sqrtn":
        denom = jnp.sqrt(denom)
    return jnp.where(denom > 0, w / jnp.where(denom > 0, denom, 1.0), 0.0)


def _table_lookup(handle, ids, weights, dim, insert, prune, combiner):
    """Rows of `ids`, or with a `combiner` the combined rows of ids
    [rows, L] in one pooled call (no [rows, L, dim] array)."""
    if combiner is None:
        return ffi.lookup(handle, ids, dim, insert=insert, prune=prune)
    return ffi.pooled_lookup(handle, ids, dim, combiner, weights, insert=insert, prune=prune)


class _StepLookups:
    """The training lookups of one table in one training step.

    A table may be looked up several times in a step (one layer called on
    two inputs). As under TensorFlow, where the optimizer applies the
    table's gradient once per step with its ids' gradients summed, the step
    counts once (`iterations`, which drives schedules, Adam's bias
    correction and the rows' versions) and the table gets one fused update:
    the backward of each later lookup stashes its ids and gradient here,
    and that of the step's first lookup, which runs after them all (each
    later lookup takes the first one's zero-size `carry` output as an
    input, so its backward feeds the first one's), applies them together.
    `marker` is the value `iterations` holds after the first lookup: a
    call that reads it is in the same step (of the same trace). It is set
    only when the first lookup trains (its forward rule ran, under
    differentiation) and cleared when its backward has applied the step:
    run eagerly (`run_eagerly`, or a model whose compile config says
    `jit_compile=False`), the next step reads the very array this one left
    in `iterations`, which must not make it a later lookup of this step."""

    def __init__(self, step):
        self.step = step
        self.marker = None
        self.carry = None
        self.pending = []
        self.training = False


def _first_lookup(layer, dim, prune, conditional, group, combiner=None):
    """lookup(ids, weights, anchor, step) -> (rows, carry, trained), the step's first
    training lookup of `layer`'s table; its backward applies the rows'
    gradient, with those the step's later lookups stashed, to the table
    (see the top). With `conditional` (`training=None`): training or not
    is decided by differentiation. Keras's JAX trainer calls the model's
    `call` directly (`stateless_call`), so a layer of a subclassed model
    that does not pass `training` on gets None in `fit` as in `predict`.
    What tells them apart is whether the loss is differentiated with
    respect to the table: under `jax.grad` JAX runs the forward rule
    (insert; `trained` 1; the backward applies the gradient), otherwise
    the plain function (no insert; `trained` 0, so the step counter
    stays)."""
    handle = layer.handle

    @jax.custom_vjp
    def lookup(ids, weights, anchor, step):
        del anchor
        rows = _table_lookup(handle, ids, weights, dim, not conditional, prune, combiner)
        trained = jnp.zeros_like(step) if conditional else jnp.ones_like(step)
        return rows, jnp.zeros((0,), jnp.float32), trained

    def forward(ids, weights, anchor, step):
        if layer.table_rule is None:
            raise _no_optimizer_error(layer.name)
        group.training = True
        distinct = None
        if combiner is None:
            rows = _table_lookup(handle, ids, weights, dim, True, prune, combiner)
        else:
            # The distinct ids and the inverse go to the backward, which
            # then updates each distinct id without deduplicating again.
            rows, *distinct = ffi.pooled_lookup_distinct(handle, ids, dim, combiner, weights,
                                                         prune=prune)
        return ((rows, jnp.zeros((0,), jnp.float32), jnp.ones_like(step)),
                (ids, weights, anchor, step, distinct))

    def backward(saved, grads):
        ids, weights, anchor, step, distinct = saved
        parts = [(ids, grads[0], prune, combiner, weights)] + group.pending
        group.pending = []
        # pylint: disable-next=protected-access
        layer._apply_gradients(parts, step, None if len(parts) > 1 else distinct)
        group.marker, group.training = None, False  # the step is over
        return None, None, jnp.zeros_like(anchor), None

    lookup.defvjp(forward, backward)
    return lookup


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


@register(package="keras_rec_emb", name="EmbeddingVariable")
class EmbeddingVariable(keras.layers.Layer):
    """Rows of a growing hash table for integer ids of any shape, under
    Keras's JAX backend (the TensorFlow backend's `EmbeddingVariable`).

    With `training=True` a lookup inserts unseen ids and its backward
    updates the table; with `training=False` it changes nothing. With
    `training=None` (what Keras's JAX trainer gives the layers of a
    subclassed model whose `call` does not pass `training` on) the table
    trains exactly when the loss is differentiated with respect to it, as
    in `fit`, and `predict` and `evaluate` insert nothing.

    Args:
        embedding_dim: int >= 1, the row width.
        combiner: None (rows `ids.shape + (embedding_dim,)`), "sum",
            "mean" or "sqrtn": combines the last axis of the ids (`[..., L]`
            -> `[..., embedding_dim]`).
        prune_invalid_ids: bool. With a combiner, ids < 0 are padding:
            dropped from the combine (mean and sqrtn count the kept ids; a
            row with none gives zeros), never inserted or counted. False
            (default) makes every id a key, -1 too.
        optimizer: None (default: the optimizer the model is compiled
            with, one of `keras_rec_emb.optimizers`) or the table's own
            optimizer (SGD, Adagrad, Adam or Ftrl, ours or Keras's), whose
            rule is applied in the backward pass of the lookup.
        initializer: draws the `[default_value_dim, embedding_dim]` matrix
            whose row `id mod default_value_dim` a new id starts from.
        key_dtype: None (default: "int64" in JAX's 64-bit mode, as under
            TensorFlow, else "int32"), "int32" or "int64" (needs JAX's
            64-bit mode: `JAX_ENABLE_X64=1` or
            `jax.config.update("jax_enable_x64", True)`).
        default_value_dim: int >= 1, rows of that matrix (without
            `ev_option`).
        num_shards: the table's lock shards, in [1, 65536] (without
            `ev_option`).
        ev_option: None, or a `keras_rec_emb.EmbeddingVariableOption`
            (or its config, a dict, as in a saved model), as under
            TensorFlow: its initializer option, `num_shards`, admission
            filter (`CounterFilter`, `CBFFilter`), eviction
            (`GlobalStepEvict`, `L2WeightEvict`: applied when the model is
            saved unless `at_save=False` or `keras_rec_emb.save_model(...,
            evict=False)`, and by `evict()`), storage (`StorageOption("FILE",
            storage_path, storage_size)`: the rows live in files under
            `storage_path/<name>_embeddings` with a DRAM cache of about
            `storage_size` bytes; see `snapshot()`), `track_meta`,
            `save_filtered` and `record_freq` apply; its
            `default_value_dim` and `num_shards` replace the layer's.
        restore_dim_mismatch: "error" only (the other modes are
            TensorFlow-only for now).
        **kwargs: Keras's layer arguments (`name`, `trainable`, `dtype`).

    Example:

    >>> ids = keras.Input(shape=(3,), dtype="int32")
    >>> x = keras_rec_emb.layers.EmbeddingVariable(
    ...     4, combiner="mean", prune_invalid_ids=True)(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(x))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> history = model.fit(np.array([[1, 10**6, -1], [7, -1, -1]]), np.ones((2, 1)),
    ...                     verbose=0)
    >>> sorted(model.layers[1].export()["keys"].tolist())
    [1, 7, 1000000]

    With an admission filter and eviction (a key gets a row at its second
    training lookup; a row not updated for 100 steps goes when the model is
    saved):

    >>> option = keras_rec_emb.EmbeddingVariableOption(
    ...     filter_option=keras_rec_emb.CounterFilter(filter_freq=2),
    ...     evict_option=keras_rec_emb.GlobalStepEvict(steps_to_live=100))
    >>> ids = keras.Input(shape=(2,), dtype="int32")
    >>> layer = keras_rec_emb.layers.EmbeddingVariable(4, ev_option=option)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.SGD(0.1), loss="mse")
    >>> history = model.fit(np.array([[1, 2], [1, 3]]), np.ones((2, 1)), batch_size=1,
    ...                     verbose=0)
    >>> layer.export()["keys"].tolist()
    [1]
    >>> layer.evict()
    0
    """

    def __init__(self, embedding_dim, initializer="truncated_normal", key_dtype=None,
                 combiner=None, prune_invalid_ids=False, ev_option=None,
                 restore_dim_mismatch="error", optimizer=None, default_value_dim=4096,
                 num_shards=32, **kwargs):
        if ev_option is not None and not isinstance(ev_option, (dict, EmbeddingVariableOption)):
            raise TypeError(
                "`ev_option` must be None, a keras_rec_emb.EmbeddingVariableOption or its "
                f"config (a dict). Received: ev_option={type(ev_option).__name__}")
        # The TensorFlow layer's arguments, translated as a saved config is.
        ev_option = saving.layer_kwargs({"ev_option": ev_option,
                                         "restore_dim_mismatch": restore_dim_mismatch})["ev_option"]
        if ev_option is None:  # this layer's own arguments, as the option holds them
            ev_option = EmbeddingVariableOption(
                init_option=InitializerOption(default_value_dim=default_value_dim),
                num_shards=num_shards, track_meta=True)
        default_value_dim = ev_option.init_option.default_value_dim
        num_shards = ev_option.num_shards
        super().__init__(**kwargs)
        self.ev_option = ev_option
        if combiner not in COMBINERS:
            raise ValueError(f"`combiner` must be None or one of {COMBINERS[1:]}. Received: "
                             f"combiner={combiner!r}")
        if not isinstance(prune_invalid_ids, (bool, np.bool_)):
            raise TypeError("`prune_invalid_ids` must be a bool. Received: "
                            f"prune_invalid_ids={prune_invalid_ids!r}")
        if prune_invalid_ids and combiner is None:
            raise ValueError(
                "`prune_invalid_ids=True` drops ids < 0 from a combine and needs a "
                "`combiner` (\"sum\", \"mean\" or \"sqrtn\"). Received: combiner=None")
        self.combiner = combiner
        self.prune_invalid_ids = bool(prune_invalid_ids)
        if (isinstance(embedding_dim, bool) or not isinstance(embedding_dim, (int, np.integer))
                or embedding_dim <= 0):
            raise ValueError("`embedding_dim` must be a positive integer. Received: "
                             f"embedding_dim={embedding_dim!r}")
        if key_dtype is None:  # ids as wide as JAX holds them: none wraps
            key_dtype = ffi.int_dtype().name
        if key_dtype not in ffi.KEY_DTYPES:
            raise ValueError(f"`key_dtype` must be one of {ffi.KEY_DTYPES}. Received: "
                             f"key_dtype={key_dtype!r}")
        if int(default_value_dim) < 1:
            raise ValueError("`default_value_dim` must be >= 1. Received: "
                             f"default_value_dim={default_value_dim!r}")
        self.embedding_dim = int(embedding_dim)
        self.optimizer = optimizer
        # The rule that trains the table: its own optimizer's, else that of
        # the optimizer that builds for `anchor` (`attach_optimizer`).
        self.table_rule = None if optimizer is None else TableRule(
            optimizer, f"EmbeddingVariable '{self.name}'")
        self._kre_slot_specs = []
        self.initializer = keras.initializers.get(initializer)
        self.key_dtype = key_dtype
        self.default_value_dim = int(default_value_dim)
        self.num_shards = int(num_shards)
        self.handle = None
        self.default_values = None

    def build(self, input_shape=None):
        # The option's initializer comes before the layer's, as under TensorFlow.
        initializer = self.ev_option.init_option.initializer or self.initializer
        check_initializer_matrix(self.name, self.default_value_dim, self.embedding_dim)
        with jax.ensure_compile_time_eval():
            self.default_values = np.asarray(initializer(
                shape=(self.default_value_dim, self.embedding_dim), dtype="float32"))
        table = self.ev_option.table_kwargs()
        filter_freq = table.get("filter_freq", 0)
        self.handle = file_tier.create(
            self, self.default_values, self.ev_option.storage_option,
            key_dtype=self.key_dtype, num_shards=self.num_shards,
            track_meta=table["track_meta"], filter_freq=filter_freq,
            no_permission_value=table["no_permission_value"], bloom=table.get("bloom"),
            # DeepRec's frequency: an admitted key's stays at the threshold
            # unless `record_freq` (keras_rec_emb/backend/tensorflow/variables.py's _freq_cap).
            freq_cap=0 if table["record_freq"] or filter_freq < 1 else filter_freq)
        self.anchor = self.add_weight(shape=(0,), initializer="zeros", name="anchor")
        register_anchor(self.anchor, self)
        if self.table_rule is not None:
            self._add_slots(self.table_rule)
        self.iterations = self.add_weight(shape=(), initializer="zeros", dtype="int32",
                                          trainable=False, name="iterations")
        rate = None if self.optimizer is None else self.optimizer.learning_rate
        if isinstance(rate, keras.Variable):
            # The own optimizer's rate variable joins the layer's state, so
            # that a jitted step reads it from the step's state (as the
            # compiled optimizer's rate is): a rate assigned later
            # (`layer.optimizer.learning_rate = x`, `.assign(x)`) reaches
            # the table at the next step (TableRule.new_step). The compiled
            # optimizer's comes through its `scale_loss`.
            self._kre_own_learning_rate = rate
        self.built = True

    def _add_slots(self, rule):
        for name, init, width in rule.slots:
            width = self.embedding_dim if width is None else width
            ffi.add_slot(self.handle, name, width, init)
            if name not in {n for n, _ in self._kre_slot_specs}:
                self._kre_slot_specs.append((name, width))

    def attach_optimizer(self, optimizer):
        """Called by a keras_rec_emb optimizer's `build` when it builds for
        this layer's `anchor`: it trains the table from the next traced
        training step on, unless the layer has its own optimizer."""
        if self.optimizer is not None:
            return
        if self.handle is None:
            self.build()
        self.table_rule = TableRule(optimizer, f"EmbeddingVariable '{self.name}'")
        self._add_slots(self.table_rule)

    @property
    def ids_input_dtype(self):
        """`key_dtype`: the dtype of the `keras.Input` a `keras.Sequential`
        without one makes for this layer (Keras would make it float32)."""
        return self.key_dtype

    def __call__(self, ids, *args, **kwargs):
        # NumPy ids are checked before Keras makes JAX arrays of them (which
        # in JAX's 32-bit mode narrows int64 ids unchecked).
        return super().__call__(numpy_ids(ids, f"EmbeddingVariable '{self.name}'",
                                          self.key_dtype), *args, **kwargs)

    def call(self, ids, weights=None, training=None):
        """Rows of `ids`, combined over their last axis with a combiner.

        Args:
            ids: integer ids of any shape (`[..., L]` with a combiner).
            weights: None, or per-id weights of the ids' shape (needs a
                combiner): the combine is `sum(w * row)`, divided by
                `sum(w)` for "mean" and by `sqrt(sum(w**2))` for "sqrtn"
                (TensorFlow's `embedding_lookup_sparse` rule); a row whose
                denominator is 0 gives zeros. With "mean" and "sqrtn" an id
                whose weight is <= 0 is dropped: never inserted, counted
                or updated (TensorFlow's and DeepRec's rule), which needs
                `prune_invalid_ids=True`; "sum" keeps it. Padding ids (< 0,
                with `prune_invalid_ids`) are dropped whatever their
                weight. The table's gradient is each id's share,
                `weight / denominator` times the output's gradient, summed
                over equal ids.
            training: bool or None (see the class).

        Example:

        >>> layer = keras_rec_emb.layers.EmbeddingVariable(
        ...     2, combiner="mean", prune_invalid_ids=True,
        ...     initializer=keras.initializers.Ones())
        >>> out = layer(np.array([[1, 2, -1]]), weights=np.array([[1.0, 3.0, 5.0]]))
        >>> np.asarray(out).tolist()
        [[1.0, 1.0]]
        """
        ids = integer_ids(ids, f"EmbeddingVariable '{self.name}'", self.key_dtype)
        if self.combiner is not None and ids.ndim < 1:
            raise ValueError(f"With combiner={self.combiner!r} the ids need a last axis to "
                             f"combine ([..., L]). Received: ids of shape {tuple(ids.shape)}")
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
        weights = keras.ops.convert_to_tensor(weights, dtype="float32")
        if tuple(weights.shape) != tuple(ids.shape):
            raise ValueError(
                f"EmbeddingVariable '{self.name}': `weights` must have the ids' shape "
                f"{tuple(ids.shape)} (one weight per id). Received: weights of shape "
                f"{tuple(weights.shape)}")
        return weights

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
        group = getattr(self, "_kre_step_lookups", None)
        if group is not None and group.marker is not None and group.marker is current:
            # Looked up again in the same step: one step, one update.
            lookup = _later_lookup(self, self.embedding_dim, prune, conditional, group, combiner)
            return lookup(ids, weights, self.anchor.value, group.carry, group.step)
        group = _StepLookups(current)
        lookup = _first_lookup(self, self.embedding_dim, prune, conditional, group, combiner)
        rows, group.carry, trained = lookup(ids, weights, self.anchor.value, current)
        self.iterations.assign(current + trained)
        group.marker = self.iterations.value if group.training else None
        self._kre_step_lookups = group
        if self.table_rule is not None:
            self.table_rule.new_step(getattr(self, "_kre_own_learning_rate", None))
        return rows

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

    def compute_output_shape(self, input_shape):
        if self.combiner is not None:
            return (*input_shape[:-1], self.embedding_dim)
        return (*input_shape, self.embedding_dim)

    def _require_built(self, what):
        if self.handle is None:
            raise ValueError(f"EmbeddingVariable '{self.name}' is not built yet; call it on "
                             f"ids (or build it) before {what}.")

    def export(self):
        """All ids as NumPy arrays, in the TensorFlow backend's format
        (DeepRec's): `keys` [N], `values` [N, dim], `freqs` [N], `versions`
        [N] and `slots` {slot name: [N, width]} of admitted ids;
        `keys_filtered`, `freqs_filtered`, `versions_filtered` of ids
        counted by a filter but not admitted; `default_values` (the
        EV-initializer matrix) and `bloom` (a Bloom filter's counters)."""
        self._require_built("export()")
        return ffi.export_parts(self.handle, self.key_dtype, self.embedding_dim,
                                self._kre_slot_specs)

    def evict(self, step=None):
        """Applies the eviction option (`GlobalStepEvict` / `L2WeightEvict`)
        now, as saving the model does; returns how many ids were evicted
        (0 without one).

        Args:
            step: int >= 0 or None. The current step for `steps_to_live`;
                None uses the last step that updated this table (steps are
                the layer's `iterations`).
        """
        self._require_built("evict()")
        step = check_int("step", step, 0, allow_none=True)
        rule = self.ev_option.evict_option
        if rule is None:
            return 0
        return ffi.evict(self.handle, -1 if step is None else step,
                         getattr(rule, "steps_to_live", -1),
                         getattr(rule, "l2_weight_threshold", -1.0))

    def stats(self):
        """The table's statistics, a dict of ints: `size` (admitted ids),
        `filtered` (counted, not admitted), `memory_bytes`, `latest_step`,
        `storage` ("DRAM" or "FILE"), the row store's `rows`,
        `cached_rows`, `cache_memory_bytes`, `disk_bytes`, `cache_hits`,
        `cache_misses`, `cache_hit_rate` (a float, 1.0 before any access),
        `file_reads`, `file_writes`, and the counters `lookups`, `hits`,
        `admitted_total`, `erased_total`, `change_epoch`, `erased_log`."""
        self._require_built("stats()")
        return file_tier.stats(self)

    @property
    def storage_dir(self):
        """The file tier's folder of the table (`storage_path/<name>_embeddings`,
        or a copy's folder beside a live table holding that one), or None
        (DRAM)."""
        return file_tier.storage_dir(self)

    def snapshot(self):
        """File tier (`StorageOption("FILE", ...)`): writes a crash-safe
        snapshot of the table's files under `storage_dir` (segments flushed,
        fsynced and hard-linked, an index written, a manifest renamed; no
        rows go through Python); returns the snapshot's number. A snapshot
        killed half-way leaves the previous one intact.

        Example:

        >>> import tempfile
        >>> option = keras_rec_emb.EmbeddingVariableOption(
        ...     storage_option=keras_rec_emb.StorageOption(
        ...         "FILE", storage_path=tempfile.mkdtemp(), storage_size=1 << 20))
        >>> layer = keras_rec_emb.layers.EmbeddingVariable(
        ...     4, ev_option=option, optimizer=keras_rec_emb.optimizers.SGD(0.1))
        >>> _ = layer(np.array([1, 2, 3]), training=True)
        >>> layer.snapshot()
        1
        >>> layer.restore_snapshot()
        3
        """
        self._require_built("snapshot()")
        return file_tier.snapshot(self)

    def restore_snapshot(self, path=None):
        """File tier: replaces the table's contents with its latest snapshot
        and returns the number of ids. A missing, corrupt or truncated
        snapshot raises a ValueError naming the file and leaves the table
        unchanged.

        Args:
            path: str or None. The folder of the snapshot; None is the
                table's folder under its `storage_path` (also for a copy
                working in a folder of its own).
        """
        self._require_built("restore_snapshot()")
        return file_tier.restore_snapshot(self, path)

    def table_size(self):
        """Number of distinct ids admitted to the table (after every table
        call already dispatched)."""
        self._require_built("table_size()")
        return int(ffi.size(self.handle)[0])

    def size(self):
        """The number of ids in the table (`table_size()`)."""
        return self.table_size()

    def import_(self, data):
        """Replaces the table's contents with `data`, shaped like the
        TensorFlow backend's `export()`: `keys` [N] and `values` [N, dim]
        required; `freqs`, `versions`, `slots` ({slot name: [N, width]}),
        `keys_filtered`, `freqs_filtered`, `versions_filtered`,
        `default_values` and `bloom` optional. A failed import leaves the
        table as it was."""
        self._require_built("import_()")
        if not isinstance(data, dict) or "keys" not in data or "values" not in data:
            raise ValueError(
                "`data` must be a dict with at least 'keys' [N] and 'values' "
                f"[N, {self.embedding_dim}] (as export() returns). Received: "
                f"{type(data).__name__}"
                + (f" with keys {sorted(data)}" if isinstance(data, dict) else ""))
        ffi.import_parts(self.handle, self.key_dtype, self.embedding_dim, data)
        slots = data.get("slots")
        known = {name for name, _ in self._kre_slot_specs}
        if isinstance(slots, dict):
            added = [(str(n), int(np.shape(v)[1])) for n, v in slots.items()]
        else:
            added = [(n.decode() if isinstance(n, bytes) else str(n), int(w))
                     for n, w in zip(data.get("slot_names", ()), data.get("slot_widths", ()))]
        self._kre_slot_specs += [(n, w) for n, w in added if n not in known]

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
