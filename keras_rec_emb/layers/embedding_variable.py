"""EmbeddingVariable: an embedding layer backed by a dynamic hash table.

Written once for Keras's TensorFlow and JAX backends: the arguments, their
checks, the config, the saving hooks and the table methods are here; what
differs (the table's kind, the call's lookup, how training updates the
table) is the base class `_impl.EmbeddingVariableBackend`, from
`keras_rec_emb/backend/tensorflow/embedding_variable.py` or
`keras_rec_emb/backend/jax/layers.py`.
"""

import keras
import numpy as np

from keras_rec_emb import _backend
from keras_rec_emb import tables as _tables
from keras_rec_emb._checks_core import check_combiner, check_initializer_matrix, check_int
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

    Ids index a collision-free hash table instead of a `[vocab, dim]` matrix:
    any int32/int64 id works (`10**15` as well as `3`), and memory grows
    with the number of distinct ids seen. A new id's row is a copy of row
    `id mod default_value_dim` of a matrix drawn once from `initializer`
    (DeepRec's EV Initializer).

    In training (`training=True`, as in `model.fit`) unseen ids are inserted
    and counted; in inference they read their initial row and the table is
    unchanged. `training=None` (what Keras passes to the layers of a
    subclassed model whose `call` takes no `training`) is training when the
    loss is differentiated with respect to the table, as in `fit` (under
    TensorFlow: while a gradient tape records), and inference otherwise.
    Train with an optimizer from `keras_rec_emb.optimizers`, or give the
    layer its own (`optimizer=`). `model.save` keeps every row, the
    optimizer slots, frequencies and versions, in one format under both
    backends (a `.keras` file saved under one loads under the other).

    Under TensorFlow the table's gradient is a `tf.IndexedSlices` over ids
    that the optimizer applies with one fused kernel; `tf.train.Checkpoint`
    and `model.export` keep the table too; the layers of one Functional
    model that read its inputs are looked up in one fused op
    (`backend/tensorflow/model_fusion.py`). Under JAX the backward of the
    lookup applies the rows' gradient inside the jitted step
    (`backend/jax/layers.py`); the layer counts its training steps in a
    non-trainable `iterations`, saved with the table.

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
        prune_invalid_ids: bool. With a combiner, ids `< 0` are padding:
            dropped from the combine (a mean or sqrtn counts the kept ids
            only, a row with none gives zeros), never looked up, inserted
            or counted, as in DeepRec's `fused_safe_embedding_lookup_sparse`
            and `GroupEmbedding`. Ids padded with -1 (`[B, L]`) then need no
            conversion to ragged. `False` makes every id a key, -1 too.
            Needs a combiner. Defaults to `False`.
        ev_option: `keras_rec_emb.EmbeddingVariableOption`, its config (a
            dict, as in a saved model) or `None`: the initializer option,
            `num_shards`, admission filter (`CounterFilter`, `CBFFilter`),
            eviction (`GlobalStepEvict`, `L2WeightEvict`), storage
            (`StorageOption("FILE", storage_path, storage_size)`: rows in
            files under `storage_path/<name>_embeddings` with a DRAM cache;
            see `snapshot()`), `track_meta`, `save_filtered` and
            `record_freq`. Its eviction option also evicts when the model
            (or a checkpoint) is saved, as `GlobalStepEvict` says. Defaults
            to `None` (`EmbeddingVariableOption()`).
        trainable: bool. Defaults to `True`.
        name: str or `None`.
        restore_dim_mismatch: `"error"` or `"pad_or_truncate"`. Restoring
            rows of another width (`load_weights`, `.keras` loading,
            `tf.train.Checkpoint`) raises by default; `"pad_or_truncate"`
            does what DeepRec does: wider rows are truncated, narrower ones
            padded, the new columns of id `k` from initializer row
            `k mod default_value_dim` (optimizer slots of width
            `embedding_dim` with the slot's init value). Defaults to
            `"error"`.
        optimizer: `None`, or an optimizer of `keras_rec_emb.optimizers`
            (instance, name such as `"adagrad"`, or serialized config; or
            Keras's SGD, Adagrad, Adam or Ftrl, taken as ours of that name
            and config) that updates this table instead of the model's
            optimizer (keras-rs's `TableConfig(optimizer=...)`).
            Its learning rate (or schedule) and hyper-parameters apply; its
            slots live in the table and are saved with it. Gradient
            clipping, loss scaling and EMA belong to the model's optimizer:
            a table optimizer that sets them is refused. Defaults to `None`
            (the model's optimizer).
        default_value_dim: int >= 1 or `None`. Rows of the initializer
            matrix, a shortcut for `ev_option=EmbeddingVariableOption(
            init_option=InitializerOption(default_value_dim=...))`; with an
            `ev_option` it must agree with the option's. Defaults to `None`
            (the option's, 4096).
        num_shards: int in [1, 65536] or `None`. The table's lock shards,
            a shortcut for `EmbeddingVariableOption(num_shards=...)`; with
            an `ev_option` it must agree with the option's. Defaults to
            `None` (the option's, 32).
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
        if (isinstance(embedding_dim, bool) or not isinstance(embedding_dim, (int, np.integer))
                or embedding_dim <= 0):
            raise ValueError(
                "`embedding_dim` must be a positive integer. Received: "
                f"embedding_dim={embedding_dim!r}"
            )
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
            weights: None, or per-id weights of the ids' shape (and kind:
                dense, or under TensorFlow `tf.RaggedTensor` /
                `tf.SparseTensor`; needs a combiner): the combine is
                `sum(w * row)`, divided by `sum(w)` for "mean" and by
                `sqrt(sum(w**2))` for "sqrtn" (TensorFlow's
                `embedding_lookup_sparse` rule); a row whose denominator is
                0 gives zeros. With "mean" and "sqrtn" an id whose weight is
                <= 0 is dropped: never inserted, counted or updated
                (DeepRec's rule), which needs `prune_invalid_ids=True`;
                "sum" keeps it. Padding ids (< 0, with `prune_invalid_ids`)
                are dropped whatever their weight. The table's gradient is
                each id's share, `weight / denominator` times the output's
                gradient, summed over equal ids.
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
        """Applies the configured eviction (`GlobalStepEvict` /
        `L2WeightEvict`) now, as saving the model does; returns how many ids
        were evicted (0 without one).

        Args:
            step: int >= 0 or None. The current global step for
                `steps_to_live`; None uses the last step that updated this
                table.
        """
        self._require_built("evict()")
        return self.table.evict(check_int("step", step, 0, allow_none=True))

    def stats(self):
        """The table's statistics, a dict: `size` (admitted ids), `filtered`
        (counted, not admitted), `memory_bytes`, `latest_step`, `storage`
        ("DRAM" or "FILE"), the row store's `rows`, `cached_rows`,
        `cache_memory_bytes`, `disk_bytes`, `cache_hits`, `cache_misses`,
        `cache_hit_rate` (a float, 1.0 before any access), `file_reads` and
        `file_writes`."""
        self._require_built("stats()")
        return self.table.stats()

    @property
    def storage_dir(self):
        """The file tier's folder of the table (`storage_path/<name>_embeddings`,
        or a copy's folder beside a live table holding that one), or None
        (DRAM, or not built yet)."""
        return None if self.table is None else self.table.storage_dir

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
        return self.table.restore_snapshot(path)

    def export(self):
        """All ids as NumPy arrays, in DeepRec's format: `keys` [N], `values`
        [N, dim], `freqs` [N], `versions` [N] and `slots` {slot name: [N,
        width]} of admitted ids; `keys_filtered`, `freqs_filtered`,
        `versions_filtered` of ids counted by a filter but not admitted;
        `default_values` (the EV-initializer matrix) and `bloom` (a Bloom
        filter's counters)."""
        self._require_built("export()")
        return self.table.export()

    def import_(self, data):
        """Replaces the table's contents with `data` (shaped like
        `export()`'s result: `keys` and `values` required; `freqs`,
        `versions`, `slots` and the filtered parts optional)."""
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
        # Parts a file lacks (e.g. saved before a filter was configured, or
        # stripped of filtered ids) load as empty.
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
    """The layer's `EmbeddingVariableOption`, from `ev_option` (an option,
    its config or None) and the shortcuts `default_value_dim` and
    `num_shards` (None: the option's)."""
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
