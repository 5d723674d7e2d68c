"""`GroupEmbedding` and `FeatureSpec` under Keras's JAX backend.

The TensorFlow layer's semantics and config (keras_rec_emb/layers/
group_embedding.py), on JAX `EmbeddingVariable` tables. One lookup per
table and step: the ids `[batch, L]` of the features that read a table
with one combiner are padded to one L with -1 (pruned by the lookup) and
stacked, and one pooled table call looks them up and combines them
(`ffi.pooled_lookup`; features of other combiners or weighting are other
calls of the same step, whose gradients join the same update). Unweighted
ids with L = 1 take a plain lookup instead (the combine of one id is its
row, and a pooled call costs more). So a
table shared by several features gets one sparse update per step, with
the gradient of each distinct id summed over its features, as
TensorFlow's fused op gives it: Adagrad's and Adam's slots are updated
once per step, not once per feature.
"""

import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb.backend.jax import ffi, register
from keras_rec_emb.backend.jax.ids import integer_ids, numpy_ids
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

COMBINERS = ("sum", "mean", "sqrtn")
_OUTPUT_MODES = ("dict", "concat")


def _unsupported(argument, value, allowed):
    return ValueError(f"Under the JAX backend GroupEmbedding supports {argument}={allowed} "
                      f"only (so far). Received: {argument}={value!r}")


def _table_from_spec(spec, what):
    """An `EmbeddingVariable` from a spec dict: a serialized layer or the
    layer's arguments (`embedding_dim`, ...)."""
    if "class_name" in spec:
        layer = keras.saving.deserialize_keras_object(spec)
    elif "embedding_dim" in spec:
        layer = EmbeddingVariable(**spec)
    elif "input_dim" in spec and "output_dim" in spec:
        raise _unsupported(what, spec, "an EmbeddingVariable (no keras.layers.Embedding)")
    else:
        raise ValueError(
            f"`{what}` as a dict must be a serialized layer or hold EmbeddingVariable "
            f"arguments (`embedding_dim`, ...). Received: {what}={spec!r}")
    return _check_table_layer(layer, what)


def _check_table_layer(layer, what):
    if isinstance(layer, EmbeddingVariable):
        return layer  # the group applies the feature's own combiner
    if isinstance(layer, keras.layers.Embedding):
        raise _unsupported(what, layer, "an EmbeddingVariable (no keras.layers.Embedding)")
    raise TypeError(f"`{what}` must be an EmbeddingVariable, a spec dict or a table index. "
                    f"Received: {what}={layer!r}")


@register(package="keras_rec_emb")
class FeatureSpec:
    """How `GroupEmbedding` embeds one feature (under Keras's JAX backend).

    Args:
        table: an `EmbeddingVariable`, a dict to create one (its arguments,
            e.g. `{"embedding_dim": 8}`, or a serialized layer), or an int
            index into `GroupEmbedding`'s `tables`. One table may serve
            several features.
        combiner: `"sum"`, `"mean"` or `"sqrtn"` over the feature's ids
            (ids < 0 are padding: dropped). Defaults to `"sum"`.
        weight_feature: `None` or the name of the input holding per-id
            weights (same shape as the ids, float). The combine is
            `sum(w * row)`, divided by `sum(w)` for `"mean"` and by
            `sqrt(sum(w**2))` for `"sqrtn"`. With `"mean"` or `"sqrtn"`, ids
            whose weight is <= 0 are dropped (never inserted, counted or
            updated: TF's and DeepRec's rule); `"sum"` keeps them. Defaults
            to `None`.
        sequence: `False` only under JAX (so far).
        max_norm: `None` only under JAX (so far).
        default_id: `None` only under JAX (so far): a row with no id gives
            zeros.

    Example:

    >>> spec = keras_rec_emb.layers.FeatureSpec({"embedding_dim": 4}, combiner="mean")
    >>> spec.combiner
    'mean'
    """

    def __init__(self, table, combiner="sum", weight_feature=None, sequence=False,
                 max_norm=None, default_id=None):
        if combiner not in COMBINERS:
            raise ValueError(f"`combiner` must be one of {COMBINERS}. Received: "
                             f"combiner={combiner!r}")
        if weight_feature is not None and not isinstance(weight_feature, str):
            raise TypeError("`weight_feature` must be None or an input name. Received: "
                            f"weight_feature={weight_feature!r}")
        for argument, value, allowed in (("sequence", sequence, False),
                                         ("max_norm", max_norm, None),
                                         ("default_id", default_id, None)):
            if value is not allowed and value != allowed:
                raise _unsupported(argument, value, allowed)
        if isinstance(table, keras.layers.Embedding):
            raise _unsupported("table", table, "an EmbeddingVariable (no keras.layers.Embedding)")
        if isinstance(table, bool) or not isinstance(
                table, (int, np.integer, dict, EmbeddingVariable)):
            raise TypeError("`table` must be an EmbeddingVariable, a spec dict or a table "
                            f"index. Received: table={table!r}")
        self.table = table
        self.combiner = combiner
        self.weight_feature = weight_feature
        self.sequence = False
        self.max_norm = None
        self.default_id = None

    def get_config(self):
        table = self.table
        if isinstance(table, keras.layers.Layer):
            table = keras.saving.serialize_keras_object(table)
        return {"table": table, "combiner": self.combiner,
                "weight_feature": self.weight_feature, "sequence": self.sequence,
                "max_norm": self.max_norm, "default_id": self.default_id}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return (f"FeatureSpec(table={self.table!r}, combiner={self.combiner!r}, "
                f"weight_feature={self.weight_feature!r})")


