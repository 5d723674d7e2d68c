"""The embedding table: a TensorFlow resource owning a C++ hash table.

* `EmbeddingTable` (`EmbeddingVariable.table`) is a `TrackableResource`:
  checkpoints save its parts, SavedModels re-create it.
* `TableVariable` (`table.variable`) is its face as a trainable variable,
  whose gradient is an `IndexedSlices` over keys. It is not trackable:
  TensorFlow would save it as a variable, which a table is not.
"""

import itertools
import uuid
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb import _file_tier
from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context
from keras_rec_emb import tables as _tables
from keras_rec_emb.backend.tensorflow.checks import keys_in_range
from keras_rec_emb.options import GlobalStepEvict, L2WeightEvict

_ids = itertools.count()


# -- The table's parts --------------------------------------------------------
# What a checkpoint, `export()` and `import_()` hold, named and ordered as
# KRE>TableExport's outputs and KRE>TableImport's inputs (tests/test_variables.py
# checks the op definitions against this list). `rows`: "N" one entry per
# admitted key, "F" one per key counted but not admitted, None a length of its
# own. `slot` parts are packed slot columns (`export()` unpacks them as
# `slots`); `filtered` parts are an admission filter's (`save_filtered=False`
# and `keras-rec-emb strip-filtered` drop them).
class Part(NamedTuple):
    name: str
    dtype: str
    shape: str
    rows: str = None
    slot: bool = False
    filtered: bool = False


PARTS = (
    Part("keys", "key", "[N]", rows="N"),
    Part("values", "float32", "[N, dim]", rows="N"),
    Part("freqs", "int64", "[N]", rows="N"),
    Part("versions", "int64", "[N]", rows="N"),
    Part("slot_values", "float32", "[N, sum of slot widths]", rows="N", slot=True),
    Part("slot_names", "string", "[slots]", slot=True),
    Part("slot_widths", "int64", "[slots]", slot=True),
    Part("default_values", "float32", "[initializer rows, dim]"),
    Part("keys_filtered", "key", "[F]", rows="F", filtered=True),
    Part("freqs_filtered", "int64", "[F]", rows="F", filtered=True),
    Part("versions_filtered", "int64", "[F]", rows="F", filtered=True),
    Part("bloom", "uint8", "[counter bytes]", filtered=True),
)
PART_NAMES = tuple(p.name for p in PARTS)
# Saved one array each (a `.keras` file also holds one `slot:NAME` per slot).
ARRAY_PARTS = tuple(p.name for p in PARTS if not p.slot)
FILTERED_PARTS = tuple(p.name for p in PARTS if p.filtered)
_KEYS, _VALUES = "keys", "values"


def complete_parts(given, dim, key_dtype):
    """`given` completed with zeros for its `len(keys)` keys, in
    `PART_NAMES` order; eager or traced."""
    key_dtype = tf.as_dtype(key_dtype)
    n = tf.size(given[_KEYS]) if _KEYS in given else 0
    out = {}
    for part in PARTS:
        if part.name in given:
            out[part.name] = given[part.name]
            continue
        dtype = key_dtype if part.dtype == "key" else tf.as_dtype(part.dtype)
        shape = {"slot_values": [n, 0], "default_values": [0, dim], _VALUES: [n, dim]}.get(
            part.name, [n] if part.rows == "N" else [0])
        out[part.name] = tf.zeros(shape, dtype)
    return out


def unpack_slots(parts):
    """{slot name: [N, width] columns} of packed `slot_*` parts (NumPy)."""
    slots, start = {}, 0
    for name, width in zip(parts["slot_names"], parts["slot_widths"]):
        name = name.decode() if isinstance(name, bytes) else str(name)
        slots[name] = parts["slot_values"][:, start:start + int(width)]
        start += int(width)
    return slots


def pack_slots(blocks, n):
    """The `slot_*` parts of {slot name: float32 [n, width] block}."""
    values = list(blocks.values())
    return {
        "slot_values": (np.concatenate(values, axis=1) if values
                        else np.zeros((n, 0), np.float32)),
        "slot_names": tf.constant(list(blocks), tf.string, shape=[len(blocks)]),
        "slot_widths": np.array([b.shape[1] for b in values], np.int64),
    }


def exported(parts):
    """`export()`'s dict (NumPy, slots unpacked) of eager parts."""
    parts = {k: v.numpy() for k, v in parts.items()}
    out = {k: parts[k] for k in ARRAY_PARTS}
    out["slots"] = unpack_slots(parts)
    return out

