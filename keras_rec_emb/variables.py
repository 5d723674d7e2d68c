"""The embedding-table variable: a TensorFlow resource owning a C++ hash table.

`EmbeddingTable` is what an `EmbeddingVariable` layer adds to its weights. It
behaves as a trainable variable where Keras and TensorFlow need one:

* `tf.GradientTape` watches it through `handle` (it has
  `_should_act_as_resource_variable`), and the lookup op's registered gradient
  gives it a `tf.IndexedSlices` over keys, like `ResourceGather` does for a
  `tf.Variable`;
* it is a `TrackableResource`, so `tf.train.Checkpoint` saves and restores its
  rows, slots, frequencies and versions (`_serialize_to_tensors`), and
  `tf.saved_model.save` re-creates it in the exported graph;
* the optimizers of `keras_rec_emb.optimizers` recognize it and update it with
  one fused kernel; a stock Keras optimizer is refused with an error naming
  the fix.
"""

import itertools

import numpy as np
import tensorflow as tf

from keras_rec_emb import _ops

_ids = itertools.count()

_STOCK_OPTIMIZER_ERROR = (
    "Embedding table '{name}' is a dynamic hash table and cannot be updated by "
    "a stock Keras optimizer. Compile the model with an optimizer from "
    "`keras_rec_emb.optimizers` (SGD, Adagrad, Adam, Ftrl, ...), which update "
    "dense variables exactly as Keras does and tables with a fused sparse "
    "kernel."
)

# Checkpoint tensor names (see DESIGN.md, "Saving").
_KEYS, _VALUES, _FREQS, _VERSIONS = "keys", "values", "freqs", "versions"
_SLOT_VALUES, _SLOT_NAMES, _SLOT_WIDTHS = "slot_values", "slot_names", "slot_widths"


