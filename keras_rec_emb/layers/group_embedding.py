"""GroupEmbedding: many embedding features looked up by one fused op."""

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context
from keras_rec_emb.backend.tensorflow import variables
from keras_rec_emb.backend.tensorflow.checks import assert_ids_in_range, check_float, check_int, integer_ids
from keras_rec_emb._checks_core import non_integer_ids_error
from keras_rec_emb.backend.tensorflow.ids import FlatIds
from keras_rec_emb.layers.configs import FeatureConfig
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.ops import embedding_ops

_OUTPUT_MODES = ("dict", "concat")


def _table_from_spec(spec, what):
    """A table layer from a spec dict: a serialized Keras layer, the
    arguments of `EmbeddingVariable` (`embedding_dim`, ...) or those of
    `keras.layers.Embedding` (`input_dim`, `output_dim`, ...)."""
    if "class_name" in spec:
        layer = keras.saving.deserialize_keras_object(spec)
    elif "embedding_dim" in spec:
        layer = EmbeddingVariable(**spec)
    elif "input_dim" in spec and "output_dim" in spec:
        layer = keras.layers.Embedding(**spec)
    else:
        raise ValueError(
            f"`{what}` as a dict must be a serialized layer or hold "
            "EmbeddingVariable arguments (`embedding_dim`, ...) or "
            "keras.layers.Embedding arguments (`input_dim`, `output_dim`, ...). "
            f"Received: {what}={spec!r}"
        )
    return _check_table_layer(layer, what)


def _check_table_layer(layer, what):
    if isinstance(layer, EmbeddingVariable):
        if layer.combiner is not None:
            pass  # the group applies the feature's own combiner
        return layer
    if isinstance(layer, keras.layers.Embedding):
        return layer
    raise TypeError(
        f"`{what}` must be an EmbeddingVariable, a keras.layers.Embedding, a "
        f"spec dict or a table index. Received: {what}={layer!r}"
    )


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class FeatureSpec:
    """How `GroupEmbedding` embeds one feature.

    Args:
        table: the embedding parameter: an `EmbeddingVariable` layer, a
            `keras.layers.Embedding`, a dict to create one (arguments of
            `EmbeddingVariable`, e.g. `{"embedding_dim": 8}`, or of
            `keras.layers.Embedding`, e.g. `{"input_dim": 100,
            "output_dim": 8}`), or an int index into `GroupEmbedding`'s
            `tables`. One table object may serve several features.
        combiner: `"sum"`, `"mean"` or `"sqrtn"`. Defaults to `"sum"`.
        weight_feature: `None` or the name of the input holding per-id
            weights (same shape as the ids). With `"mean"` or `"sqrtn"`, ids
            whose weight is <= 0 are dropped (TF's and DeepRec's rule).
            Defaults to `None`.
        sequence: bool. Return `[batch, T, dim]` rows instead of combining.
            Defaults to `False`.
        max_norm: `None` or float. Clip each row to this L2 norm before
            combining. Defaults to `None`.
        default_id: `None` or int. Id read by rows with no valid id (ids
            < 0 are padding and dropped); `None` gives zeros. Defaults to
            `None`.

    Example:

    >>> spec = keras_rec_emb.layers.FeatureSpec({"embedding_dim": 4}, combiner="mean")
    >>> spec.combiner
    'mean'
    """

    def __init__(self, table: keras.layers.Layer | dict | str, combiner: str = "sum",
                 weight_feature: str | None = None, sequence: bool = False,
                 max_norm: float | None = None, default_id: int | None = None):
        if combiner not in embedding_ops.COMBINERS:
            raise ValueError(
                f"`combiner` must be one of {embedding_ops.COMBINERS}. "
                f"Received: combiner={combiner!r}"
            )
        if weight_feature is not None and not isinstance(weight_feature, str):
            raise TypeError(
                "`weight_feature` must be None or an input name. Received: "
                f"weight_feature={weight_feature!r}"
            )
        if not isinstance(sequence, (bool, np.bool_)):
            raise TypeError(f"`sequence` must be a bool. Received: sequence={sequence!r}")
        max_norm = check_float("max_norm", max_norm, 0, min_open=True, allow_none=True)
        default_id = check_int("default_id", default_id, 0, allow_none=True)
        if isinstance(table, bool) or not isinstance(
                table, (int, np.integer, dict, EmbeddingVariable, keras.layers.Embedding)):
            raise TypeError(
                "`table` must be an EmbeddingVariable, a keras.layers.Embedding, a "
                f"spec dict or a table index. Received: table={table!r}"
            )
        self.table = table
        self.combiner = combiner
        self.weight_feature = weight_feature
        self.sequence = bool(sequence)
        self.max_norm = None if max_norm is None else float(max_norm)
        self.default_id = None if default_id is None else int(default_id)

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
                f"weight_feature={self.weight_feature!r}, sequence={self.sequence})")


