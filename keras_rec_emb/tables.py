"""The table protocol: what every kind of embedding table implements.

`StoredTable`: what `EmbeddingVariable` needs under either backend (`JaxTable`).
`Table`: what layers, ops and saving use under TensorFlow (`EmbeddingTable`,
`ShardedEmbeddingTable`, `CollectiveShardedTable`); where the kinds differ, a
capability (`local`, `exchange_group`) says so instead of a type test.
`TableShard`: the one C++ table of this process behind a `TableVariable`.
`TableBase`: what the implementations share. No TensorFlow here (imported
under JAX too); tests/test_tables.py checks every kind defines every member.
"""

import operator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from keras_rec_emb import _file_tier
from keras_rec_emb import saving as _saving
from keras_rec_emb.options import save_filtered_from_env

# The parts with one entry per admitted key, and those with one per key
# counted by an admission filter but not admitted.
ROW_PARTS = ("keys", "values", "freqs", "versions")
FILTERED_ROW_PARTS = ("keys_filtered", "freqs_filtered", "versions_filtered")
# The parts a `.keras` file holds, one array each, in the kernels' order
# (keras_rec_emb/backend/tensorflow/variables.py's `PARTS` without the packed
# slot parts); each optimizer slot is saved beside them as `slot:NAME`.
ARRAY_PARTS = ROW_PARTS + ("default_values",) + FILTERED_ROW_PARTS + ("bloom",)
SLOT_PREFIX = "slot:"
RESTORE_DIM_MODES = ("error", "pad_or_truncate")


def check_restore_dim_mode(mode):
    if mode not in RESTORE_DIM_MODES:
        raise ValueError(
            f"`restore_dim_mismatch` must be one of {RESTORE_DIM_MODES}. "
            f"Received: restore_dim_mismatch={mode!r}"
        )
    return mode


def check_saved_dim(name, values_shape, dim, mode="error"):
    """True when saved rows have another width and `mode` allows resizing them."""
    if getattr(values_shape, "rank", 2) is None:
        return False  # unknown rank (a restore inside a graph): nothing to check
    shape = tuple(values_shape)
    if len(shape) == 2 and shape[1] is not None and shape[1] != dim:
        if mode == "pad_or_truncate":
            return True
        raise ValueError(
            f"Cannot restore embedding table '{name}': the checkpoint holds rows of "
            f"dim {shape[1]} but the table has dim {dim}. Build the layer with "
            f"embedding_dim={shape[1]} to restore this checkpoint, or with "
            "restore_dim_mismatch='pad_or_truncate' to pad new columns from the "
            "initializer (or truncate) as DeepRec does."
        )
    return False


def resize_rows(keys, values, slots, dim, default_values, slot_inits):
    """Rows (and slots) of another width brought to `dim`, DeepRec's rule (see
    docs/semantics.md, 'Tables and their options'). NumPy in and out."""
    keys, values = np.asarray(keys), np.asarray(values, np.float32)
    old, n = values.shape[1], values.shape[0]
    if old > dim:
        values = values[:, :dim]
    else:
        rows = default_values[np.mod(keys.astype(np.int64), default_values.shape[0])]
        values = np.concatenate([values, rows[:, old:]], axis=1)
    resized = {}
    for name, block in slots.items():
        block = np.asarray(block, np.float32).reshape(n, -1)
        if block.shape[1] == old:  # a per-element slot (Adagrad's accumulator, ...)
            if old > dim:
                block = block[:, :dim]
            else:
                fill = np.full((n, dim - old), slot_inits.get(name, 0.0), np.float32)
                block = np.concatenate([block, fill], axis=1)
        resized[name] = block
    return values, resized


def freq_cap(record_freq, filter_freq):
    """The count an admitted key's frequency stops at, 0 for none: without
    TF_RECORD_FREQ, DeepRec's is the filter's threshold (CounterFilterDescriptorImpl::GetFreq)."""
    return 0 if record_freq or filter_freq < 1 else int(filter_freq)


def attribute(path, doc=None):  # a read-only property: the attribute at dotted `path`
    return property(operator.attrgetter(path), doc=doc)


def constant(value, doc):  # a read-only property, `value` for every object
    return property(lambda self: value, doc=doc)


def check_snapshot_path(path):
    if path is not None and not isinstance(path, str):
        raise TypeError(f"`path` must be a str or None. Received: path={path!r}")