@register(package="keras_rec_emb")
class GroupEmbedding(keras.layers.Layer):
    """Embeds many features, one lookup per table (Keras's JAX backend).

    Every feature reads its `EmbeddingVariable` and combines each
    example's ids (ids < 0 are padding: dropped; a row with none gives
    zeros). All features of one table are looked up together, so a table
    shared by several features is updated once per step with the summed
    gradient of each distinct id (TensorFlow's numbers). In training
    (`model.fit`) unseen ids are inserted. Train with an optimizer from
    `keras_rec_emb.optimizers` (or the tables' own `optimizer=`).

    Args:
        features: dict from feature (input) name to `FeatureSpec` (or its
            config dict). Several features may share one table.
        output_mode: `"dict"` (a dict of `[batch, dim]` per feature) or
            `"concat"` (one `[batch, sum(dims)]` tensor, features in
            order). Defaults to `"dict"`.
        tables: `None` or a list of `EmbeddingVariable`s (or their
            serialized configs) that `FeatureSpec.table` indices refer to.
            Tables given directly in the specs are appended.
        name: str or `None`.
        **kwargs: other `keras.layers.Layer` arguments.

    Input shape:
        A dict from feature name (and weight feature name) to integer ids
        (float weights) `[batch]` or `[batch, L]`, ids padded with -1 (JAX
        has no ragged tensors); or, without weight features, one integer tensor
        of stacked ids, features in the order of `features`: `[batch, F]`
        (column j feeds feature j) or `[batch, F, L]` (`ids[:, j, :]` feed
        feature j, padded with -1).

    Output shape:
        dict of `[batch, dim]`, or `[batch, sum(dims)]` with
        `output_mode="concat"`.

    Example:

    >>> user = keras_rec_emb.layers.EmbeddingVariable(4, name="user_table")
    >>> group = keras_rec_emb.layers.GroupEmbedding({
    ...     "user": keras_rec_emb.layers.FeatureSpec(user),
    ...     "history": keras_rec_emb.layers.FeatureSpec(
    ...         {"embedding_dim": 8}, combiner="mean"),
    ... }, output_mode="concat")
    >>> inputs = {"user": keras.Input((), dtype="int32", name="user"),
    ...           "history": keras.Input((5,), dtype="int32", name="history")}
    >>> out = keras.layers.Dense(1, activation="sigmoid")(group(inputs))
    >>> model = keras.Model(inputs, out)
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1),
    ...               loss="binary_crossentropy")
    >>> x = {"user": np.arange(32), "history": np.random.randint(-1, 100, (32, 5))}
    >>> history = model.fit(x, np.ones((32, 1)), epochs=1, verbose=0)
    >>> model.output_shape
    (None, 1)
    """

    def __init__(self, features, output_mode="dict", tables=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if not isinstance(features, dict) or not features:
            raise ValueError("`features` must be a non-empty dict from feature name to "
                             f"FeatureSpec. Received: features={features!r}")
        if output_mode not in _OUTPUT_MODES:
            raise ValueError(f"`output_mode` must be one of {_OUTPUT_MODES}. Received: "
                             f"output_mode={output_mode!r}")
        if tables is not None and not isinstance(tables, (list, tuple)):
            raise TypeError(f"`tables` must be None or a list. Received: tables={tables!r}")
        self._tables = []
        for i, t in enumerate(tables or []):
            what = f"tables[{i}]"
            self._tables.append(_table_from_spec(t, what) if isinstance(t, dict)
                                else _check_table_layer(t, what))
        self._features = {}
        by_id = {id(t): i for i, t in enumerate(self._tables)}
        for fname, spec in features.items():
            if not isinstance(fname, str):
                raise TypeError(f"Feature names must be strings. Received: {fname!r}")
            if isinstance(spec, dict) and ("combiner" in spec or "table" in spec):
                spec = FeatureSpec.from_config(spec)
            if not isinstance(spec, FeatureSpec):
                raise TypeError(f"`features[{fname!r}]` must be a FeatureSpec. Received: "
                                f"{spec!r}")
            table = spec.table
            if isinstance(table, (int, np.integer)):
                if not 0 <= table < len(self._tables):
                    raise ValueError(f"`features[{fname!r}].table` index {table} is out of "
                                     f"range for {len(self._tables)} tables")
                index = int(table)
            else:
                if isinstance(table, dict):
                    table = _table_from_spec(table, f"features[{fname!r}].table")
                if id(table) not in by_id:
                    by_id[id(table)] = len(self._tables)
                    self._tables.append(table)
                index = by_id[id(table)]
            self._features[fname] = FeatureSpec(index, spec.combiner, spec.weight_feature)
        self.output_mode = output_mode
        # Tracked as sub-layers (as under TensorFlow): their weights train
        # and save with this layer.
        self.tables = list(self._tables)

    @property
    def features(self):
        return dict(self._features)

    @property
    def ids_input_dtype(self):
        """The dtype of the `keras.Input` a `keras.Sequential` without one
        makes for this layer (the stacked form's ids; Keras would make it
        float32): int64 as under TensorFlow, int32 in JAX's 32-bit mode."""
        return ffi.int_dtype().name

    def build(self, input_shape=None):
        if self.built:
            return
        for t in self.tables:
            if not t.built:
                t.build(None)
        self.built = True

    # -- forward ---------------------------------------------------------------
    def _feature_ids(self, inputs):
        """(ids, weights) per feature, in the order of `features`: ids
        `[batch, L]`, weights `[batch, L]` float32 or None."""
        if isinstance(inputs, dict):
            return self._dict_ids(inputs)
        ids = self._stacked_ids(inputs)
        return [ids[:, j, :] for j in range(ids.shape[1])], [None] * ids.shape[1]

    def _dict_ids(self, inputs):
        """`_feature_ids` of a dict of inputs."""
        names = list(self._features)
        specs = list(self._features.values())
        missing = [n for n in names if n not in inputs]
        missing += [s.weight_feature for s in specs
                    if s.weight_feature is not None and s.weight_feature not in inputs]
        if missing:
            raise ValueError(f"GroupEmbedding '{self.name}' is missing inputs {missing}. "
                             f"Received keys: {sorted(inputs)}")
        out, weights = [], []
        for j, (n, s) in enumerate(zip(names, specs)):
            # TensorFlow's checks and names (its fused lookup's `sp_ids[j]`).
            ids = integer_ids(inputs[n], f"`sp_ids[{j}]`", self.tables[s.table].key_dtype,
                              lower=False, via=np.int64)
            if ids.ndim not in (1, 2):
                raise ValueError(
                    f"GroupEmbedding '{self.name}': the ids of feature {n!r} must be "
                    f"[batch] or [batch, L] (padded with -1). Received: shape "
                    f"{tuple(ids.shape)}")
            out.append(ids[:, None] if ids.ndim == 1 else ids)
            w = None
            if s.weight_feature is not None:
                w = keras.ops.convert_to_tensor(inputs[s.weight_feature], dtype="float32")
                if tuple(w.shape) != tuple(ids.shape):
                    raise ValueError(
                        f"GroupEmbedding '{self.name}': the weights "
                        f"{s.weight_feature!r} of feature {n!r} must have its ids' shape "
                        f"{tuple(ids.shape)}. Received: shape {tuple(w.shape)}")
                w = w[:, None] if w.ndim == 1 else w
            weights.append(w)
        return out, weights

    def _stacked_ids(self, inputs):
        """One stacked ids tensor as [batch, F, L]."""
        names = list(self._features)
        specs = list(self._features.values())
        if any(s.weight_feature is not None for s in specs):
            raise ValueError(
                f"GroupEmbedding '{self.name}' has weight features "
                f"{[s.weight_feature for s in specs if s.weight_feature is not None]}: pass a "
                "dict of inputs (ids and weights by name), not one stacked ids tensor")
        if isinstance(inputs, (list, tuple)):
            raise _unsupported("inputs", "(ids, table_ids)",
                               "a dict of ids or one stacked ids tensor")
        # TensorFlow's checks and names: the ids as int64, then as an int32
        # key once for all features when every table has int32 keys.
        key_dtype = ("int32" if {t.key_dtype for t in self.tables} == {"int32"}
                     else ffi.int_dtype().name)
        ids = integer_ids(inputs, f"GroupEmbedding '{self.name}' ids", key_dtype, lower=False,
                          via=np.int64, via_what=f"GroupEmbedding '{self.name}'")
        f = len(names)
        if ids.ndim not in (2, 3) or ids.shape[1] != f:
            raise ValueError(
                f"GroupEmbedding '{self.name}' called on one tensor expects ids [batch, {f}] "
                f"(column j feeds feature j) or [batch, {f}, length] (ids[:, j, :] feed "
                f"feature j, padded with -1), features in the order of `features`. "
                f"Received: ids of shape {tuple(ids.shape)}")
        return ids[:, :, None] if ids.ndim == 2 else ids

    def _inference_lookup(self, inputs):
        """The lookup of every feature in one table call (no table trains
        in this call, so none inserts and no gradient is needed): the
        features' ids stacked [batch, F, L], their rows concatenated."""
        specs = list(self._features.values())
        key_dtype = self.tables[0].key_dtype
        if isinstance(inputs, dict):
            feature_ids, feature_weights = self._dict_ids(inputs)
            length = max(int(i.shape[1]) for i in feature_ids)
            pad = [((0, 0), (0, length - int(i.shape[1]))) for i in feature_ids]
            ids = jnp.stack([jnp.pad(jnp.asarray(i).astype(key_dtype), p, constant_values=-1)
                             for i, p in zip(feature_ids, pad)], axis=1)
            weights = None
            if any(w is not None for w in feature_weights):
                weights = jnp.stack([
                    jnp.pad(jnp.ones(i.shape, jnp.float32) if w is None
                            else jnp.asarray(w).astype(jnp.float32), p)
                    for i, w, p in zip(feature_ids, feature_weights, pad)], axis=1)
        else:
            ids, weights = jnp.asarray(self._stacked_ids(inputs)).astype(key_dtype), None
        tables = [self.tables[s.table] for s in specs]
        rows = ffi.group_pooled_lookup([t.handle for t in tables], ids,
                                       [t.embedding_dim for t in tables],
                                       [s.combiner for s in specs], weights).astype(
                                           self.compute_dtype)
        if self.output_mode == "concat":
            return rows
        out, start = {}, 0
        for n, t in zip(self._features, tables):
            out[n] = rows[:, start:start + t.embedding_dim]
            start += t.embedding_dim
        return out

    def __call__(self, inputs, *args, **kwargs):
        # NumPy ids are checked before Keras makes JAX arrays of them (which
        # in JAX's 32-bit mode narrows int64 ids unchecked).
        if isinstance(inputs, dict):
            inputs = dict(inputs)
            for j, (n, s) in enumerate(self._features.items()):
                if n in inputs:
                    inputs[n] = numpy_ids(inputs[n], f"`sp_ids[{j}]`",
                                          self.tables[s.table].key_dtype, lower=False)
        elif {t.key_dtype for t in self.tables} == {"int32"}:
            inputs = numpy_ids(inputs, f"GroupEmbedding '{self.name}' ids", "int32", lower=False)
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs, training=None):
        # Only a call no table may train in takes the one-call inference
        # lookup.
        # pylint: disable-next=protected-access
        if (not any(t._may_train(training) for t in self.tables)
                and len({t.key_dtype for t in self.tables}) == 1):
            return self._inference_lookup(inputs)
        feature_ids, feature_weights = self._feature_ids(inputs)
        specs = list(self._features.values())
        outs = [None] * len(specs)
        for t, table in enumerate(self.tables):
            mine = [j for j, s in enumerate(specs) if s.table == t]
            if not mine:
                continue
            # One pooled lookup of the table for its features of one
            # combiner (and weighted or not): their ids [batch, L] padded
            # to one L with -1 (pruned) and stacked, combined in the table
            # call. A table's lookups of one step get one sparse update.
            kinds = {}
            for j in mine:
                kinds.setdefault((specs[j].combiner, feature_weights[j] is not None), []).append(j)
            for (combiner, weighted), js in kinds.items():
                ids, weights = [], []
                length = max(int(feature_ids[j].shape[1]) for j in js)
                for j in js:
                    i = integer_ids(feature_ids[j], f"`sp_ids[{j}]`", table.key_dtype,
                                    lower=False)
                    w = feature_weights[j]
                    if w is not None and combiner != "sum":
                        # Ids of weight <= 0 are dropped: padding for the lookup.
                        i = jnp.where(w > 0, i, jnp.asarray(-1, i.dtype))
                    pad = ((0, 0), (0, length - i.shape[1]))
                    ids.append(jnp.pad(i, pad, constant_values=-1))
                    if weighted:
                        weights.append(jnp.pad(w.astype(jnp.float32), pad))
                ids_all = jnp.concatenate(ids) if len(ids) > 1 else ids[0]
                if length == 1 and not weighted:
                    # One id per row: "sum", "mean" and "sqrtn" of it are its
                    # row (zeros for padding), and its gradient is the
                    # row's: a plain lookup, cheaper than a pooled one.
                    # pylint: disable-next=protected-access
                    rows = table._rows(ids_all[:, 0], training, prune=True)
                else:
                    # pylint: disable-next=protected-access
                    rows = table._rows(ids_all, training, prune=True, combiner=combiner,
                                       weights=jnp.concatenate(weights) if weighted else None)
                start = 0
                for j, i in zip(js, ids):
                    outs[j] = rows[start:start + i.shape[0]]
                    start += i.shape[0]
        outs = [o.astype(self.compute_dtype) for o in outs]
        if self.output_mode == "concat":
            return jnp.concatenate(outs, axis=-1)
        return dict(zip(self._features, outs))

    def compute_output_spec(self, inputs, training=None):
        if isinstance(inputs, dict):
            batch = inputs[next(iter(self._features))].shape[0]
        else:
            batch = inputs.shape[0]
        dims = [self.tables[s.table].embedding_dim for s in self._features.values()]
        if self.output_mode == "concat":
            return keras.KerasTensor((batch, sum(dims)), dtype=self.compute_dtype)
        return {n: keras.KerasTensor((batch, d), dtype=self.compute_dtype)
                for n, d in zip(self._features, dims)}

    # -- saving: the TensorFlow layer's config ----------------------------------
    def get_config(self):
        config = super().get_config()
        config.update({
            "features": {n: s.get_config() for n, s in self._features.items()},
            "output_mode": self.output_mode,
            "tables": [keras.saving.serialize_keras_object(t) for t in self.tables],
        })
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["tables"] = [keras.saving.deserialize_keras_object(t)
                            for t in config.get("tables") or []]
        config["features"] = {n: FeatureSpec.from_config(s)
                              for n, s in config["features"].items()}
        return cls(**config)