def _feature_specs(features):
    """`features` with each `FeatureConfig` turned into a `FeatureSpec`
    over one `EmbeddingVariable` per `TableConfig` (shared by every feature
    naming it); other values as they are."""
    layers, by_name, out = {}, {}, {}
    for fname, spec in features.items():
        if not isinstance(spec, FeatureConfig):
            out[fname] = spec
            continue
        table = spec.table
        if id(table) not in layers:
            other = by_name.get(table.name)
            if other is not None and not other.same_table(table):
                raise ValueError(
                    f"Two different TableConfigs are named {table.name!r}; a table "
                    "shared by several features must be one TableConfig (or equal ones). "
                    f"Received: {other!r} and {table!r}")
            if other is not None:
                layers[id(table)] = layers[id(other)]
            else:
                layers[id(table)] = table.make_layer()
                by_name[table.name] = table
        out[fname] = FeatureSpec(layers[id(table)], combiner=table.combiner,
                                 weight_feature=spec.weight_feature)
    return out


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class GroupEmbedding(keras.layers.Layer):
    """Embeds many features with one fused lookup op (DeepRec's Group Embedding).

    Every feature reads its table (an `EmbeddingVariable` or a
    `keras.layers.Embedding`) and combines each example's ids; all features
    run in one C++ op forward and one backward, so the number of kernels per
    training step does not grow with the number of features. Ids `< 0` are
    padding and dropped. In training (`model.fit`) unseen ids are inserted
    into `EmbeddingVariable` tables. Train with an optimizer from
    `keras_rec_emb.optimizers`.

    When to use it: for many features (dozens of tables), above all
    multi-id (ragged or sparse) ones, one fused op per step replaces a
    chain of ops per feature; with at least two tables per intra-op
    thread each table is one unit of work (dedupe, lookup and combine), so
    the op waits on the thread pool once. Measured (26 features, batch
    4096, README "Semantics worth knowing"): with 1-5 ids per row the
    forward takes about 0.57x the time of separate layers; with one id per
    row a training step in `fit` costs the same as with separate
    `EmbeddingVariable` layers, whose lookups can overlap on spare cores
    and so may finish a forward pass sooner.

    Args:
        features: dict from feature (input) name to `FeatureSpec` (or its
            config dict), or to a keras-rs style `FeatureConfig` (one
            `EmbeddingVariable` per `TableConfig`, the table's combiner).
            Several features may share one table.
        output_mode: `"dict"` (a dict of per-feature outputs) or
            `"concat"` (one `[batch, sum(dims)]` tensor, features in order).
            Defaults to `"dict"`.
        tables: `None` or a list of table layers (or their serialized
            configs) that `FeatureSpec.table` indices refer to. Tables given
            directly in the specs are appended. Defaults to `None`.
        name: str or `None`.
        **kwargs: other `keras.layers.Layer` arguments.

    Input shape:
        A dict from feature name (and weight feature name) to ids `[batch]`,
        `[batch, L]` (pad with -1), `tf.RaggedTensor` or `tf.SparseTensor`
        `[batch, None]`. Or one tensor of stacked integer ids, features in
        the order of `features` (no weight features): `[batch, F]` whose
        column j feeds feature j (OneEmbedding's form), or `[batch, F, L]`
        where feature j's ids are `ids[:, j, :]` (pad with -1). One op
        splits it per feature (no per-feature slicing: with many features
        the cheapest form to feed); an inference call (`training=False`)
        with L > 1 and `output_mode="concat"` looks it up in one op
        (`KRE>StackedPooledLookup`) unless a feature has `max_norm` or a
        table is a dense matrix or distributed. Or a tuple `(ids, table_ids)` of equal
        shape `[batch, L]` where `table_ids` picks each id's feature (index
        in `features`).

    Output shape:
        dict of `[batch, dim]` (or `[batch, T, dim]` for sequence features),
        or `[batch, sum(dims)]` with `output_mode="concat"`.

    Example:

    >>> user = keras_rec_emb.layers.EmbeddingVariable(4, name="user_table")
    >>> group = keras_rec_emb.layers.GroupEmbedding({
    ...     "user": keras_rec_emb.layers.FeatureSpec(user),
    ...     "history": keras_rec_emb.layers.FeatureSpec(
    ...         {"embedding_dim": 8}, combiner="mean"),
    ... }, output_mode="concat")
    >>> inputs = {"user": keras.Input((), dtype="int64", name="user"),
    ...           "history": keras.Input((5,), dtype="int64", name="history")}
    >>> out = keras.layers.Dense(1, activation="sigmoid")(group(inputs))
    >>> model = keras.Model(inputs, out)
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1),
    ...               loss="binary_crossentropy")
    >>> x = {"user": np.arange(32), "history": np.random.randint(-1, 100, (32, 5))}
    >>> history = model.fit(x, np.ones((32, 1)), epochs=1, verbose=0)
    >>> model.output_shape
    (None, 1)

    Many features fed as one stacked `[batch, F, L]` tensor:

    >>> stacked = keras_rec_emb.layers.GroupEmbedding({
    ...     f"f{j}": keras_rec_emb.layers.FeatureSpec({"embedding_dim": 4})
    ...     for j in range(3)}, output_mode="concat")
    >>> ids = np.array([[[1, 2], [3, -1], [-1, -1]],
    ...                 [[4, -1], [5, 6], [7, 8]]])  # ids[:, j, :] feed f{j}
    >>> stacked(ids).shape
    TensorShape([2, 12])
    """

    def __init__(self, features: dict | list, output_mode: str = "dict",
                 tables: list | None = None, name: str | None = None, **kwargs):
        super().__init__(name=name, **kwargs)
        # Our C++ ops have no XLA kernels: Keras's jit_compile="auto" then
        # chooses False, and True falls back to False with a warning.
        self.supports_jit = False
        if not isinstance(features, dict) or not features:
            raise ValueError(
                "`features` must be a non-empty dict from feature name to "
                f"FeatureSpec. Received: features={features!r}"
            )
        features = _feature_specs(features)  # keras-rs FeatureConfigs
        if output_mode not in _OUTPUT_MODES:
            raise ValueError(
                f"`output_mode` must be one of {_OUTPUT_MODES}. Received: "
                f"output_mode={output_mode!r}"
            )
        if tables is not None and not isinstance(tables, (list, tuple)):
            raise TypeError(f"`tables` must be None or a list. Received: tables={tables!r}")
        self._tables = []
        for i, t in enumerate(tables or []):
            what = f"tables[{i}]"
            if isinstance(t, dict):
                t = _table_from_spec(t, what)
            self._tables.append(_check_table_layer(t, what))
        self._features = {}
        by_id = {id(t): i for i, t in enumerate(self._tables)}
        for fname, spec in features.items():
            if not isinstance(fname, str):
                raise TypeError(f"Feature names must be strings. Received: {fname!r}")
            if isinstance(spec, dict) and "combiner" in spec or isinstance(spec, dict) and "table" in spec:
                spec = FeatureSpec.from_config(spec)
            if not isinstance(spec, FeatureSpec):
                raise TypeError(
                    f"`features[{fname!r}]` must be a FeatureSpec. Received: {spec!r}"
                )
            table = spec.table
            if isinstance(table, (int, np.integer)):
                if not 0 <= table < len(self._tables):
                    raise ValueError(
                        f"`features[{fname!r}].table` index {table} is out of "
                        f"range for {len(self._tables)} tables"
                    )
                index = int(table)
            else:
                if isinstance(table, dict):
                    table = _table_from_spec(table, f"features[{fname!r}].table")
                if id(table) not in by_id:
                    by_id[id(table)] = len(self._tables)
                    self._tables.append(table)
                index = by_id[id(table)]
            self._features[fname] = FeatureSpec(
                index, spec.combiner, spec.weight_feature, spec.sequence,
                spec.max_norm, spec.default_id)
            if output_mode == "concat" and spec.sequence:
                raise ValueError(
                    f"Sequence feature {fname!r} cannot be concatenated; use "
                    "output_mode='dict'. Received: output_mode='concat'"
                )
        self.output_mode = output_mode
        # Tracked as sub-layers: their weights train and save with this layer.
        self.tables = list(self._tables)

    @property
    def features(self):
        return dict(self._features)

    @property
    def ids_input_dtype(self):
        """`"int64"`: the dtype of the `keras.Input` a `keras.Sequential`
        without one makes for this layer (the stacked form's ids)."""
        return "int64"

    def _dim(self, table):
        if isinstance(table, EmbeddingVariable):
            return table.embedding_dim
        return table.output_dim

    def build(self, input_shape=None):
        if self.built:
            return
        for t in self.tables:
            if not t.built:
                t.build(None)
        self.built = True

    count_params = variables.count_params  # tables count (ids admitted) x dim

    # -- forward ---------------------------------------------------------------
    def _feature_inputs(self, inputs):
        names = list(self._features)
        if isinstance(inputs, dict):
            missing = [n for n in names if n not in inputs]
            weights = [s.weight_feature for s in self._features.values()
                       if s.weight_feature is not None and s.weight_feature not in inputs]
            if missing or weights:
                raise ValueError(
                    f"GroupEmbedding '{self.name}' is missing inputs "
                    f"{missing + weights}. Received keys: {sorted(inputs)}"
                )
            ids = [inputs[n] for n in names]
            w = [None if s.weight_feature is None else inputs[s.weight_feature]
                 for s in self._features.values()]
            return ids, w
        if any(s.weight_feature for s in self._features.values()):
            raise ValueError(
                f"GroupEmbedding '{self.name}' has weight features; pass a dict "
                "of inputs, not OneEmbedding's id tensor form"
            )
        if isinstance(inputs, (list, tuple)):
            if len(inputs) != 2:
                raise ValueError(
                    "A GroupEmbedding called on a tuple takes (ids, table_ids). "
                    f"Received {len(inputs)} tensors"
                )
            ids, table_ids = (tf.convert_to_tensor(t) for t in inputs)
            if ids.shape.rank is not None and ids.shape != table_ids.shape:
                raise ValueError(
                    "`ids` and `table_ids` must have the same shape. Received "
                    f"{ids.shape} and {table_ids.shape}"
                )
            if ids.shape.rank == 1:
                ids, table_ids = ids[:, None], table_ids[:, None]
            table_ids = self._checked_table_ids(tf.cast(table_ids, ids.dtype), ids,
                                                len(names))
            return [tf.ragged.boolean_mask(ids, tf.equal(table_ids, j))
                    for j in range(len(names))], [None] * len(names)
        return self._stacked_inputs(tf.convert_to_tensor(inputs)), [None] * len(names)

    def _check_stacked(self, shape, dtype):
        """The one-tensor form's shape ([batch, F] or [batch, F, L]) and dtype
        (integers)."""
        f = len(self._features)
        if shape.rank not in (2, 3) or shape[1] != f:
            raise ValueError(
                f"GroupEmbedding '{self.name}' called on one tensor expects ids "
                f"[batch, {f}] (column j feeds feature j) or [batch, {f}, length] "
                f"(ids[:, j, :] feed feature j, padded with -1), features in the "
                f"order of `features`. Received: ids of shape {shape}"
            )
        dtype = tf.as_dtype(dtype)
        if not dtype.is_integer and not _compat.in_symbolic_build():
            raise non_integer_ids_error(f"GroupEmbedding '{self.name}'", dtype.name)

    def _stacked_inputs(self, ids):
        """Per feature `FlatIds` of stacked ids `[batch, F(, L)]`, from one
        `KRE>UnstackFeatureIds` (L = 1) or `KRE>UnstackKeptIds` op (no
        per-feature slicing), checked once for int32-key tables."""
        self._check_stacked(ids.shape, ids.dtype)
        f = len(self._features)
        if _serving_context.tracing_stock():  # a served graph: stock ops only
            return [ids[:, j] for j in range(f)]
        if ids.dtype not in (tf.int32, tf.int64):
            ids = integer_ids(ids, f"GroupEmbedding '{self.name}'", tf.int64)
        if ids.shape.rank == 2:
            ids = tf.expand_dims(ids, -1)
        in_range = ids.dtype == tf.int32
        if not in_range:
            key_dtypes = {tf.as_dtype(self.tables[s.table].key_dtype)
                          for s in self._features.values()
                          if isinstance(self.tables[s.table], EmbeddingVariable)}
            if key_dtypes == {tf.int32}:  # one check of all ids (-1 is padding)
                ids = assert_ids_in_range(ids, tf.int32, f"GroupEmbedding '{self.name}' ids",
                                          lower=False)
                in_range = True
            # int64 tables with int32 ones: each int32 table's ids are checked apart
        if ids.shape[2] == 1:
            # One id per row: the plain split (its row splits shared); the
            # lookup's lean single-id path reads each feature's ids as given.
            values, splits = _ops.unstack_feature_ids(ids)
            return [FlatIds(v, splits, in_range) for v in values]
        # Several: padding dropped in the split (every feature of the layer
        # prunes ids < 0), so the lookup reads the kept ids where they are.
        values, splits = _ops.unstack_kept_ids(ids)
        return [FlatIds(v, s, in_range) for v, s in zip(values, splits)]

    def _checked_table_ids(self, table_ids, ids, n):
        """`table_ids` with a check that every one paired with a real
        (non-padding, >= 0) id is a feature index in [0, n): an id with
        another table id would silently be dropped."""
        bad = tf.logical_and(tf.greater_equal(ids, 0), tf.logical_or(
            tf.less(table_ids, 0), tf.greater_equal(table_ids, n)))
        message = (f"GroupEmbedding '{self.name}': `table_ids` must be feature indices "
                   f"in [0, {n}) wherever the id is >= 0")
        if tf.executing_eagerly():
            if bool(tf.reduce_any(bad)):
                raise ValueError(f"{message}. Received table ids "
                                 f"{tf.boolean_mask(table_ids, bad).numpy()[:5].tolist()}")
            return table_ids
        check = tf.debugging.assert_equal(tf.reduce_any(bad), False, message=message)
        with tf.control_dependencies([check]):
            return tf.identity(table_ids)

    def _stacked_lookup(self, inputs):
        """The concatenated output of an inference call on stacked ids
        `[batch, F, L]` with L > 1, from one `KRE>StackedPooledLookup` op
        (no split of the ids per feature), or `None` where that op does not
        serve: other inputs, a sequence or max_norm feature, a dense or
        distributed table, a graph traced for serving."""
        if isinstance(inputs, (dict, list, tuple)) or self.output_mode != "concat":
            return None
        specs = list(self._features.values())
        if any(s.sequence or s.max_norm for s in specs):
            return None
        ids = tf.convert_to_tensor(inputs)
        self._check_stacked(ids.shape, ids.dtype)
        if ids.shape.rank != 3 or ids.shape[2] == 1:  # one id a row: the lean single-id path
            return None
        if ids.dtype not in (tf.int32, tf.int64):
            ids = integer_ids(ids, f"GroupEmbedding '{self.name}'", tf.int64)
        return embedding_ops.stacked_pooled_lookup(
            [self.tables[s.table] for s in specs], ids, [s.combiner for s in specs],
            [s.default_id for s in specs], name=self.name,
            what=f"GroupEmbedding '{self.name}' ids")

    def call(self, inputs, training=None):
        training = _compat.resolve_training(training)
        if isinstance(inputs, tf.Tensor) and inputs.shape.rank is not None \
                and not tf.executing_eagerly():
            # The traced shape is checked when the graph runs: the signatures
            # of a SavedModel (model.export, export_for_serving) are fed by
            # callers that skip tf.function's input check (TF Serving, a TF1
            # Session, `loaded.signatures[...]`), and stacked ids of another
            # length or rank would be read as valid ids.
            inputs = tf.ensure_shape(inputs, inputs.shape, name=f"{self.name}_ids_shape")
        out = None if training else self._stacked_lookup(inputs)
        if out is not None:
            return out if self.compute_dtype == "float32" else tf.cast(out, self.compute_dtype)
        ids, weights = self._feature_inputs(inputs)
        specs = list(self._features.values())
        has_w = any(w is not None for w in weights)
        concat = self.output_mode == "concat"
        outs = embedding_ops.group_embedding_lookup_sparse(
            [self.tables[s.table] for s in specs], ids, [s.combiner for s in specs],
            sp_weights=weights if has_w else None,
            is_sequence=[s.sequence for s in specs],
            max_norm=[s.max_norm for s in specs],
            default_id=[s.default_id for s in specs],
            training=bool(training), name=self.name, concat=concat)
        if concat:  # one [batch, sum(dims)] tensor, written in place by the op
            return outs if self.compute_dtype == "float32" else tf.cast(outs, self.compute_dtype)
        if self.compute_dtype != "float32":
            outs = [tf.cast(o, self.compute_dtype) for o in outs]
        return dict(zip(self._features, outs))

    def compute_output_spec(self, inputs, training=None):
        if isinstance(inputs, dict):
            batch = inputs[next(iter(self._features))].shape[0]
        elif isinstance(inputs, (list, tuple)):
            batch = inputs[0].shape[0]
        else:
            self._check_stacked(tf.TensorShape(inputs.shape), inputs.dtype)
            batch = inputs.shape[0]
        dims = [self._dim(self.tables[s.table]) for s in self._features.values()]
        if self.output_mode == "concat":
            return keras.KerasTensor((batch, sum(dims)), dtype=self.compute_dtype)
        return {n: keras.KerasTensor((batch, None, d) if s.sequence else (batch, d),
                                     dtype=self.compute_dtype)
                for (n, s), d in zip(self._features.items(), dims)}

    # -- saving ------------------------------------------------------------------
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