class TableBase:
    """What every table implementation has in common over its own ops.

    A subclass sets `_name`, `_dim`, `_key_dtype`, `_trainable`,
    `_save_filtered`, `_slot_inits`, `_initial_default_values` and, on the
    file tier, `_storage_dir` and `_copy_dir`, unless it overrides what
    reads them; has an `eviction_rule` (an option or None); and implements
    `size`, `stats`, `_evict_op`, `_add_slot`, `_snapshot` and
    `_restore_snapshot`."""

    _storage_dir = _copy_dir = None
    _kind = "table"  # what `repr` calls it
    name = attribute("_name", "Name used in errors, saving and `path`.")
    dim = attribute("_dim", "Width of each row.")
    key_dtype = attribute("_key_dtype")

    def __repr__(self):
        key_dtype = getattr(self._key_dtype, "name", self._key_dtype)
        return f"<{self._kind} '{self._name}' key_dtype={key_dtype} dim={self._dim}>"

    @property
    def trainable(self):
        return self._trainable

    @trainable.setter
    def trainable(self, value):
        self._trainable = bool(value)

    @property
    def evicts(self):
        return self.eviction_rule is not None

    @property
    def evicts_at_save(self):
        """Whether saving evicts now: an eviction rule with `at_save` on,
        outside `keras_rec_emb.save_model(..., evict=False)`."""
        return self.evicts and self.eviction_rule.at_save and _saving.evicts_at_save()

    @property
    def save_filtered(self):
        return self._save_filtered and save_filtered_from_env()

    @property
    def storage_dir(self):
        """The file tier's folder (a copy's when it works in one), or None."""
        return self._copy_dir or self._storage_dir

    def memory_bytes(self):
        return self.stats()["memory_bytes"]

    def evict(self, step=None):
        """As `EmbeddingVariable.evict`; returns how many keys went."""
        if not self.evicts:
            return 0
        return int(self._evict_op(step))

    def evict_for_save(self, name=None):
        """Eager: a save's eviction (when `evicts_at_save`), reported per table."""
        if not self.evicts_at_save:
            return 0
        before = self.size()
        evicted = self.evict()
        _saving.report_save_eviction(name or self._name, self.eviction_rule, before,
                                     self.size(), evicted)
        return evicted

    def add_slot(self, name, init=0.0, width=None):
        """Adds slot `name` (width `dim` unless given), or sets its init for new rows."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"`slot_name` must be a non-empty string. Received: name={name!r}")
        self._slot_inits[name] = float(init)
        self._add_slot(name, float(init), self._dim if width is None else int(width))

    def resize_rows(self, keys, values, slots):
        return resize_rows(keys, values, slots, self._dim, self._initial_default_values,
                           self._slot_inits)

    def _check_import_data(self, data):
        if not isinstance(data, dict) or "keys" not in data or "values" not in data:
            raise ValueError(
                "`data` must be a dict with at least 'keys' [N] and 'values' "
                f"[N, {self.dim}] (as returned by export()). Received: "
                f"{type(data).__name__} with keys "
                f"{sorted(data) if isinstance(data, dict) else None}")

    def _with_storage(self, stats):
        stats["storage"] = "FILE" if self._storage_dir else "DRAM"
        accesses = stats["cache_hits"] + stats["cache_misses"]
        stats["cache_hit_rate"] = stats["cache_hits"] / accesses if accesses else 1.0
        return stats

    def _takes_copy_folder(self):
        """When the file-tier folder is held by another live table, gives this
        one a copy folder and returns True (registered before any finalizer
        the caller adds: they run newest first, so the table goes first)."""
        if (self._storage_dir is None or self._copy_dir is not None
                or not _file_tier.storage_held(self._storage_dir)):
            return False
        self._copy_dir = _file_tier.copy_folder(self, self._name, self._storage_dir)
        return True

    def _check_file_tier(self, what):
        if self._storage_dir is None:
            raise ValueError(
                f"{what} needs a file-tier table (EmbeddingVariableOption("
                f"storage_option=StorageOption('FILE', storage_path=...))); table "
                f"'{self._name}' keeps its rows in DRAM.")

    def snapshot(self):
        """File tier: `EmbeddingVariable.snapshot` (its number)."""
        self._check_file_tier("snapshot()")
        if self._copy_dir is not None:
            raise ValueError(
                f"Table '{self._name}' cannot snapshot(): it is a copy working in the "
                f"temporary folder '{self._copy_dir}' (its folder '{self._storage_dir}' "
                "is held by another live table), which is removed when it is freed, "
                "snapshots included. Give this layer a storage_path of its own "
                "(EmbeddingVariableOption(storage_option=StorageOption('FILE', "
                "storage_path=...))), or snapshot the live table.")
        return self._snapshot()

    def restore_snapshot(self, path=None):
        """File tier: `EmbeddingVariable.restore_snapshot` (the number of keys)."""
        self._check_file_tier("restore_snapshot()")
        check_snapshot_path(path)
        return self._restore_snapshot(path or (self._storage_dir if self._copy_dir else ""))


def _declared(doc, settable=False):
    """A property that a protocol declares (its implementations define it)."""
    declared = property(lambda self: None, doc=doc)
    return declared.setter(lambda self, value: None) if settable else declared


@runtime_checkable
class StoredTable(Protocol):
    """What `EmbeddingVariable` uses of its table under either backend."""

    # -- description ----------------------------------------------------------
    name = _declared("Name used in errors and saving.")
    dim = _declared("Width of each row.")
    key_dtype = _declared("The keys' dtype (a `tf.DType` under TensorFlow, a NumPy dtype "
                          "name under JAX).")
    trainable = _declared("Whether training lookups may change the table.", settable=True)
    evicts = _declared("Whether an eviction rule is configured.")
    save_filtered = _declared("Whether saving keeps keys counted but not admitted.")
    storage_dir = _declared("The file tier's folder, or None (rows in DRAM).")

    # -- operations -----------------------------------------------------------
    def size(self):
        """Number of admitted keys."""

    def stats(self) -> dict:
        """At least `size`, `filtered`, `memory_bytes`, `latest_step`."""

    def evict(self, step=None) -> int:
        """Applies the configured eviction; returns how many keys went."""

    def evict_for_save(self, name=None) -> int:
        """The eviction of a save, when `at_save` and `save_model` allow, reported."""

    def add_slot(self, name, init=0.0, width=None):
        """Adds (or re-inits) optimizer slot `name`."""

    def export(self, include_filtered=True) -> dict:
        """Every key as NumPy arrays, in the ordinary format."""

    def import_(self, data, clear=True):
        """Loads a dict shaped like `export()`'s result."""

    def resize_rows(self, keys, values, slots):
        """Saved rows (and slots) of another width brought to `dim`."""

    def snapshot(self):
        """File tier: a crash-safe snapshot of the table's files."""

    def restore_snapshot(self, path=None):
        """File tier: the contents replaced by the latest snapshot."""


