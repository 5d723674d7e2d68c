"""GroupEmbedding and FeatureSpec, written once for both backends; the lookup
is the backend's `group` module."""

import keras
import numpy as np

from keras_rec_emb import _backend
from keras_rec_emb._checks_core import (check_combiner, check_float, check_int, is_integer_dtype,
                                        non_integer_ids_error)
from keras_rec_emb._keras_fixes import in_symbolic_build
from keras_rec_emb.layers.configs import EmbeddingVariable, FeatureConfig

if _backend.is_jax():
    from keras_rec_emb.backend.jax import group as _impl
else:
    from keras_rec_emb.backend.tensorflow import group as _impl

_OUTPUT_MODES = ("dict", "concat")


def _integer(dtype):
    """Whether ids of `dtype` are integers (NumPy knows no "string" or "bfloat16")."""
    try:
        return is_integer_dtype(dtype)
    except TypeError:
        return False


def _table_layer(table, what):
    """`table`, a table layer, or the one a spec dict makes (a serialized layer,
    or `EmbeddingVariable` or `keras.layers.Embedding` arguments)."""
    if isinstance(table, dict):
        spec = table
        if "class_name" in spec:
            table = keras.saving.deserialize_keras_object(spec)
        elif "embedding_dim" in spec:
            table = EmbeddingVariable(**spec)
        elif "input_dim" in spec and "output_dim" in spec:
            table = keras.layers.Embedding(**spec)
        else:
            raise ValueError(
                f"`{what}` as a dict must be a serialized layer or hold "
                "EmbeddingVariable arguments (`embedding_dim`, ...) or "
                "keras.layers.Embedding arguments (`input_dim`, `output_dim`, ...). "
                f"Received: {what}={spec!r}"
            )
    if isinstance(table, (EmbeddingVariable, keras.layers.Embedding)):
        return table
    raise TypeError(
        f"`{what}` must be an EmbeddingVariable, a keras.layers.Embedding, a "
        f"spec dict or a table index. Received: {what}={table!r}"
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
            weights (the ids' shape). Defaults to `None`.
        sequence: bool. Return `[batch, T, dim]` rows instead of combining
            (docs/semantics.md, 'Lookups: fused, grouped, strings'). Defaults to `False`.
        max_norm: `None` or float. Clip each row to this L2 norm before
            combining. Defaults to `None`.
        default_id: `None` or int. Id read (weight 1) by rows with no valid id;
            `None` gives zeros. Defaults to `None`.

    Example:

    >>> spec = keras_rec_emb.layers.FeatureSpec({"embedding_dim": 4}, combiner="mean")
    >>> spec.combiner
    'mean'

    A sequence of clipped rows, and a feature that reads id 0 when empty:

    >>> group = keras_rec_emb.layers.GroupEmbedding({
    ...     "clicks": keras_rec_emb.layers.FeatureSpec(
    ...         {"embedding_dim": 4}, sequence=True, max_norm=1.0),
    ...     "user": keras_rec_emb.layers.FeatureSpec({"embedding_dim": 4}, default_id=0)})
    >>> out = group({"clicks": np.array([[3, 5], [7, 9]]), "user": np.array([[-1], [2]])})
    >>> tuple(out["clicks"].shape), tuple(out["user"].shape)
    ((2, 2, 4), (2, 4))
    """

    def __init__(self, table: keras.layers.Layer | dict | int, combiner: str = "sum",
                 weight_feature: str | None = None, sequence: bool = False,
                 max_norm: float | None = None, default_id: int | None = None):
        check_combiner(combiner, allow_none=False)
        if weight_feature is not None and not isinstance(weight_feature, str):
            raise TypeError(
                "`weight_feature` must be None or an input name. Received: "
                f"weight_feature={weight_feature!r}"
            )
        if not isinstance(sequence, (bool, np.bool_)):
            raise TypeError(f"`sequence` must be a bool. Received: sequence={sequence!r}")
        max_norm = check_float("max_norm", max_norm, 0, min_open=True, allow_none=True)
        default_id = check_int("default_id", default_id, 0, allow_none=True)
        if isinstance(table, bool) or not isinstance(table, (int, np.integer, dict)):
            _table_layer(table, "table")
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
    """`features` with each `FeatureConfig` a `FeatureSpec` over one
    `EmbeddingVariable` per `TableConfig`."""
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
    """Embeds many features with one fused lookup (DeepRec's Group Embedding).

    Every feature reads its table (an `EmbeddingVariable` or a
    `keras.layers.Embedding`) and combines each example's ids; ids `< 0` are
    padding. See docs/semantics.md, 'Lookups: fused, grouped, strings'.

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
        `[batch, L]` (pad with -1), or under TensorFlow a `tf.RaggedTensor`
        or `tf.SparseTensor` `[batch, None]`. Or one tensor of stacked ids,
        `[batch, F]` or `[batch, F, L]` (docs/semantics.md, 'Lookups: fused, grouped, strings').

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
    >>> tuple(stacked(ids).shape)
    (2, 12)
    """

    def __init__(self, features: dict | list, output_mode: str = "dict",
                 tables: list | None = None, name: str | None = None, **kwargs):
        super().__init__(name=name, **kwargs)
        # The TensorFlow ops have no XLA kernels: Keras's jit_compile="auto"
        # then chooses False, and True falls back to False with a warning.
        # Under JAX the tables are XLA FFI calls: the step is jitted.
        self.supports_jit = _backend.is_jax()
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
        self._tables = [_table_layer(t, f"tables[{i}]") for i, t in enumerate(tables or [])]
        self._features = {}
        by_id = {id(t): i for i, t in enumerate(self._tables)}
        for fname, spec in features.items():
            if not isinstance(fname, str):
                raise TypeError(f"Feature names must be strings. Received: {fname!r}")
            if isinstance(spec, dict) and ("combiner" in spec or "table" in spec):
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
                table = _table_layer(table, f"features[{fname!r}].table")
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
        """The dtype of the `keras.Input` a `keras.Sequential` without one makes
        for this layer (Keras would make it float32)."""
        return _impl.ids_input_dtype()

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

    count_params = _impl.count_params

    # -- input parsing and output assembly --------------------------------------
    def dict_inputs(self, inputs):
        """(ids, weights) of a dict of inputs, per feature in order."""
        specs = list(self._features.values())
        missing = [n for n in self._features if n not in inputs]
        missing += [s.weight_feature for s in specs
                    if s.weight_feature is not None and s.weight_feature not in inputs]
        if missing:
            raise ValueError(f"GroupEmbedding '{self.name}' is missing inputs {missing}. "
                             f"Received keys: {sorted(inputs)}")
        return ([inputs[n] for n in self._features],
                [None if s.weight_feature is None else inputs[s.weight_feature]
                 for s in specs])

    def refuse_weight_features(self):
        """The error for stacked ids when a feature is weighted."""
        weighted = [s.weight_feature for s in self._features.values()
                    if s.weight_feature is not None]
        if weighted:
            raise ValueError(
                f"GroupEmbedding '{self.name}' has weight features {weighted}: pass a "
                "dict of inputs (ids and weights by name), not one stacked ids tensor")

    def check_stacked(self, shape, dtype):
        """Checks the stacked form's shape ([batch, F] or [batch, F, L]) and dtype."""
        f = len(self._features)
        if len(shape) not in (2, 3) or shape[1] != f:
            raise ValueError(
                f"GroupEmbedding '{self.name}' called on one tensor expects ids "
                f"[batch, {f}] (column j feeds feature j) or [batch, {f}, length] "
                f"(ids[:, j, :] feed feature j, padded with -1), features in the "
                f"order of `features`. Received: ids of shape {tuple(shape)}"
            )
        if not _integer(dtype) and not in_symbolic_build():
            raise non_integer_ids_error(f"GroupEmbedding '{self.name}'", dtype)

    def __call__(self, inputs, *args, **kwargs):
        return super().__call__(_impl.prepare_inputs(self, inputs), *args, **kwargs)

    def call(self, inputs, training=None):
        outs = _impl.lookup(self, inputs, training)
        if self.output_mode == "concat":
            return keras.ops.cast(outs, self.compute_dtype)
        return {n: keras.ops.cast(o, self.compute_dtype) for n, o in zip(self._features, outs)}

    def compute_output_spec(self, inputs, training=None):
        if isinstance(inputs, dict):
            batch = inputs[next(iter(self._features))].shape[0]
        elif isinstance(inputs, (list, tuple)):
            batch = inputs[0].shape[0]
        else:
            self.check_stacked(tuple(inputs.shape), keras.backend.standardize_dtype(inputs.dtype))
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
