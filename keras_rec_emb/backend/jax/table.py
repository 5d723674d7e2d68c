"""The JAX backend's embedding table: one engine table behind an FFI handle.

`JaxTable` implements `keras_rec_emb.tables.StoredTable`, what
`EmbeddingVariable` uses of its table under either backend (export /
import, size, stats, eviction, slots, the file tier), with the TensorFlow
`EmbeddingTable`'s names, arguments and messages. Lookups and updates are
not methods: they are FFI calls inside traced steps
(`keras_rec_emb.backend.jax.layers`), on `handle`.

The file tier (`StorageOption("FILE", storage_path, storage_size)`): the
rows (values and optimizer slots) live in the engine's file store
(csrc/kv/file_store.h) under `storage_path/<layer name>_embeddings` (the
folder the TensorFlow layer's table uses), with a DRAM cache of about
`storage_size` bytes; lookups, updates, filters, eviction, export/import and
saving are the engine's, as on DRAM. A `.keras` file holds every row
whatever the tier (saving exports them), so a file-tier model saved under
one backend loads under the other.

A live table locks its folder. A second one made on it (a model reloaded
beside the one that saved it) works in a folder of its own next to it
(keras_rec_emb/_file_tier.py). When the table is freed (with its layer) it
is destroyed: the lock goes and the table's working files with it (the
snapshots and the copy's folder rules are the engine's and `_file_tier`'s).
"""

import weakref

import numpy as np

from keras_rec_emb import _file_tier
from keras_rec_emb import saving as _saving
from keras_rec_emb import tables as _tables
from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.options import save_filtered_from_env

# Saved as int64 whatever the key width, as TensorFlow writes them.
_INT64_PARTS = ("freqs", "versions", "freqs_filtered", "versions_filtered")
_FILTERED = ("keys_filtered", "freqs_filtered", "versions_filtered")


def _free(handle):
    # The table is gone (or the process ends): release the folder's lock and
    # the table (its working files go with it). No barrier: this may run
    # from the garbage collector at any point, also inside a trace.
    try:
        ffi.release_storage(handle, wait=False)
        ffi.destroy(handle, wait=False)
    except (ValueError, RuntimeError, ImportError):
        pass  # destroyed already


