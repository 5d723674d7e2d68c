"""EmbeddingVariable, written once for both backends; what differs (the table's
kind, the lookup, the update) is the base `_impl.EmbeddingVariableBackend`."""

import keras
import numpy as np

from keras_rec_emb import _backend
from keras_rec_emb import tables as _tables
from keras_rec_emb._checks_core import (check_combiner, check_initializer_matrix, check_int,
                                        positive_int)
from keras_rec_emb.optimizers.keras_optimizers import table_optimizer
from keras_rec_emb.options import (EmbeddingVariableOption, InitializerOption,
                                   ev_option_from_config)

if _backend.is_jax():
    from keras_rec_emb.backend.jax import layers as _impl
else:
    from keras_rec_emb.backend.tensorflow import embedding_variable as _impl

_KEY_DTYPES = ("int32", "int64")


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class EmbeddingVariable(_impl.EmbeddingVariableBackend, keras.layers.Layer):
    """Embedding layer whose table grows as new ids arrive (DeepRec's EV).

    Any int32/int64 id indexes a collision-free hash table; memory grows with
    the distinct ids seen. Training inserts and counts unseen ids; inference
    reads their initial row. See docs/semantics.md, 'EmbeddingVariable'.

    Args:
        embedding_dim: int > 0. Width of each embedding row.
        initializer: Keras initializer for new rows (the EV-initializer
            matrix). Defaults to `"truncated_normal"`.
        key_dtype: `"int64"`, `"int32"` or `None`. Dtype of the table's
            keys; ids of the other integer dtype are cast (checked to
            fit). `None` is `"int64"` (`"int32"` under JAX with
            `JAX_ENABLE_X64=0`). Defaults to `None`.
        combiner: `None`, `"sum"`, `"mean"` or `"sqrtn"`. With a combiner,
            ids `[..., L]` (under TensorFlow also `tf.RaggedTensor` or
            `tf.SparseTensor` `[B, None]`) give `[..., embedding_dim]`, and
            empty rows give zeros. Defaults to `None`.
        prune_invalid_ids: bool. With a combiner, ids `< 0` are padding, dropped
            from the combine and never looked up. Defaults to `False`.
        ev_option: `keras_rec_emb.EmbeddingVariableOption`, its config or `None`
            (`EmbeddingVariableOption()`): initializer, shards, filter, eviction, storage.
        trainable: bool. Defaults to `True`.
        name: str or `None`.
        restore_dim_mismatch: `"error"` (default) or `"pad_or_truncate"`: what
            restoring rows of another width does (docs/semantics.md, 'Tables and their options').
        optimizer: `None` (the model's), or an optimizer of `keras_rec_emb.optimizers`
            (instance, name or config) that updates this table alone.
        default_value_dim: int >= 1 or `None`. Rows of the initializer matrix,
            a shortcut for the `ev_option`'s (4096), which it must agree with.
        num_shards: int in [1, 65536] or `None`. The table's lock shards, a
            shortcut for the `ev_option`'s (32), which it must agree with.
        **kwargs: other `keras.layers.Layer` arguments (e.g. `dtype`).

    Input shape:
        Integer ids of any shape; or `[..., L]` ids with a combiner.

    Output shape:
        `ids.shape + (embedding_dim,)` without a combiner (ragged ids give a
        ragged result); `ids.shape[:-1] + (embedding_dim,)` with one.

    Example:

    >>> ids = keras.Input(shape=(3,), dtype="int64")
    >>> emb = keras_rec_emb.layers.EmbeddingVariable(8, combiner="mean")(ids)
    >>> out = keras.layers.Dense(1, activation="sigmoid")(emb)
    >>> model = keras.Model(ids, out)
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1),
    ...               loss="binary_crossentropy")
    >>> x = np.arange(192).reshape(64, 3) * 10**9
    >>> y = np.random.randint(0, 2, size=(64, 1))
    >>> history = model.fit(x, y, epochs=1, verbose=0)
    >>> model.layers[1].table_size()
    192
    """

    def __init__(self, embedding_dim: int,
                 initializer: str | dict | keras.initializers.Initializer = "truncated_normal",
                 key_dtype: str | None = None, combiner: str | None = None,
                 prune_invalid_ids: bool = False,
                 ev_option: EmbeddingVariableOption | dict | None = None, trainable: bool = True,
                 name: str | None = None, restore_dim_mismatch: str = "error",
                 optimizer: keras.optimizers.Optimizer | str | dict | None = None,
                 default_value_dim: int | None = None, num_shards: int | None = None,
                 **kwargs):
        super().__init__(trainable=trainable, name=name, **kwargs)
        self._init_backend()
        positive_int("embedding_dim", embedding_dim)
        if key_dtype is None:
            key_dtype = _impl.default_key_dtype()
        key_dtype = getattr(key_dtype, "name", key_dtype)  # a tf.DType or NumPy dtype
        if key_dtype not in _KEY_DTYPES:
            raise ValueError(
                f"`key_dtype` must be one of {_KEY_DTYPES}. Received: "
                f"key_dtype={key_dtype!r}"
            )
        check_combiner(combiner)
        if not isinstance(prune_invalid_ids, (bool, np.bool_)):
            raise TypeError(
                "`prune_invalid_ids` must be a bool. Received: "
                f"prune_invalid_ids={prune_invalid_ids!r}"
            )
        if prune_invalid_ids and combiner is None:
            raise ValueError(
                "`prune_invalid_ids=True` drops ids < 0 from a combine and needs a "
                "`combiner` (\"sum\", \"mean\" or \"sqrtn\"). Received: combiner=None"
            )
        self.embedding_dim = int(embedding_dim)
        self.initializer = keras.initializers.get(initializer)
        self.key_dtype = key_dtype
        self.combiner = combiner
        self.prune_invalid_ids = bool(prune_invalid_ids)
        self.ev_option = _ev_option(ev_option, default_value_dim, num_shards)
        self.restore_dim_mismatch = _tables.check_restore_dim_mode(restore_dim_mismatch)
        self.table_optimizer = self._resolve_optimizer(table_optimizer(optimizer))
        if self.table_optimizer is not None:
            self.table_optimizer._kre_table_own = True  # for its load_own_variables
        self.table = None

    def build(self, input_shape=None):
        if self.built:
            return
        init_option = self.ev_option.init_option
        initializer = init_option.initializer or self.initializer
        check_initializer_matrix(self.name, init_option.default_value_dim, self.embedding_dim)
        default_values = self._draw(initializer,
                                    (init_option.default_value_dim, self.embedding_dim))
        self._make_table(default_values)
        self.built = True

    optimizer = _tables.attribute(
        "table_optimizer", "The table's own optimizer (`optimizer=`), or None (the model's).")
    default_value_dim = _tables.attribute(
        "ev_option.init_option.default_value_dim",
        "Rows of the initializer matrix (the option's).")
    num_shards = _tables.attribute("ev_option.num_shards",
                                   "The table's lock shards (the option's).")
    ids_input_dtype = _tables.attribute(
        "key_dtype", "`key_dtype`: the dtype of the `keras.Input` a `keras.Sequential` "
        "without one makes for this layer (Keras would make it float32).")

    @property
    def trainable(self):
        return super().trainable

    @trainable.setter
    def trainable(self, value):
        keras.layers.Layer.trainable.fset(self, value)
        if getattr(self, "table", None) is not None:
            self.table.trainable = value

    def call(self, inputs, weights=None, training=None):
        """Rows of `inputs` (ids), combined over their last axis with a combiner.

        Args:
            inputs: integer ids (see the class).
            weights: None, or per-id weights of the ids' shape and kind (needs a
                combiner); see docs/semantics.md, 'EmbeddingVariable'.
            training: bool or None (see the class).

        Example:

        >>> layer = keras_rec_emb.layers.EmbeddingVariable(
        ...     2, combiner="mean", prune_invalid_ids=True, initializer="ones")
        >>> out = layer(np.array([[1, 2, -1]]), weights=np.array([[1.0, 3.0, 5.0]]))
        >>> keras.ops.convert_to_numpy(out).tolist()
        [[1.0, 1.0]]
        """
        return self._call(inputs, weights, training)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if self.combiner is not None:
            return input_shape[:-1] + (self.embedding_dim,)
        return input_shape + (self.embedding_dim,)

    # -- table access ---------------------------------------------------------
    def _require_built(self, what):
        if self.table is None:
            raise ValueError(
                f"EmbeddingVariable '{self.name}' is not built yet; call it on "
                f"ids (or build it) before {what}."
            )

    def table_size(self):
        """Number of distinct ids admitted to the table."""
        self._require_built("table_size()")
        return self.table.size()

    def evict(self, step=None):
        """Applies the configured eviction now, as saving does; returns how many
        ids were evicted (0 without one).

        Args:
            step: int >= 0 or None. The current global step for
                `steps_to_live`; None uses the last step that updated this
                table.
        """
        self._require_built("evict()")
        return self.table.evict(check_int("step", step, 0, allow_none=True))

    def stats(self):
        """The table's statistics, a dict (docs/semantics.md, 'EmbeddingVariable')."""
        self._require_built("stats()")
        return self.table.stats()

    @property
    def storage_dir(self):
        """The file tier's folder of the table (`storage_path/<name>_embeddings`,
        or a copy's folder beside a live table holding that one), or None
        (DRAM, or not built yet)."""
        return None if self.table is None else self.table.storage_dir

    def snapshot(self):
        """File tier: writes a crash-safe snapshot of the table's files under
        `storage_dir`; returns its number (docs/file_tier.md).

        Example:

        >>> import tempfile
        >>> option = keras_rec_emb.EmbeddingVariableOption(
        ...     storage_option=keras_rec_emb.StorageOption(
        ...         "FILE", storage_path=tempfile.mkdtemp(), storage_size=1 << 20))
        >>> layer = keras_rec_emb.layers.EmbeddingVariable(4, ev_option=option)
        >>> _ = layer(np.array([1, 2, 3]), training=False)
        >>> layer.import_({"keys": np.array([1, 2, 3]), "values": np.ones((3, 4))})
        >>> layer.snapshot()
        1
        >>> layer.restore_snapshot()
        3
        """
        self._require_built("snapshot()")
        return self.table.snapshot()

    def restore_snapshot(self, path=None):
        """File tier: replaces the table's contents with its latest snapshot;
        returns the number of ids. A bad snapshot raises a ValueError.

        Args:
            path: str or None. The snapshot's folder; None is the table's.
        """
        self._require_built("restore_snapshot()")
        return self.table.restore_snapshot(path)

    def export(self):
        """All ids as a dict of NumPy arrays in DeepRec's format
        (docs/semantics.md, 'EmbeddingVariable')."""
        self._require_built("export()")
        return self.table.export()

    def import_(self, data):
        """Replaces the table's contents with `data`, shaped like `export()`'s
        (`keys` and `values` required, the rest optional)."""
        self._require_built("import_()")
        self.table.import_(data)

    # -- saving ---------------------------------------------------------------
    def save_own_variables(self, store):
        if self.table is None:
            return
        # DeepRec evicts when a model is saved (unless the option's `at_save`
        # or `save_model(..., evict=False)` says not to); reported per table.
        self.table.evict_for_save(self.name)
        data = self.table.export(include_filtered=self.table.save_filtered)
        if not self.table.save_filtered:
            del data["bloom"]
        for key in _tables.ARRAY_PARTS:
            if key in data:
                store[key] = data[key]
        for name, values in data["slots"].items():
            store[_tables.SLOT_PREFIX + name] = values
        self._save_step(store)

    def load_own_variables(self, store):
        if self.table is None:
            self.build()
        names = list(store.keys())
        # Parts a file lacks (no filter configured, filtered ids stripped) load as empty.
        data = {key: np.asarray(store[key]) for key in _tables.ARRAY_PARTS if key in names}
        data["slots"] = {n[len(_tables.SLOT_PREFIX):]: np.asarray(store[n]) for n in names
                         if n.startswith(_tables.SLOT_PREFIX)}
        for key in ("keys", "values"):
            if key not in data:
                raise ValueError(f"The saved EmbeddingVariable '{self.name}' has no `{key}` "
                                 f"(the store holds {sorted(names)})")
        if _tables.check_saved_dim(self.table.name, data["values"].shape, self.embedding_dim,
                                   self.restore_dim_mismatch):
            data["values"], data["slots"] = self.table.resize_rows(
                data["keys"], data["values"], data["slots"])
            data.pop("default_values", None)  # the table keeps its own initializer
        self.table.import_(data)
        self._load_step(store, data)

    def get_config(self):
        config = super().get_config()
        config.update({
            "embedding_dim": self.embedding_dim,
            "initializer": keras.initializers.serialize(self.initializer),
            "key_dtype": self.key_dtype,
            "combiner": self.combiner,
            "prune_invalid_ids": self.prune_invalid_ids,
            "ev_option": keras.saving.serialize_keras_object(self.ev_option),
            "restore_dim_mismatch": self.restore_dim_mismatch,
            "optimizer": (None if self.table_optimizer is None
                          else keras.saving.serialize_keras_object(self.table_optimizer)),
        })
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        # A malformed option is named (ValueError) rather than refused by type.
        config["ev_option"] = ev_option_from_config(config.get("ev_option"))
        return cls(**config)


def _ev_option(ev_option, default_value_dim, num_shards):
    """The layer's `EmbeddingVariableOption` from `ev_option` and the shortcuts."""
    if ev_option is not None and not isinstance(ev_option, (dict, EmbeddingVariableOption)):
        raise TypeError(
            "`ev_option` must be None, a keras_rec_emb.EmbeddingVariableOption or its "
            f"config (a dict). Received: ev_option={ev_option!r}")
    check_int("default_value_dim", default_value_dim, 1, allow_none=True)
    if ev_option is None:
        init = (InitializerOption() if default_value_dim is None
                else InitializerOption(default_value_dim=default_value_dim))
        return EmbeddingVariableOption(
            init_option=init, **({} if num_shards is None else {"num_shards": num_shards}))
    ev_option = ev_option_from_config(ev_option)
    for argument, value, held in (
            ("default_value_dim", default_value_dim, ev_option.init_option.default_value_dim),
            ("num_shards", num_shards, ev_option.num_shards)):
        if value is not None and value != held:
            raise ValueError(
                f"`{argument}` is the `ev_option`'s ({held}) when an `ev_option` is given: "
                f"leave it None or equal. Received: {argument}={value!r}")
    return ev_option


_impl.register_layer_class(EmbeddingVariable)