@runtime_checkable
class Table(StoredTable, Protocol):
    """An embedding table of any kind under TensorFlow."""

    # The optimizer of `EmbeddingVariable(optimizer=...)`, or None: set by
    # the layer on the table and on each of its shards.
    optimizer: Any

    # -- description ----------------------------------------------------------
    variables = _declared("The `TableVariable`s a layer tracks and optimizers update: one "
                          "per shard held in this process.")
    filters = _declared("Whether an admission filter (counter or Bloom) is configured.")
    no_permission_value = _declared("What keys not admitted yet read.")

    # -- capabilities ---------------------------------------------------------
    local = _declared(
        "Whether the whole table is one C++ table of this process, which the fused "
        "kernels (group lookup, stacked lookup) read directly; False for a table whose "
        "rows live in several places (its own `lookup` reaches them).")
    fused_table = _declared(
        "The one C++ table of this process that holds every row of this table, which "
        "the fused kernels read in its place: the table itself where `local`; a table "
        "sharded over one process only, its shard; otherwise None.")
    exchange_group = _declared(
        "None, or a hashable shared by tables whose lookups exchange ids and rows "
        "between processes and can be done together in one exchange by `lookup_many`.")

    @staticmethod
    def lookup_many(tables, keys_list, insert=False, distinct=False) -> list:
        """The rows of each `keys_list[t]` in `tables[t]` (tables of one
        `exchange_group`), in one exchange. With `distinct`, per table
        `(rows, index)`: the rows `[u, dim]` of its distinct keys and each
        key's place among them (int32, `keys_list[t]` flattened), so that a
        fused kernel pools from the distinct rows."""

    # -- operations -----------------------------------------------------------
    def lookup(self, keys, insert=False):
        """Rows `keys.shape + (dim,)`; `insert` (training) counts and admits."""

    def memory_bytes(self) -> int:
        """Bytes held by the table."""


@runtime_checkable
class TableShard(Table, Protocol):
    """The one C++ table of this process behind a `TableVariable`."""

    handle = _declared("The table's resource handle.")
    variable = _declared("The table as a trainable variable (`TableVariable`).")
    device = _declared("The device holding the table.")

    def sparse_apply(self, keys, grads, rule, hyper, step, slots, distinct=False):
        """One fused optimizer step on the rows of `keys` (a distributed shard
        may gather the replicas' gradients or leave it to their owner)."""

    def merge_rows(self, keys, values, freqs):
        """Writes rows of `keys` into the live table."""

    def mark_changes(self) -> int:
        """Closes the current change epoch; returns it."""

    def export_changes(self, since) -> dict:
        """The keys changed after mark `since`."""

    def trim_erased(self, upto) -> int:
        """Forgets logged erasures up to mark `upto`."""

    def erase(self, keys) -> int:
        """Erases `keys`; returns how many were present."""

    def apply_changes(self, delta):
        """Replays a dict from `export_changes`."""

    def counters(self) -> dict:
        """Cumulative counters."""


def lookup_each(tables, keys_list, insert=False, distinct=False):
    """`lookup_many` of tables that exchange nothing."""
    import tensorflow as tf  # only TensorFlow tables exchange

    if not distinct:
        return [t.lookup(k, insert=insert) for t, k in zip(tables, keys_list)]
    out = []
    for t, k in zip(tables, keys_list):
        flat = tf.reshape(k, [-1])
        unique, index = tf.unique(flat)
        rows = t.lookup(flat, insert=insert)
        first = tf.math.unsorted_segment_min(tf.range(tf.size(flat)), index, tf.size(unique))
        out.append((tf.gather(rows, first), index))
    return out
