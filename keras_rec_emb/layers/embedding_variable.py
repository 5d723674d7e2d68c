"""EmbeddingVariable: an embedding layer backed by a dynamic hash table."""

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import variables
from keras_rec_emb.backend.tensorflow.checks import check_combiner, check_combiner_weights
from keras_rec_emb._checks_core import check_initializer_matrix
from keras_rec_emb.backend.tensorflow.ids import embed_ids, output_spec
from keras_rec_emb.ops import embedding_ops
from keras_rec_emb.backend.tensorflow.optimizer import table_optimizer
from keras_rec_emb.options import (EmbeddingVariableOption, deserialize_ev_option,
                                   ev_option_or_default)
from keras_rec_emb.backend.tensorflow.variables import check_restore_dim_mode, check_saved_dim

_KEY_DTYPES = ("int32", "int64")


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class EmbeddingVariable(keras.layers.Layer):
    """Embedding layer whose table grows as new ids arrive (DeepRec's EV).

    Ids index a collision-free hash table instead of a `[vocab, dim]` matrix:
    any int32/int64 id works (`10**15` as well as `3`), and memory grows
    with the number of distinct ids seen. A new id's row is a copy of row
    `id mod default_value_dim` of a matrix drawn once from `initializer`
    (DeepRec's EV Initializer).

    In training (`training=True`, as in `model.fit`) unseen ids are inserted
    and counted; in inference they read their initial row and the table is
    unchanged. `training=None` (what Keras passes to the layers of a
    subclassed model whose `call` takes no `training`) is training while a
    gradient tape records, as in `fit`, and inference otherwise. Train with
    an optimizer from `keras_rec_emb.optimizers`; the table's gradient is a
    `tf.IndexedSlices` over ids. `model.save`, `tf.train.Checkpoint` and
    `model.export` keep every row, the optimizer slots, frequencies and
    versions.

    A call looks its ids up at the call and returns a tensor, eagerly and
    in any `tf.function`. The layers of one Functional (or Sequential)
    model that read its inputs directly cost what one `GroupEmbedding`
    over their tables costs (with a combiner, or without one on dense
    ids): in a traced model call (`fit`, `evaluate`, `predict`, or the
    model called in a `tf.function`) they are looked up together in one
    fused op at the first of them (under `MultiWorkerMirroredStrategy`,
    one exchange), which is the same program (see
    `keras_rec_emb/backend/tensorflow/model_fusion.py`).

    Args:
        embedding_dim: int > 0. Width of each embedding row.
        initializer: Keras initializer for new rows (the EV-initializer
            matrix). Defaults to `"truncated_normal"`.
        key_dtype: `"int64"` or `"int32"`. Dtype of the table's keys; ids
            of the other integer dtype are cast. Defaults to `"int64"`.
        combiner: `None`, `"sum"`, `"mean"` or `"sqrtn"`. With a combiner,
            ids `[B, L]` (dense, `tf.RaggedTensor` or `tf.SparseTensor`) give
            `[B, embedding_dim]`, and empty rows give zeros. Defaults to
            `None`.
        prune_invalid_ids: bool. With a combiner, ids `< 0` are padding:
            dropped from the combine (a mean or sqrtn counts the kept ids
            only, a row with none gives zeros), never looked up, inserted
            or counted, as in DeepRec's `fused_safe_embedding_lookup_sparse`
            and `GroupEmbedding`. Ids padded with -1 (`[B, L]`) then need no
            conversion to ragged. `False` makes every id a key, -1 too.
            Needs a combiner. Defaults to `False`.
        ev_option: `keras_rec_emb.EmbeddingVariableOption` or `None`. Its
            eviction option also evicts when the model or a checkpoint is
            saved (DeepRec), in memory as well as in the file, logging the
            counts and warning when over half of the rows go; not with the
            option's `at_save=False` nor inside
            `keras_rec_emb.save_model(..., evict=False)`.
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
            (instance, name such as `"adagrad"`, or serialized config) that
            updates this table instead of the model's optimizer (keras-rs's
            `TableConfig(optimizer=...)`). Its learning rate (or schedule,
            read at the model optimizer's `iterations`) and hyper-parameters
            apply; its slots live in the table and are saved with it. The
            layer keeps its own copy. Gradient clipping, loss scaling and
            EMA belong to the model's optimizer: a table optimizer that sets
            them is refused. Defaults to `None` (the model's optimizer).
        **kwargs: other `keras.layers.Layer` arguments (e.g. `dtype`).

    Input shape:
        Integer ids of any shape; or `[B, None]` ragged/sparse ids with a
        combiner.

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
    >>> x = np.random.randint(0, 10**12, size=(64, 3))
    >>> y = np.random.randint(0, 2, size=(64, 1))
    >>> history = model.fit(x, y, epochs=1, verbose=0)
    >>> model.layers[1].table_size()
    192
    """

    def __init__(self, embedding_dim: int,
                 initializer: str | dict | keras.initializers.Initializer = "truncated_normal",
                 key_dtype: str | tf.dtypes.DType = "int64", combiner: str | None = None,
                 prune_invalid_ids: bool = False,
                 ev_option: EmbeddingVariableOption | None = None, trainable: bool = True,
                 name: str | None = None, restore_dim_mismatch: str = "error",
                 optimizer: keras.optimizers.Optimizer | None = None, **kwargs):
        super().__init__(trainable=trainable, name=name, **kwargs)
        # Our C++ ops have no XLA kernels: Keras's jit_compile="auto" then
        # chooses False, and True falls back to False with a warning.
        self.supports_jit = False
        if (isinstance(embedding_dim, bool) or not isinstance(embedding_dim, (int, np.integer))
                or embedding_dim <= 0):
            raise ValueError(
                "`embedding_dim` must be a positive integer. Received: "
                f"embedding_dim={embedding_dim!r}"
            )
        key_dtype = tf.as_dtype(key_dtype).name if isinstance(key_dtype, tf.DType) else key_dtype
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
        ev_option = ev_option_or_default(ev_option)
        self.embedding_dim = int(embedding_dim)
        self.initializer = keras.initializers.get(initializer)
        self.key_dtype = key_dtype
        self.combiner = combiner
        self.prune_invalid_ids = bool(prune_invalid_ids)
        self.ev_option = ev_option
        self.restore_dim_mismatch = check_restore_dim_mode(restore_dim_mismatch)
        self.table_optimizer = table_optimizer(optimizer)
        self.table = None

    def build(self, input_shape=None):
        if self.built:
            return
        init_option = self.ev_option.init_option
        initializer = init_option.initializer or self.initializer
        check_initializer_matrix(self.name, init_option.default_value_dim, self.embedding_dim)
        # Keras builds a layer lazily inside the traced first step of `fit`
        # (and `model.build(shape)` / a Sequential without `keras.Input`
        # build it symbolically): the matrix is drawn eagerly, once, outside
        # any graph, as the table it initializes is created (`init_scope`).
        with tf.init_scope():
            default_values = keras.ops.convert_to_numpy(initializer(
                shape=(init_option.default_value_dim, self.embedding_dim), dtype="float32"))
        from keras_rec_emb.distribute import placement

        # Under `keras_rec_emb.distribute.parameter_servers(...)` the table is
        # sharded over the parameter-server tasks, in a MirroredStrategy's or
        # MultiWorkerMirroredStrategy's scope over its replicas; otherwise
        # one local table (`placement.make_table` decides).
        self.table = placement.make_table(
            self.embedding_dim, self.key_dtype, default_values, trainable=self.trainable,
            name=f"{self.name}/embeddings", restore_dim_mismatch=self.restore_dim_mismatch,
            **self.ev_option.table_kwargs(),
        )
        self.table.optimizer = self.table_optimizer
        for variable in self.table.variables:
            # (A distributed table's variables are its shards' tables.)
            variable.table.optimizer = self.table_optimizer
            _compat.track_variable(self, variable)
        self.built = True

    @property
    def ids_input_dtype(self):
        """`key_dtype`: the dtype of the `keras.Input` a `keras.Sequential`
        without one makes for this layer (Keras would make it float32)."""
        return self.key_dtype

    @property
    def trainable(self):
        return super().trainable

    @trainable.setter
    def trainable(self, value):
        keras.layers.Layer.trainable.fset(self, value)
        if getattr(self, "table", None) is not None:
            self.table.trainable = value

    # -- forward --------------------------------------------------------------
    def _lookup(self, ids, training):
        rows = self.table.lookup(ids, insert=bool(training) and self.trainable)
        if self.compute_dtype != "float32":
            rows = tf.cast(rows, self.compute_dtype)
        return rows

    def call(self, inputs, weights=None, training=None):
        """Rows of `inputs` (ids), combined over their last axis with a combiner.

        Args:
            inputs: integer ids (see the class).
            weights: None, or per-id weights of the ids' shape and kind
                (dense, `tf.RaggedTensor` or `tf.SparseTensor`; needs a
                combiner): the combine is `sum(w * row)`, divided by
                `sum(w)` for "mean" and by `sqrt(sum(w**2))` for "sqrtn"
                (TensorFlow's `embedding_lookup_sparse` rule); a row whose
                denominator is 0 gives zeros. With "mean" and "sqrtn" an id
                whose weight is <= 0 is dropped: never inserted, counted or
                updated, which needs `prune_invalid_ids=True` (as under the
                JAX backend); "sum" keeps it. Padding ids (< 0, with
                `prune_invalid_ids`) are dropped whatever their weight.
            training: bool or None.

        Example:

        >>> layer = keras_rec_emb.layers.EmbeddingVariable(
        ...     2, combiner="mean", prune_invalid_ids=True, initializer="ones")
        >>> layer(np.array([[1, 2, -1]]), weights=np.array([[1.0, 3.0, 5.0]])).numpy()
        array([[1., 1.]], dtype=float32)
        """
        training = _compat.resolve_training(training)
        if weights is None:
            # One of the layers of a Functional model call looked up together.
            rows = embedding_ops.model_call_rows(self, inputs, training)
            if rows is not None:
                return rows
        else:
            weights = self._checked_weights(inputs, weights)
        if self.combiner is not None:
            # A group of one: the fused lookup looks up and combines in one op
            # (its gradient over distinct keys), as GroupEmbedding does.
            return embedding_ops.pooled_layer_lookup(self, inputs, training, weights)
        return embed_ids(self, inputs, lambda ids, _: self._lookup(ids, training),
                         None, key_dtype=tf.as_dtype(self.key_dtype))

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if self.combiner is not None:
            return input_shape[:-1] + (self.embedding_dim,)
        return input_shape + (self.embedding_dim,)

    def compute_output_spec(self, inputs, weights=None, training=None):
        return output_spec(self, inputs, self.embedding_dim, self.combiner)

    def _checked_weights(self, ids, weights):
        """`weights` as float32 of the ids' kind, after the JAX layer's checks."""
        dtype = getattr(weights, "dtype", None)
        if dtype is not None:
            dtype = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
        check_combiner_weights(self.name, self.combiner, self.prune_invalid_ids, dtype)
        kinds = (tf.RaggedTensor, tf.SparseTensor)
        kind = next((k for k in kinds if isinstance(ids, k)), None)
        if kind is not None or isinstance(weights, kinds):
            if not isinstance(weights, kind or ()):
                raise TypeError(
                    f"EmbeddingVariable '{self.name}': `weights` must be of the ids' kind "
                    f"({'dense' if kind is None else kind.__name__}). Received: weights of "
                    f"type {type(weights).__name__}")
            return tf.cast(weights, tf.float32) if kind is tf.RaggedTensor else (
                tf.SparseTensor(weights.indices, tf.cast(weights.values, tf.float32),
                                weights.dense_shape))
        weights = tf.convert_to_tensor(weights)
        weights = tf.cast(weights, tf.float32)
        ids_shape = tf.TensorShape(getattr(ids, "shape", np.shape(ids)))
        if not ids_shape.is_compatible_with(weights.shape):
            raise ValueError(
                f"EmbeddingVariable '{self.name}': `weights` must have the ids' shape "
                f"{tuple(ids_shape)} (one weight per id). Received: weights of shape "
                f"{tuple(weights.shape)}")
        return weights

    count_params = variables.count_params  # tables count (ids admitted) x dim

    # -- table access ---------------------------------------------------------
    def _require_built(self, what):
        if self.table is None:
            raise ValueError(
                f"EmbeddingVariable '{self.name}' is not built yet; call it on "
                f"ids (or build it) before {what}."
            )

    def _table_for_lookup(self):
        """The table, built if need be (for the functional ops' `params`)."""
        if self.table is None:
            self.build()
        return self.table

    def table_size(self):
        """Number of distinct ids admitted to the table."""
        self._require_built("table_size()")
        return self.table.size()

    def evict(self, step=None):
        """Applies the configured eviction (`GlobalStepEvict` /
        `L2WeightEvict`) now; returns how many ids were evicted.

        Args:
            step: int or None. The current global step; None uses the last
                optimizer step that updated this table.
        """
        self._require_built("evict()")
        return self.table.evict(step)

    def stats(self):
        """The table's statistics (see `EmbeddingTable.stats`): keys, DRAM
        bytes, and for the file tier rows in cache / on file, cache hit
        rate, bytes on disk, rows read from and written to files."""
        self._require_built("stats()")
        return self.table.stats()

    @property
    def storage_dir(self):
        """The file tier's folder of the table (`storage_path/<name>_embeddings`,
        or a copy's folder beside a live table holding that one), or None
        (DRAM); the JAX layer's property of the same name."""
        self._require_built("storage_dir")
        return self.table.storage_dir

    def snapshot(self):
        """File tier (`StorageOption("FILE", ...)`): writes a crash-safe
        snapshot of the table's files under `storage_dir` without
        passing rows through Python; returns the snapshot's number."""
        self._require_built("snapshot()")
        return self.table.snapshot()

    def restore_snapshot(self, path=None):
        """File tier: replaces the table's contents with its latest snapshot
        (under `path`, default `table.storage_dir`); returns the number of
        ids. A corrupt or truncated snapshot raises naming the file."""
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
        `export()`'s result; `freqs`, `versions` and `slots` optional)."""
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
        for key in variables.ARRAY_PARTS:
            if key in data:
                store[key] = data[key]
        for name, values in data["slots"].items():
            store[f"slot:{name}"] = values

    def load_own_variables(self, store):
        if self.table is None:
            self.build()
        names = list(store.keys())
        # Parts a file lacks (e.g. saved before a filter was configured, or
        # stripped of filtered ids) load as empty.
        data = {key: np.asarray(store[key]) for key in variables.ARRAY_PARTS if key in names}
        data["slots"] = {n[len("slot:"):]: np.asarray(store[n]) for n in names
                         if n.startswith("slot:")}
        if "values" in data and check_saved_dim(self.table.name, data["values"].shape,
                                                self.table.dim, self.restore_dim_mismatch):
            data["values"], data["slots"] = self.table.resize_rows(
                data.get("keys", np.zeros(0, np.int64)), data["values"], data["slots"])
            data.pop("default_values", None)  # the table keeps its own initializer
        self.table.import_(data)

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
        return cls(**deserialize_ev_option(config))


# The Functional-model fusion recognises this class's own calls.
embedding_ops.register_layer_class(EmbeddingVariable)
