"""The table protocol: what every kind of embedding table implements.

Three kinds exist: `variables.EmbeddingTable` (one table in this process),
`distribute.ShardedEmbeddingTable` (split by key hash over parameter-server
tasks or a MirroredStrategy's replicas) and
`distribute.CollectiveShardedTable` (split over MultiWorkerMirroredStrategy
workers). Layers, ops and saving use a table through `Table` only; where the
kinds differ, a capability declared here says so (`local`,
`exchange_group`) instead of a type test. `distribute.placement.make_table`
decides which kind a layer gets.

`TableShard` is the one C++ table of this process behind a `TableVariable`:
what the optimizers update (`sparse_apply`) and what incremental
checkpoints and serving deltas read. An `EmbeddingTable` is both; a
distributed table is a `Table` whose `variables` are its shards'.

tests/test_tables.py checks that every kind defines every member.
"""

from typing import Any, Protocol, runtime_checkable

import tensorflow as tf


@runtime_checkable
class Table(Protocol):
    """An embedding table of any kind, as layers, ops and saving use it."""

    # The optimizer of `EmbeddingVariable(optimizer=...)`, or None: set by
    # the layer on the table and on each of its shards.
    optimizer: Any

    # -- description ----------------------------------------------------------
    @property
    def name(self) -> str:
        """Name used in errors and saving."""

    @property
    def dim(self) -> int:
        """Width of each row."""

    @property
    def key_dtype(self):
        """The keys' `tf.DType`."""

    @property
    def trainable(self) -> bool:
        """Whether gradient tapes watch the table (settable)."""

    @trainable.setter
    def trainable(self, value): ...

    @property
    def variables(self) -> list:
        """The `TableVariable`s a layer tracks and optimizers update: one
        per shard held in this process."""

    @property
    def filters(self) -> bool:
        """Whether an admission filter (counter or Bloom) is configured."""

    @property
    def no_permission_value(self) -> float:
        """What keys not admitted yet read."""

    @property
    def evicts(self) -> bool:
        """Whether an eviction rule is configured."""

    @property
    def save_filtered(self) -> bool:
        """Whether saving keeps keys counted but not admitted."""

    @property
    def storage_dir(self):
        """The file tier's folder, or None (rows in DRAM)."""

    # -- capabilities ---------------------------------------------------------
    @property
    def local(self) -> bool:
        """Whether the whole table is one C++ table of this process, which
        the fused kernels (group lookup, stacked lookup) read directly;
        False for a table whose rows live in several places (its own
        `lookup` reaches them)."""

    @property
    def fused_table(self):
        """The one C++ table of this process that holds every row of this
        table, which the fused kernels read in its place: the table itself
        where `local`; a table sharded over one process only, its shard;
        otherwise None."""

    @property
    def exchange_group(self):
        """None, or a hashable shared by tables whose lookups exchange ids
        and rows between processes and can be done together in one
        exchange by `lookup_many`."""

    @staticmethod
    def lookup_many(tables, keys_list, insert=False, distinct=False) -> list:
        """The rows of each `keys_list[t]` in `tables[t]` (tables of one
        `exchange_group`), in one exchange. With `distinct`, per table
        `(rows, index)`: the rows `[u, dim]` of its distinct keys and each
        key's place among them (int32, `keys_list[t]` flattened), so that a
        fused kernel pools from the distinct rows."""

    # -- operations -----------------------------------------------------------
    def lookup(self, keys, insert=False):
        """Rows of `keys` (any shape) as `keys.shape + (dim,)`; `insert`
        (training) counts and admits keys."""

    def size(self):
        """Number of admitted keys."""

    def stats(self) -> dict:
        """Statistics: at least `size`, `filtered`, `memory_bytes`,
        `latest_step`."""

    def memory_bytes(self) -> int:
        """Bytes held by the table."""

    def evict(self, step=None) -> int:
        """Applies the configured eviction; returns how many keys went."""

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
class TableShard(Table, Protocol):
    """The one C++ table of this process behind a `TableVariable`."""

    @property
    def handle(self):
        """The table's resource handle."""

    @property
    def variable(self):
        """The table as a trainable variable (`TableVariable`)."""

    @property
    def device(self) -> str:
        """The device holding the table."""

    def sparse_apply(self, keys, grads, rule, hyper, step, slots, distinct=False):
        """One fused optimizer step on the rows of `keys` (see
        `_ops.sparse_apply`); a distributed shard gathers the replicas'
        gradients, or leaves the update to its owner, as its placement
        requires."""

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
    """`lookup_many` of tables that exchange nothing: each looks its own
    keys up."""
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


PROTOCOLS = (Table, TableShard)


def members(protocol):
    """The names `protocol` declares (its own and inherited), sorted."""
    names = set()
    for cls in protocol.__mro__:
        if cls not in PROTOCOLS:
            continue
        names.update(n for n in vars(cls) if not n.startswith("_"))
        names.update(getattr(cls, "__annotations__", {}))
    return sorted(names)


def missing_members(cls, protocol=Table):
    """The members of `protocol` that class `cls` does not define (its own
    or from a base other than the protocol): [] when it implements it."""
    missing = []
    for name in members(protocol):
        owner = next((base for base in cls.__mro__ if name in vars(base)), None)
        if owner is None or owner in PROTOCOLS:
            missing.append(name)
    return missing
