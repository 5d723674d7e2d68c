"""keras-rs style table and feature configs: `GroupEmbedding(feature_configs)`
takes keras-rs's `DistributedEmbedding` dict, one `EmbeddingVariable` per table."""

import keras
import numpy as np

from keras_rec_emb._checks_core import check_combiner, positive_int
from keras_rec_emb.options import EmbeddingVariableOption

from keras_rec_emb.layers.embedding_variable import EmbeddingVariable


def _check_name(name, what):
    if not isinstance(name, str) or not name:
        raise TypeError(f"`{what}` must be a non-empty string. Received: {what}={name!r}")
    return name


def _check_shape(shape, what):
    if shape is None:
        return None
    if not isinstance(shape, (list, tuple)) or not all(
            d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0)
            for d in shape):
        raise TypeError(
            f"`{what}` must be None or a tuple of positive ints (or None). "
            f"Received: {what}={shape!r}")
    return tuple(None if d is None else int(d) for d in shape)


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class TableConfig:
    """One embedding table, as keras-rs's `TableConfig` describes it.

    The table is an `EmbeddingVariable`: a hash table that grows with the
    ids it sees, so `vocabulary_size` bounds nothing (any int64 id works);
    it is kept so that keras-rs configs port unchanged.

    Args:
        name: str. The table's name (its `EmbeddingVariable`'s name).
        embedding_dim: int > 0. Width of each row.
        vocabulary_size: `None` or int > 0. Accepted for keras-rs ports;
            not a limit. Defaults to `None`.
        initializer: Keras initializer of new rows. Defaults to
            `"truncated_normal"`.
        optimizer: `None` (the model's optimizer updates the table) or an
            optimizer of `keras_rec_emb.optimizers` for this table alone
            (or its name, e.g. `"adagrad"`; see `EmbeddingVariable`).
            Defaults to `None`.
        combiner: `"sum"`, `"mean"` or `"sqrtn"`: how each feature of this
            table combines a row's ids (keras-rs's default `"mean"`).
        key_dtype: `"int64"` or `"int32"`. Defaults to `"int64"`.
        ev_option: `None` or a `keras_rec_emb.EmbeddingVariableOption`
            (filters, eviction, file tier). Defaults to `None`.

    Example:

    >>> table = keras_rec_emb.layers.TableConfig(
    ...     "movie", embedding_dim=8, optimizer=keras_rec_emb.optimizers.Adagrad(0.1),
    ...     combiner="sum")
    >>> table.make_layer().embedding_dim
    8
    """

    def __init__(self, name: str, embedding_dim: int, vocabulary_size: int | None = None,
                 initializer: str | dict | keras.initializers.Initializer = "truncated_normal",
                 optimizer: keras.optimizers.Optimizer | str | None = None, combiner: str = "mean",
                 key_dtype: str = "int64",
                 ev_option: EmbeddingVariableOption | None = None):
        self.name = _check_name(name, "name")
        self.embedding_dim = positive_int("embedding_dim", embedding_dim)
        self.vocabulary_size = positive_int("vocabulary_size", vocabulary_size, allow_none=True)
        check_combiner(combiner, allow_none=False)
        self.initializer = initializer
        self.optimizer = optimizer
        self.combiner = combiner
        self.key_dtype = key_dtype
        self.ev_option = ev_option
        # Checks the rest (initializer, optimizer, key dtype, options) now.
        self.make_layer()

    def make_layer(self):
        """A new `EmbeddingVariable` for this table."""
        return EmbeddingVariable(self.embedding_dim, initializer=self.initializer,
                                 key_dtype=self.key_dtype, ev_option=self.ev_option,
                                 optimizer=self.optimizer, name=self.name)

    def same_table(self, other):
        """Whether `other` describes the same table (equal configs, the
        optimizers' auto-generated names aside): how features that name
        one table after a `.keras` reload (one copy each) find it shared."""
        def key(config):
            # (Keras's serialization also tags objects it saw twice with
            # `shared_object_id`s.)
            if isinstance(config, dict):
                return {k: key(v) for k, v in config.items() if k != "shared_object_id"}
            return config

        def table_key(table):
            config = key(table.get_config())
            opt = config.get("optimizer")
            if isinstance(opt, dict) and isinstance(opt.get("config"), dict):
                config["optimizer"] = dict(opt, config={k: v for k, v in opt["config"].items()
                                                        if k != "name"})
            return config

        return isinstance(other, TableConfig) and table_key(self) == table_key(other)

    def get_config(self):
        def ser(obj):
            if obj is None or isinstance(obj, (str, dict)):
                return obj
            return keras.saving.serialize_keras_object(obj)

        return {"name": self.name, "embedding_dim": self.embedding_dim,
                "vocabulary_size": self.vocabulary_size,
                "initializer": ser(self.initializer), "optimizer": ser(self.optimizer),
                "combiner": self.combiner, "key_dtype": self.key_dtype,
                "ev_option": ser(self.ev_option)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key in ("optimizer", "ev_option"):
            if isinstance(config.get(key), dict):
                config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)

    def __repr__(self):
        return (f"TableConfig(name={self.name!r}, embedding_dim={self.embedding_dim}, "
                f"combiner={self.combiner!r})")


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class FeatureConfig:
    """One input feature and the table it reads, as keras-rs's
    `FeatureConfig` describes it. Several features may name one
    `TableConfig` (one table, shared).

    Args:
        name: str. The feature's name.
        table: `TableConfig`. The table it reads.
        input_shape: `None` or the ids' shape, e.g. `(batch, 5)`: checked
            against the data by Keras, not needed. Defaults to `None`.
        output_shape: `None` or `(batch, embedding_dim)`; its last entry
            must be the table's `embedding_dim`. Defaults to `None`.
        weight_feature: `None` or the name of the input holding per-id
            weights (see `FeatureSpec`). Defaults to `None`.

    Example:

    >>> table = keras_rec_emb.layers.TableConfig("item", embedding_dim=4)
    >>> features = {
    ...     "item": keras_rec_emb.layers.FeatureConfig("item", table),
    ...     "history": keras_rec_emb.layers.FeatureConfig("history", table),
    ... }
    >>> group = keras_rec_emb.layers.GroupEmbedding(features)
    >>> out = group({"item": np.array([[3], [4]]),
    ...              "history": np.array([[3, 5, -1], [6, -1, -1]])})
    >>> sorted(out), tuple(out["history"].shape), len(group.tables)
    (['history', 'item'], (2, 4), 1)
    """

    def __init__(self, name: str, table: TableConfig, input_shape: tuple | None = None,
                 output_shape: tuple | None = None, weight_feature: str | None = None):
        self.name = _check_name(name, "name")
        if isinstance(table, dict):
            table = TableConfig.from_config(table)
        if not isinstance(table, TableConfig):
            raise TypeError(f"`table` must be a TableConfig. Received: table={table!r}")
        self.table = table
        self.input_shape = _check_shape(input_shape, "input_shape")
        self.output_shape = _check_shape(output_shape, "output_shape")
        if self.output_shape and self.output_shape[-1] not in (None, table.embedding_dim):
            raise ValueError(
                f"`output_shape` of feature {name!r} must end with its table's "
                f"embedding_dim {table.embedding_dim}. Received: "
                f"output_shape={output_shape!r}")
        if weight_feature is not None and not isinstance(weight_feature, str):
            raise TypeError(
                "`weight_feature` must be None or an input name. Received: "
                f"weight_feature={weight_feature!r}")
        self.weight_feature = weight_feature

    def get_config(self):
        return {"name": self.name, "table": self.table.get_config(),
                "input_shape": self.input_shape, "output_shape": self.output_shape,
                "weight_feature": self.weight_feature}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return f"FeatureConfig(name={self.name!r}, table={self.table.name!r})"