_STOCK_OPTIMIZER_ERROR = (
    "Embedding table '{name}' is a dynamic hash table and cannot be updated by "
    "a stock Keras optimizer. Compile the model with an optimizer from "
    "`keras_rec_emb.optimizers` (SGD, Adagrad, Adam, Ftrl, ...), which update "
    "dense variables exactly as Keras does and tables with a fused sparse "
    "kernel."
)

_STOCK_WRAPPER_ERROR = (
    "Embedding table '{name}' is updated by keras_rec_emb.optimizers.{ours}, "
    "but a stock Keras optimizer wrapper around it (such as "
    "keras.optimizers.LossScaleOptimizer) cannot handle a table's gradient: "
    "compile with "
    "`optimizer=keras_rec_emb.optimizers.LossScaleOptimizer({ours}(...))` "
    "instead (under 'mixed_float16', `compile(optimizer={ours}(...))` wraps "
    "it so by itself)."
)

class EmbeddingTable(_tables.TableBase, tf.saved_model.experimental.TrackableResource):
    """A dynamic hash table from integer keys to float32 rows of width `dim`.

    Users normally reach it as `EmbeddingVariable(...).table`; the layer maps
    its `EmbeddingVariableOption` to these arguments.

    Args:
        dim: int. Width of each row.
        key_dtype: `"int64"` or `"int32"`.
        default_values: float array `[default_value_dim, dim]`. A new key `k`
            starts as row `k mod default_value_dim` (DeepRec's EV Initializer).
        num_shards: int in [1, 65536]. Index shards, each with its own lock.
        trainable: bool. Whether gradient tapes watch the table.
        name: str. Name used in errors, saving and `path`.
        track_meta: bool. Keep per-key frequency and version.
        filter_freq: int. Admission threshold (counter filter, or the
            Bloom filter's when `bloom` is given); <= 1 admits every key.
        bloom: `(counters, hashes, counter_bytes)` of a counting Bloom filter,
            or None.
        no_permission_value: float. What keys not admitted yet read.
        record_freq: bool. As `EmbeddingVariableOption(record_freq=...)`
            (`False` stops an admitted key's frequency at `filter_freq`).
        steps_to_live: int or None. Global-step eviction threshold.
        l2_weight_threshold: float or None. L2-weight eviction threshold.
        evict_at_save: bool. Evict (by the rules above) when a checkpoint or
            the model is saved (DeepRec); `False` evicts only on `evict()`.
        save_filtered: bool. Save keys counted but not admitted (also off
            when `KRE_EV_SAVE_FILTERED_FEATURES=false`).
        restore_dim_mismatch: `"error"` or `"pad_or_truncate"`, as
            `EmbeddingVariable(restore_dim_mismatch=...)`; the table keeps
            its own initializer matrix.
        storage_path: str or None. The file tier's folder (rows under
            `storage_path/<name>`; see docs/file_tier.md); None: DRAM.
        cache_bytes: int. DRAM cache bytes of the file tier.

    Subclasses (the shards of `keras_rec_emb.distribute`) override
    `_placement`, `_refuse_strategy` and `sparse_apply`.
    """

    # The optimizer of `EmbeddingVariable(optimizer=...)`, set by the layer;
    # `_table_optimizer`: the class name of the optimizer built on the table
    # (a stock wrapper around it then gets a precise error).
    optimizer = None
    _table_optimizer = None
    _kind = "EmbeddingTable"
    def _placement(self):
        """(device, shared_name): here a private table on the current device."""
        return "", ""

    def _refuse_strategy(self, what):
        """Under a strategy each replica would silently train its own copy."""
        _ops.refuse_distribution(what)

    def __init__(self, dim, key_dtype, default_values, num_shards=32,
                 trainable=True, name="embedding_table", track_meta=True,
                 filter_freq=0, bloom=None, no_permission_value=0.0,
                 steps_to_live=None, l2_weight_threshold=None, save_filtered=True,
                 restore_dim_mismatch="error", record_freq=True, storage_path=None,
                 cache_bytes=64 << 20, evict_at_save=True):
        device, shared_name = self._placement()
        super().__init__(device=device)
        if storage_path is not None:  # one folder per table, named after it
            self._storage_dir = _file_tier.table_folder(storage_path, name)
        self._cache_bytes = int(cache_bytes)
        self._shared_name = str(shared_name)
        self._restore_dim_mismatch = _tables.check_restore_dim_mode(restore_dim_mismatch)
        self._slot_inits = {}
        self._dim = int(dim)
        self._key_dtype = tf.as_dtype(key_dtype)
        self._num_shards = int(num_shards)
        self._trainable = bool(trainable)
        self._name = name
        self._track_meta = bool(track_meta)
        self._filter_freq = int(filter_freq)
        self._bloom = None if bloom is None else tuple(int(b) for b in bloom)
        self._no_permission_value = float(no_permission_value)
        self._record_freq = bool(record_freq)
        self._steps_to_live = -1 if steps_to_live is None else int(steps_to_live)
        self._l2_threshold = -1.0 if l2_weight_threshold is None else float(l2_weight_threshold)
        self._save_filtered = bool(save_filtered)
        self._evict_at_save = bool(evict_at_save)
        self._kre_id = f"{name}/table_{next(_ids)}"
        self._variable = TableVariable(self)
        # Kept as NumPy: `_create_resource` also runs in export graphs, where
        # it must make its own constant (restoring then sets the current
        # matrix, which imports may have replaced).
        self._initial_default_values = np.asarray(default_values, np.float32)
        with tf.init_scope(), tf.device(device):
            try:
                self._resource_handle = self._create_resource()
            except tf.errors.InvalidArgumentError:
                # (A table found by name is shared: it never works in a copy.)
                if self._shared_name or not self._takes_copy_folder():
                    raise
                self._resource_handle = self._create_resource()

    # -- TrackableResource ------------------------------------------------
    def _create_resource(self):
        storage_path = self._copy_dir or self._storage_dir or ""
        shared_name = self._shared_name
        if not tf.executing_eagerly():
            # Traced into a SavedModel (`model.export`). The loaded copy keeps
            # its rows in DRAM: a folder fixed at export would be the
            # trainer's, whose lock a server cannot take while the trainer
            # lives, nor two versions loaded in one process.
            storage_path = ""
            if not shared_name and not tf.inside_function():
                # A Session runs the create op at every `run`: a private
                # table would be a new, empty one each time, after the
                # restore filled another. A name makes it one per Session.
                shared_name = f"kre_saved_model/{uuid.uuid4().hex}"
        self._refuse_strategy("Creating an embedding table")
        return _ops.create_table(
            tf.constant(self._initial_default_values), self._key_dtype, self._dim,
            self._num_shards, track_meta=self._track_meta, filter_freq=self._filter_freq,
            bloom=self._bloom, no_permission_value=self._no_permission_value,
            freq_cap=_tables.freq_cap(self._record_freq, self._filter_freq),
            storage_path=storage_path, cache_bytes=self._cache_bytes,
            shared_name=shared_name,
        )

    def _destroy_resource(self):
        # The folder lock goes with the Python table (the C++ resource may
        # outlive it in TensorFlow's function caches), so that a reloaded
        # model can take the folder. Eager only: SavedModels must not need the op.
        if self._storage_dir is not None and tf.executing_eagerly():
            _ops.release_storage(self._resource_handle, self._key_dtype)

    def _serialize_to_tensors(self):
        # DeepRec evicts when a checkpoint is saved (an eager save reports
        # what it evicted). Every part is present, possibly empty, so that
        # checkpoints of tables with and without filters restore into each other.
        eager = tf.executing_eagerly()
        if eager:
            self.evict_for_save()
        return self._export_parts(self.save_filtered, evict=not eager)

    def _restore_from_tensors(self, restored_tensors):
        values = restored_tensors.get(_VALUES)
        if values is not None and _tables.check_saved_dim(self._name, values.shape, self._dim,
                                                          self._restore_dim_mismatch):
            restored_tensors = self._resized_parts(restored_tensors)
        return self._import_parts(restored_tensors)

    def _export_parts(self, include_filtered=True, evict=False):
        """The parts as tensors; `evict`: after a save's eviction op."""
        with tf.control_dependencies([self._evict_op()] if evict and self.evicts_at_save else []):
            return _ops.export(self.handle, self._key_dtype, self._dim, include_filtered)

    def _import_parts(self, parts, clear=True):
        """Every part, checked by the kernel; non-empty `default_values`
        replaces the initializer matrix."""
        return _ops.import_(self.handle, self._dim, {name: parts[name] for name in PART_NAMES},
                            clear=clear)

    def _resized_parts(self, parts):
        if not tf.executing_eagerly():
            raise ValueError(
                f"Embedding table '{self._name}' restores rows of another width "
                "(restore_dim_mismatch='pad_or_truncate') only eagerly, e.g. "
                "tf.train.Checkpoint(...).read(path) outside tf.function."
            )
        parts = {k: (v.numpy() if hasattr(v, "numpy") else np.asarray(v))
                 for k, v in parts.items()}
        n = parts[_VALUES].shape[0]
        parts[_VALUES], slots = self.resize_rows(parts[_KEYS], parts[_VALUES],
                                                 unpack_slots(parts))
        parts.update(pack_slots(slots, n))
        parts["default_values"] = np.zeros((0, self._dim), np.float32)
        return parts

    handle = _tables.attribute("resource_handle")
    variable = _tables.attribute("_variable", "The table as a trainable variable (see "
                                 "`TableVariable`).")
    device = _tables.attribute("resource_handle.device", "The device holding the table.")

    @property
    def variables(self):
        """`[variable]`: what a layer tracks (a sharded table has one per shard)."""
        return [self._variable]

    local = _tables.constant(
        True, "True: the whole table is this one C++ table (`tables.Table.local`).")
    fused_table = property(lambda self: self, doc="Itself (`tables.Table.fused_table`).")
    exchange_group = _tables.constant(
        None, "None: lookups exchange nothing (`tables.Table.exchange_group`).")

    lookup_many = staticmethod(_tables.lookup_each)

    @property
    def filters(self):
        """Whether an admission filter (counter or Bloom) is configured."""
        return self._filter_freq > 1 or self._bloom is not None

    @property
    def no_permission_value(self):
        """What keys not admitted yet read."""
        return self._no_permission_value

    @property
    def eviction_rule(self):
        """The eviction option this table was built from (for messages)."""
        if self._steps_to_live >= 0:
            return GlobalStepEvict(self._steps_to_live, at_save=self._evict_at_save)
        if self._l2_threshold >= 0:
            return L2WeightEvict(self._l2_threshold, at_save=self._evict_at_save)
        return None

    # -- Table operations ---------------------------------------------------
    @_serving_context.served
    def lookup(self, keys, insert=False):
        """Rows of `keys` (any shape) as `keys.shape + (dim,)`.

        With `insert=True` (training) every occurrence is counted, unseen
        keys get their initializer row once admitted, and keys not admitted
        read `no_permission_value`; with `insert=False` (inference) the table
        is unchanged. A watching gradient tape records the access either way.
        """
        if self._trainable:
            _compat.variable_accessed(self._variable)
        self._refuse_strategy("An embedding table lookup")
        return _ops.lookup(self.handle, keys, self._dim, insert)

    def lookup_counted(self, keys, counts, insert=False):
        """Rows `[n, dim]` of `keys` `[n]`, each standing for `counts[i]`
        occurrences, counted as `lookup` of every occurrence would; a key
        given twice is looked up once with its counts summed."""
        if self._trainable:
            _compat.variable_accessed(self._variable)
        self._refuse_strategy("An embedding table lookup")
        return _ops.lookup_counted(self.handle, keys, counts, self._dim, insert)

    def sparse_apply(self, keys, grads, rule, hyper, step, slots, distinct=False):
        """One fused optimizer step on the rows of `keys` (`_ops.sparse_apply`)."""
        self._refuse_strategy("An embedding table update")
        _ops.sparse_apply(self.handle, keys, grads, rule, hyper, step, slots, distinct=distinct)

    def size(self):
        """Number of admitted keys (an int when eager)."""
        n = _ops.size(self.handle, self._key_dtype)
        return int(n) if tf.executing_eagerly() else n

    def stats(self):
        """The statistics `EmbeddingVariable.stats` lists."""
        out = {k: int(v) for k, v in _ops.stats(self.handle, self._key_dtype).items()}
        out.update((k, int(v)) for k, v in
                   _ops.storage_stats(self.handle, self._key_dtype).items())
        return self._with_storage(out)

    def _snapshot(self):
        return int(_ops.snapshot(self.handle, self._key_dtype))

    def _restore_snapshot(self, path):
        return int(_ops.restore_snapshot(self.handle, self._key_dtype, path))

    def _evict_op(self, step=None):
        return _ops.evict(self.handle, self._key_dtype, -1 if step is None else step,
                          self._steps_to_live, self._l2_threshold)

    def _add_slot(self, name, init, width):
        _ops.add_slot(self.handle, self._key_dtype, name, width, init)

    def export(self, include_filtered=True):
        """All keys as NumPy arrays, as `EmbeddingVariable.export` lists them."""
        return exported(self._export_parts(include_filtered))

    def import_(self, data, clear=True):
        """Loads keys from a dict shaped like `export()`'s result.

        Only `keys` and `values` are required; missing parts count as empty
        (zero frequencies and versions, no slots, no filtered keys) and a
        missing `default_values` leaves the initializer matrix unchanged.
        With `clear=True` the table is emptied first.
        """
        self._check_import_data(data)
        keys = np.asarray(data[_KEYS])
        if not np.issubdtype(keys.dtype, np.integer):
            raise TypeError(f"`keys` must be integers. Received dtype {keys.dtype}")
        n = keys.shape[0]
        values = np.asarray(data[_VALUES], np.float32)
        if values.shape != (n, self._dim):
            raise ValueError(
                f"`values` must have shape ({n}, {self._dim}). Received: {values.shape}")
        key_np = self._key_dtype.as_numpy_dtype
        slots = data.get("slots") or {}
        blocks = {name: self._slot_block(name, slots[name], n) for name in slots}
        defaults = np.asarray(data.get("default_values", np.zeros((0, self._dim))), np.float32)
        if defaults.ndim != 2 or defaults.shape[1] != self._dim:
            raise ValueError(
                f"`default_values` must have shape (rows, {self._dim}). "
                f"Received: {defaults.shape}")
        keys_f = np.asarray(data.get("keys_filtered", np.zeros(0, key_np)))
        if keys_f.size and not np.issubdtype(keys_f.dtype, np.integer):
            raise TypeError(f"`keys_filtered` must be integers. Received dtype {keys_f.dtype}")
        keys_f = keys_in_range(keys_f, self._key_dtype,
                               f"`keys_filtered` of table '{self._name}'")
        parts = {
            _KEYS: keys_in_range(keys, self._key_dtype, f"`keys` of table '{self._name}'"),
            _VALUES: values,
            **{k: np.asarray(data.get(k, np.zeros(m)), np.int64) for k, m in (
                ("freqs", n), ("versions", n), ("freqs_filtered", len(keys_f)),
                ("versions_filtered", len(keys_f)))},
            "default_values": defaults,
            "keys_filtered": keys_f,
            "bloom": np.asarray(data.get("bloom", np.zeros(0)), np.uint8),
            **pack_slots(blocks, n),
        }
        self._import_parts(parts, clear=clear)

    def merge_rows(self, keys, values, freqs):
        """Writes rows of `keys`, as of the latest step; `freqs` -1 keeps a count."""
        latest = _ops.stats(self.handle, self._key_dtype)["latest_step"]
        given = {_KEYS: tf.cast(keys, self._key_dtype), _VALUES: tf.cast(values, tf.float32),
                 "freqs": freqs, "versions": tf.fill([tf.size(keys)], tf.maximum(latest, 0))}
        return self._import_parts(complete_parts(given, self._dim, self._key_dtype),
                                  clear=False)

    # -- Change tracking (incremental checkpoints, serving deltas) -----------
    def mark_changes(self):
        """Closes the current change epoch and returns it, for `export_changes`."""
        return int(_ops.mark_changes(self.handle, self._key_dtype))

    def export_changes(self, since):
        """The keys changed after mark `since`, shaped like `export()`, plus
        `erased` and `complete` (False after a wholesale replacement)."""
        parts = _ops.export_changed_since(self.handle, self._key_dtype, self._dim, int(since))
        out = exported(parts)
        out["erased"] = parts["erased"].numpy()
        out["complete"] = bool(parts["complete"])
        return out

    def trim_erased(self, upto):
        """Forgets erasures logged up to mark `upto`; returns how many stay."""
        return int(_ops.trim_erased(self.handle, self._key_dtype, int(upto)))

    def erase(self, keys):
        """Returns how many of `keys` were present."""
        keys = keys_in_range(np.asarray(keys).reshape(-1), self._key_dtype,
                             f"`keys` of table '{self._name}'")
        return int(_ops.erase(self.handle, tf.constant(keys, self._key_dtype)))

    def apply_changes(self, delta):
        """Replays an `export_changes` dict: erases, then imports without clearing."""
        if not isinstance(delta, dict) or "erased" not in delta:
            raise ValueError(
                "`delta` must be a dict from export_changes() (with 'erased'). "
                f"Received: {type(delta).__name__}")
        erased = np.asarray(delta["erased"])
        if erased.size:
            self.erase(erased)
        rows = {k: v for k, v in delta.items() if k not in ("erased", "complete")}
        self.import_(rows, clear=False)

    def counters(self):
        """Cumulative counters (`lookups`, `hits`, `admitted_total`, ...)."""
        return {k: int(v) for k, v in _ops.counters(self.handle, self._key_dtype).items()}

    def _slot_block(self, name, rows, n):
        """[n, width] float32 (`reshape(0, -1)` cannot infer an empty one's width)."""
        rows = np.asarray(rows, np.float32)
        if rows.ndim == 2 and rows.shape[0] == n:
            return rows
        if rows.ndim == 1 and n > 0 and rows.size % n == 0:
            return rows.reshape(n, -1)
        if rows.size == 0 and n == 0:
            return rows.reshape(0, self._dim if rows.ndim < 2 else rows.shape[-1])
        raise ValueError(
            f"Slot '{name}' of table '{self._name}' must have {n} rows (one per "
            f"key). Received shape {rows.shape}")


