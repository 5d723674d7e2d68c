"""The embedding table: a TensorFlow resource owning a C++ hash table.

Two objects with two roles:

* `EmbeddingTable` is a `TrackableResource`: `tf.train.Checkpoint` saves and
  restores its rows, slots, frequencies, versions and initializer matrix
  (`_serialize_to_tensors`), and `tf.saved_model.save` re-creates it in the
  exported graph and restores it there. It is what `EmbeddingVariable.table`
  is.
* `TableVariable` (`table.variable`) is its face as a trainable variable, the
  object in a layer's `trainable_weights`: `tf.GradientTape` watches it
  through `handle` (it has `_should_act_as_resource_variable`) and receives
  the lookup's gradient, a `tf.IndexedSlices` over keys, as `ResourceGather`
  gives one for a `tf.Variable`. The optimizers of `keras_rec_emb.optimizers`
  update it with one fused kernel; a stock Keras optimizer is refused with an
  error naming the fix. It is deliberately not trackable: TensorFlow saves
  objects that act as resource variables as variables, which a table is not.
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
_DEFAULTS = "default_values"


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

    def __init__(self, dim, key_dtype, default_values, num_shards=32,
                 trainable=True, name="embedding_table"):
        super().__init__()
        self._dim = int(dim)
        self._key_dtype = tf.as_dtype(key_dtype)
        self._num_shards = int(num_shards)
        self._trainable = bool(trainable)
        self._name = name
        self._kre_id = f"{name}/table_{next(_ids)}"
        self._variable = TableVariable(self)
        # Kept as NumPy: `_create_resource` also runs in export graphs, where
        # it must make its own constant (restoring then sets the current
        # matrix, which imports may have replaced).
        self._initial_default_values = np.asarray(default_values, np.float32)
        with tf.init_scope():
            self._resource_handle = self._create_resource()

    # -- TrackableResource ------------------------------------------------
    def _create_resource(self):
        return _ops.create_table(
            tf.constant(self._initial_default_values), self._key_dtype, self._dim,
            self._num_shards,
        )

    def _serialize_to_tensors(self):
        keys, values, freqs, versions, slots, names, widths, defaults = _ops.export(
            self.handle, self._key_dtype, self._dim
        )
        return {
            _KEYS: keys, _VALUES: values, _FREQS: freqs, _VERSIONS: versions,
            _SLOT_VALUES: slots, _SLOT_NAMES: names, _SLOT_WIDTHS: widths,
            _DEFAULTS: defaults,
        }

    def _restore_from_tensors(self, restored_tensors):
        t = restored_tensors
        return _ops.import_(
            self.handle, self._dim, t[_KEYS], t[_VALUES], t[_FREQS],
            t[_VERSIONS], t[_SLOT_VALUES], t[_SLOT_NAMES], t[_SLOT_WIDTHS],
            t[_DEFAULTS],
        )

    @property
    def handle(self):
        return self.resource_handle

    @property
    def variable(self):
        """The table as a trainable variable (see `TableVariable`)."""
        return self._variable

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
    def key_dtype(self):
        return self._key_dtype

    @property
    def dim(self):
        return self._dim

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

            tape_lib.variable_accessed(self._variable)
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
            `versions` [N], `slots` (a dict from slot name to [N, width]
            rows in the same key order) and `default_values`, the
            EV-initializer matrix [default_value_dim, dim] that rows of new
            keys are copied from.
        """
        keys, values, freqs, versions, slots, names, widths, defaults = (
            t.numpy() for t in _ops.export(self.handle, self._key_dtype, self._dim)
        )
        out = {_KEYS: keys, _VALUES: values, _FREQS: freqs, _VERSIONS: versions,
               "slots": {}, _DEFAULTS: defaults}
        start = 0
        for name, width in zip(names, widths):
            out["slots"][name.decode()] = slots[:, start:start + width]
            start += width
        return out

    def import_(self, data, clear=True):
        """Loads rows from a dict shaped like `export()`'s result.

        `freqs`, `versions`, `slots` and `default_values` may be missing
        (then zero / none / unchanged). With `clear=True` the table is
        emptied first.
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
        defaults = np.asarray(data.get(_DEFAULTS, np.zeros((0, self._dim))), np.float32)
        if defaults.ndim != 2 or defaults.shape[1] != self._dim:
            raise ValueError(
                f"`default_values` must have shape (rows, {self._dim}). "
                f"Received: {defaults.shape}"
            )
        _ops.import_(
            self.handle, self._dim, keys.astype(self._key_dtype.as_numpy_dtype),
            values, freqs, versions, slot_values,
            tf.constant(names, tf.string, shape=[len(names)]),
            np.array([b.shape[1] for b in blocks], np.int64), defaults, clear=clear,
        )


class TableVariable:
    """An `EmbeddingTable` seen as a trainable variable.

    It is what Keras lists in `trainable_weights`, what `tf.GradientTape`
    differentiates with respect to (through `handle`), and what optimizers
    receive with the table's `tf.IndexedSlices` gradient. Reach the table
    with `.table`.
    """

    # tf.GradientTape treats objects with this attribute as resource
    # variables and differentiates with respect to their `handle`.
    _should_act_as_resource_variable = True

    constraint = None
    overwrite_with_gradient = False
    regularizer = None

    def __init__(self, table):
        self._table = table

    @property
    def table(self):
        return self._table

    @property
    def handle(self):
        return self._table.resource_handle

    @property
    def trainable(self):
        return self._table.trainable

    @trainable.setter
    def trainable(self, value):
        self._table.trainable = value

    @property
    def name(self):
        return self._table.name

    @property
    def path(self):
        return self._table.name

    @property
    def dtype(self):
        return tf.float32

    @property
    def shape(self):
        """`(number of keys, dim)` when eager; `(None, dim)` while tracing."""
        if tf.executing_eagerly():
            return tf.TensorShape([self._table.size(), self._table.dim])
        return tf.TensorShape([None, self._table.dim])

    @property
    def _unique_id(self):
        # Read by stock Keras/TF optimizers (`_var_key`) when they are built
        # on a model's variables: the first point where they meet a table.
        raise TypeError(_STOCK_OPTIMIZER_ERROR.format(name=self.name))

    def _refuse_stock_update(self, *args, **kwargs):
        raise TypeError(_STOCK_OPTIMIZER_ERROR.format(name=self.name))

    assign = assign_add = assign_sub = _refuse_stock_update
    scatter_add = scatter_sub = scatter_update = _refuse_stock_update

    def numpy(self):
        """The rows, in the key order of `table.export()` (for `get_weights`)."""
        return self._table.export()["values"]

    def __repr__(self):
        return f"<TableVariable of {self._table!r}>"


def is_table(variable):
    """Whether `variable` is an embedding table's `TableVariable`."""
    return isinstance(variable, TableVariable)