class JaxTable:
    """One table of the engine, made from an `EmbeddingVariableOption`.

    Args:
        name: str, the table's name (`<layer name>/embeddings`, as under
            TensorFlow).
        dim: int, the row width.
        key_dtype: "int32" or "int64".
        default_values: float32 [default_value_dim, dim], the initializer
            matrix.
        ev_option: the layer's `EmbeddingVariableOption`.
        trainable: bool.
    """

    def __init__(self, name, dim, key_dtype, default_values, ev_option, trainable=True):
        self._name, self._dim, self._key_dtype = name, int(dim), key_dtype
        self.trainable = trainable
        self.default_values = default_values
        self.eviction_rule = ev_option.evict_option
        self._save_filtered = ev_option.save_filtered
        # (name, width) of the slots, in the order they were added (the
        # engine packs them so); init values for `resize_rows`.
        self.slot_specs = []
        self._slot_inits = {}
        table = ev_option.table_kwargs()
        filter_freq = table.get("filter_freq", 0)
        kwargs = dict(
            key_dtype=key_dtype, num_shards=table["num_shards"], track_meta=table["track_meta"],
            filter_freq=filter_freq, no_permission_value=table["no_permission_value"],
            bloom=table.get("bloom"),
            # DeepRec's frequency: an admitted key's stays at the threshold
            # unless `record_freq` (the TensorFlow table's `_freq_cap`).
            freq_cap=0 if table["record_freq"] or filter_freq < 1 else filter_freq)
        self._storage_dir = self._copy_dir = None
        storage = ev_option.storage_option
        if storage is None or storage.storage_type != "FILE":
            self.handle = ffi.create(default_values, **kwargs)
        else:
            self.handle = self._create_on_file(storage, kwargs)
        weakref.finalize(self, _free, self.handle)

    def _create_on_file(self, storage, kwargs):
        folder = _file_tier.table_folder(storage.storage_path, self._name)
        self._storage_dir = folder
        kwargs.update(storage_path=folder, cache_bytes=storage.cache_bytes)
        try:
            return ffi.create(self.default_values, **kwargs)
        except ValueError:
            if not _file_tier.storage_held(folder):
                raise
        # Registered before the table's finalizer: finalizers of one object
        # run newest first, so the table goes before its folder.
        self._copy_dir = _file_tier.copy_folder(self, self._name, folder)
        kwargs["storage_path"] = self._copy_dir
        return ffi.create(self.default_values, **kwargs)

    def __repr__(self):
        return f"<JaxTable '{self._name}' key_dtype={self._key_dtype} dim={self._dim}>"

    # -- description ----------------------------------------------------------
    @property
    def name(self):
        return self._name

    @property
    def dim(self):
        return self._dim

    @property
    def key_dtype(self):
        return self._key_dtype

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
        """The file tier's folder (its own under `storage_path`, or a
        copy's), or None (DRAM)."""
        return self._copy_dir or self._storage_dir

    # -- operations -----------------------------------------------------------
    def size(self):
        """Admitted keys (after every table call already dispatched)."""
        return int(ffi.size(self.handle)[0])

    def stats(self):
        out = ffi.stats(self.handle)
        out["storage"] = "FILE" if self._storage_dir else "DRAM"
        accesses = out["cache_hits"] + out["cache_misses"]
        out["cache_hit_rate"] = out["cache_hits"] / accesses if accesses else 1.0
        return out

    def memory_bytes(self):
        return self.stats()["memory_bytes"]

    def evict(self, step=None):
        rule = self.eviction_rule
        if rule is None:
            return 0
        return ffi.evict(self.handle, -1 if step is None else step,
                         getattr(rule, "steps_to_live", -1),
                         getattr(rule, "l2_weight_threshold", -1.0))

    def evict_for_save(self, name=None):
        if not self.evicts_at_save:
            return 0
        before = self.size()
        evicted = self.evict()
        _saving.report_save_eviction(name or self._name, self.eviction_rule, before,
                                     self.size(), evicted)
        return evicted

    def add_slot(self, name, init=0.0, width=None):
        width = self._dim if width is None else int(width)
        self._slot_inits[name] = float(init)
        ffi.add_slot(self.handle, name, width, float(init))
        if name not in {n for n, _ in self.slot_specs}:
            self.slot_specs.append((name, width))

    def export(self, include_filtered=True):
        parts = ffi.export_parts(self.handle, self._key_dtype, self._dim, self.slot_specs)
        for name in _INT64_PARTS:
            parts[name] = np.asarray(parts[name]).astype(np.int64)
        if not include_filtered:
            for name in _FILTERED:
                parts[name] = parts[name][:0]
        return parts

    def import_(self, data, clear=True):
        """Replaces the contents with `data` (a failed import leaves the
        table as it was). The engine's import always replaces: `clear`
        must be True."""
        if not clear:
            raise ValueError("A JAX table's import_ replaces its contents: clear=True only. "
                             "Received: clear=False")
        if not isinstance(data, dict) or "keys" not in data or "values" not in data:
            raise ValueError(
                "`data` must be a dict with at least 'keys' [N] and 'values' "
                f"[N, {self._dim}] (as returned by export()). Received: "
                f"{type(data).__name__} with keys "
                f"{sorted(data) if isinstance(data, dict) else None}")
        ffi.import_parts(self.handle, self._key_dtype, self._dim, data)
        slots = data.get("slots")
        if isinstance(slots, dict):
            added = [(str(n), int(np.shape(v)[1])) for n, v in slots.items()]
        else:
            added = [(n.decode() if isinstance(n, bytes) else str(n), int(w))
                     for n, w in zip(data.get("slot_names", ()), data.get("slot_widths", ()))]
        known = {name for name, _ in self.slot_specs}
        self.slot_specs += [(n, w) for n, w in added if n not in known]

    def resize_rows(self, keys, values, slots):
        return _tables.resize_rows(keys, values, slots, self._dim, self.default_values,
                                   self._slot_inits)

    def _check_file_tier(self, what):
        if self._storage_dir is None:
            raise ValueError(
                f"{what} needs a file-tier table (EmbeddingVariableOption("
                f"storage_option=StorageOption('FILE', storage_path=...))); table "
                f"'{self._name}' keeps its rows in DRAM.")

    def snapshot(self):
        self._check_file_tier("snapshot()")
        if self._copy_dir is not None:
            raise ValueError(
                f"Table '{self._name}' cannot snapshot(): it is a copy working in the "
                f"temporary folder '{self._copy_dir}' (its folder '{self._storage_dir}' "
                "is held by another live table), which is removed when it is freed, "
                "snapshots included. Give this layer a storage_path of its own "
                "(EmbeddingVariableOption(storage_option=StorageOption('FILE', "
                "storage_path=...))), or snapshot the live table.")
        return ffi.snapshot(self.handle)

    def restore_snapshot(self, path=None):
        self._check_file_tier("restore_snapshot()")
        if path is not None and not isinstance(path, str):
            raise TypeError(f"`path` must be a str or None. Received: path={path!r}")
        return ffi.restore_snapshot(self.handle, path or (self._storage_dir if self._copy_dir
                                                          else ""))