class TableVariable(_compat.ActsAsResourceVariable):
    """An `EmbeddingTable` seen as a trainable variable (see the module docstring)."""

    constraint = None
    overwrite_with_gradient = False
    regularizer = None

    def __init__(self, table):
        self._table = table

    table = _tables.attribute("_table")
    handle = _tables.attribute("_table.resource_handle")
    name = path = _tables.attribute("_table.name")

    @property
    def trainable(self):
        return self._table.trainable

    @trainable.setter
    def trainable(self, value):
        self._table.trainable = value

    @property
    def dtype(self):
        return tf.float32

    @property
    def shape(self):
        """`(number of keys, dim)` when eager; `(None, dim)` while tracing."""
        if tf.executing_eagerly():
            return tf.TensorShape([self._table.size(), self._table.dim])
        return tf.TensorShape([None, self._table.dim])

    def _stock_optimizer_key(self):
        # Asked when a stock optimizer is built on a model's variables, the
        # first point where it meets a table (ours key tables by `_kre_id`);
        # a stock wrapper around ours is built after the optimizer it wraps.
        ours = self._table._table_optimizer
        if ours is not None:
            raise TypeError(_STOCK_WRAPPER_ERROR.format(name=self.name, ours=ours))
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


def _table_to_tensor(variable, dtype=None, name=None, as_ref=False):
    """The rows, eagerly (what `TensorBoard(histogram_freq=...)` histograms)."""
    if dtype is not None and tf.as_dtype(dtype) != tf.float32:
        return NotImplemented
    if not tf.executing_eagerly():
        raise TypeError(
            f"Embedding table '{variable.name}' cannot be converted to a tensor "
            "inside a tf.function (it has no fixed rows); look ids up with its "
            "layer, or read `table.export()` eagerly.")
    return tf.convert_to_tensor(variable.numpy(), tf.float32, name=name)


tf.register_tensor_conversion_function(TableVariable, _table_to_tensor)


def is_table(variable):
    return isinstance(variable, TableVariable)


class TableParamCount(int):
    """A layer's parameter count that `model.summary()` prints with the
    size of its tables: `1,384 (173 ids x 8)` for one table, `(3 tables,
    2,100 ids)` for several. It is an ordinary int otherwise."""

    def __new__(cls, count, tables):
        self = super().__new__(cls, count)
        self.tables = tables
        return self

    def __format__(self, spec):
        text = format(int(self), spec)
        if not tf.executing_eagerly():
            return text
        rows = [t.size() for t in self.tables]
        if len(self.tables) == 1:
            return f"{text} ({rows[0]:,} ids x {self.tables[0].dim})"
        return f"{text} ({len(self.tables)} tables, {sum(rows):,} ids)"


def count_params(layer):
    """`count_params` of the table layers: rows x dim of each table plus the
    dense weights, as a `TableParamCount`."""

    if not layer.built:
        return keras.layers.Layer.count_params(layer)
    weights = {id(w): w for w in layer.weights}.values()
    tables = [w.table for w in weights if is_table(w)]
    count = sum(int(np.prod(w.shape)) for w in weights)
    return TableParamCount(count, tables) if tables else count