class EmbeddingTable(tf.saved_model.experimental.TrackableResource):
    """A dynamic hash table from integer keys to float32 rows of width `dim`.

    Users normally reach it as `EmbeddingVariable(...).table`.

    Args:
        dim: int. Width of each row.
        key_dtype: `"int64"` or `"int32"`.
        default_values: float array `[default_value_dim, dim]`. A new key `k`
            starts as row `k mod default_value_dim` (DeepRec's EV Initializer).
        num_shards: int, a power of two. Index shards, each with its own lock.
        trainable: bool. Whether gradient tapes watch the table.
        name: str. Name used in errors, saving and `path`.
    """

    # tf.GradientTape treats objects with this attribute as resource
    # variables and differentiates with respect to their `handle`.
    _should_act_as_resource_variable = True

    def __init__(self, dim, key_dtype, default_values, num_shards=32,
                 trainable=True, name="embedding_table"):
        super().__init__()
        self._dim = int(dim)
        self._key_dtype = tf.as_dtype(key_dtype)
        self._num_shards = int(num_shards)
        self._trainable = bool(trainable)
        self._name = name
        self._kre_id = f"{name}/table_{next(_ids)}"
        with tf.init_scope():
            self._default_values = tf.constant(default_values, tf.float32)
            self._resource_handle = self._create_resource()

    # -- TrackableResource ------------------------------------------------
    def _create_resource(self):
        return _ops.create_table(
            self._default_values, self._key_dtype, self._dim, self._num_shards
        )

    def _serialize_to_tensors(self):
        keys, values, freqs, versions, slots, names, widths = _ops.export(
            self.handle, self._key_dtype, self._dim
        )
        return {
            _KEYS: keys, _VALUES: values, _FREQS: freqs, _VERSIONS: versions,
            _SLOT_VALUES: slots, _SLOT_NAMES: names, _SLOT_WIDTHS: widths,
        }

    def _restore_from_tensors(self, restored_tensors):
        t = restored_tensors
        return _ops.import_(
            self.handle, self._dim, t[_KEYS], t[_VALUES], t[_FREQS],
            t[_VERSIONS], t[_SLOT_VALUES], t[_SLOT_NAMES], t[_SLOT_WIDTHS],
        )

    # -- What Keras and tf.GradientTape read of a variable -----------------
    @property
    def handle(self):
        return self.resource_handle

    @property
    def trainable(self):
        return self._trainable

    @trainable.setter
    def trainable(self, value):
        self._trainable = bool(value)

    @property
    def name(self):
        return self._name

    @property
    def path(self):
        return self._name

    @property
    def _shared_name(self):
        # The checkpointer records it as the "full name" of variable-like
        # objects (for name-based checkpoint compatibility).
        return self._name

    @property
    def dtype(self):
        return tf.float32

    @property
    def key_dtype(self):
        return self._key_dtype

    @property
    def dim(self):
        return self._dim

    @property
    def shape(self):
        """`(number of keys, dim)` when eager; `(None, dim)` while tracing."""
        if tf.executing_eagerly():
            return tf.TensorShape([self.size(), self._dim])
        return tf.TensorShape([None, self._dim])

    constraint = None
    overwrite_with_gradient = False
    regularizer = None

    @property
    def _unique_id(self):
        # Read by stock Keras/TF optimizers (`_var_key`) when they are built
        # on a model's variables: the first point where they meet a table.
        raise TypeError(_STOCK_OPTIMIZER_ERROR.format(name=self._name))

    def _refuse_stock_update(self, *args, **kwargs):
        raise TypeError(_STOCK_OPTIMIZER_ERROR.format(name=self._name))

    assign = assign_add = assign_sub = _refuse_stock_update
    scatter_add = scatter_sub = scatter_update = _refuse_stock_update

    def numpy(self):
        """The rows, in the key order of `export()` (for `get_weights`)."""
        return self.export()["values"]

    def __repr__(self):
        return (f"<EmbeddingTable '{self._name}' key_dtype={self._key_dtype.name} "
                f"dim={self._dim}>")

    # -- Table operations ---------------------------------------------------
    def lookup(self, keys, insert=False):
        """Rows of `keys` (any shape) as `keys.shape + (dim,)`.

        With `insert=True` (training) missing keys are inserted with their
        initializer row and counted; with `insert=False` (inference) they
        read that row and the table is unchanged. A watching gradient tape
        records the access either way.
        """
        if self._trainable:
            from tensorflow.python.eager import tape as tape_lib

            tape_lib.variable_accessed(self)
        return _ops.lookup(self.handle, keys, self._dim, insert)

    def size(self):
        """Number of keys in the table (an int when eager)."""
        n = _ops.size(self.handle, self._key_dtype)
        return int(n) if tf.executing_eagerly() else n

    def memory_bytes(self):
        """Bytes held by the table (index, rows, slots, metadata)."""
        n = _ops.memory_bytes(self.handle, self._key_dtype)
        return int(n) if tf.executing_eagerly() else n

    def add_slot(self, name, init=0.0, width=None):
        """Adds optimizer slot `name` (width `dim` unless given) or updates
        the init value of an existing one for rows created from now on."""
        _ops.add_slot(self.handle, self._key_dtype, name,
                      self._dim if width is None else int(width), float(init))

    def export(self):
        """All rows as NumPy arrays (DeepRec's export format).

        Returns:
            dict with `keys` [N], `values` [N, dim], `freqs` [N],
            `versions` [N] and `slots`, a dict from slot name to [N, width]
            rows in the same key order.
        """
        keys, values, freqs, versions, slots, names, widths = (
            t.numpy() for t in _ops.export(self.handle, self._key_dtype, self._dim)
        )
        out = {_KEYS: keys, _VALUES: values, _FREQS: freqs, _VERSIONS: versions,
               "slots": {}}
        start = 0
        for name, width in zip(names, widths):
            out["slots"][name.decode()] = slots[:, start:start + width]
            start += width
        return out

    def import_(self, data, clear=True):
        """Loads rows from a dict shaped like `export()`'s result.

        `freqs`, `versions` and `slots` may be missing (then zero / none).
        With `clear=True` the table is emptied first.
        """
        if not isinstance(data, dict) or _KEYS not in data or _VALUES not in data:
            raise ValueError(
                "`data` must be a dict with at least 'keys' [N] and 'values' "
                f"[N, {self._dim}] (as returned by export()). Received: "
                f"{type(data).__name__} with keys "
                f"{sorted(data) if isinstance(data, dict) else None}"
            )
        keys = np.asarray(data[_KEYS])
        if not np.issubdtype(keys.dtype, np.integer):
            raise TypeError(
                f"`keys` must be integers. Received dtype {keys.dtype}"
            )
        n = keys.shape[0]
        values = np.asarray(data[_VALUES], np.float32)
        if values.shape != (n, self._dim):
            raise ValueError(
                f"`values` must have shape ({n}, {self._dim}). Received: "
                f"{values.shape}"
            )
        freqs = np.asarray(data.get(_FREQS, np.zeros(n)), np.int64)
        versions = np.asarray(data.get(_VERSIONS, np.zeros(n)), np.int64)
        slots = data.get("slots") or {}
        names = list(slots)
        blocks = [np.asarray(slots[s], np.float32).reshape(n, -1) for s in names]
        slot_values = (np.concatenate(blocks, axis=1) if blocks
                       else np.zeros((n, 0), np.float32))
        _ops.import_(
            self.handle, self._dim, keys.astype(self._key_dtype.as_numpy_dtype),
            values, freqs, versions, slot_values,
            tf.constant(names, tf.string, shape=[len(names)]),
            np.array([b.shape[1] for b in blocks], np.int64), clear=clear,
        )


def is_table(variable):
    """Whether `variable` is an embedding table (not a dense variable)."""
    return isinstance(variable, EmbeddingTable)
