"""The JAX backend's embedding table: one engine table behind an FFI handle.

`JaxTable` implements `keras_rec_emb.tables.StoredTable`, what
`EmbeddingVariable` uses of its table under either backend, over
`tables.TableBase` (the accessors and checks, with the TensorFlow
`EmbeddingTable`'s messages). Lookups and updates are not methods: they are
FFI calls inside traced steps (`keras_rec_emb.backend.jax.layers`), on
`handle`.

On the file tier the rows live in the engine's file store
(csrc/kv/file_store.h), in the folder the TensorFlow layer's table uses;
a live table locks it, and a second one made on it works in a folder of
its own next to it (keras_rec_emb/_file_tier.py). When the table is freed
(with its layer) it is destroyed: the lock goes and its working files with
it.
"""

import weakref

import numpy as np

from keras_rec_emb import _file_tier
from keras_rec_emb import tables as _tables
from keras_rec_emb.backend.jax import ffi

# Saved as int64 whatever the key width, as TensorFlow writes them.
_INT64_PARTS = ("freqs", "versions", "freqs_filtered", "versions_filtered")


def _free(handle):
    # The table is gone (or the process ends): release the folder's lock and
    # the table (its working files go with it). No barrier: this may run
    # from the garbage collector at any point, also inside a trace.
    try:
        ffi.release_storage(handle, wait=False)
        ffi.destroy(handle, wait=False)
    except (ValueError, RuntimeError, ImportError):
        pass  # destroyed already


class JaxTable(_tables.TableBase):
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

    _kind = "JaxTable"

    def __init__(self, name, dim, key_dtype, default_values, ev_option, trainable=True):
        self._name, self._dim, self._key_dtype = name, int(dim), key_dtype
        self.trainable = trainable
        self._initial_default_values = default_values
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
            bloom=table.get("bloom"), freq_cap=_tables.freq_cap(table["record_freq"], filter_freq))
        storage = ev_option.storage_option
        if storage is None or storage.storage_type != "FILE":
            self.handle = ffi.create(default_values, **kwargs)
        else:
            self.handle = self._create_on_file(storage, kwargs)
        weakref.finalize(self, _free, self.handle)

    def _create_on_file(self, storage, kwargs):
        self._storage_dir = _file_tier.table_folder(storage.storage_path, self._name)
        kwargs.update(storage_path=self._storage_dir, cache_bytes=storage.cache_bytes)
        try:
            return ffi.create(self.default_values, **kwargs)
        except ValueError:
            if not self._takes_copy_folder():
                raise
        kwargs["storage_path"] = self._copy_dir
        return ffi.create(self.default_values, **kwargs)

    @property
    def default_values(self):
        """The initializer matrix the table was made with."""
        return self._initial_default_values

    def size(self):
        """Admitted keys (after every table call already dispatched)."""
        return int(ffi.size(self.handle)[0])

    def stats(self):
        return self._with_storage(ffi.stats(self.handle))

    def _evict_op(self, step=None):
        rule = self.eviction_rule
        return ffi.evict(self.handle, -1 if step is None else step,
                         getattr(rule, "steps_to_live", -1),
                         getattr(rule, "l2_weight_threshold", -1.0))

    def _add_slot(self, name, init, width):
        ffi.add_slot(self.handle, name, width, init)
        if name not in {n for n, _ in self.slot_specs}:
            self.slot_specs.append((name, width))

    def export(self, include_filtered=True):
        parts = ffi.export_parts(self.handle, self._key_dtype, self._dim, self.slot_specs)
        for name in _INT64_PARTS:
            parts[name] = np.asarray(parts[name]).astype(np.int64)
        if not include_filtered:
            for name in _tables.FILTERED_ROW_PARTS:
                parts[name] = parts[name][:0]
        return parts

    def import_(self, data, clear=True):
        """Replaces the contents with `data` (a failed import leaves the
        table as it was). The engine's import always replaces: `clear`
        must be True."""
        if not clear:
            raise ValueError("A JAX table's import_ replaces its contents: clear=True only. "
                             "Received: clear=False")
        self._check_import_data(data)
        ffi.import_parts(self.handle, self._key_dtype, self._dim, data)
        slots = data.get("slots")
        if isinstance(slots, dict):
            added = [(str(n), int(np.shape(v)[1])) for n, v in slots.items()]
        else:
            added = [(n.decode() if isinstance(n, bytes) else str(n), int(w))
                     for n, w in zip(data.get("slot_names", ()), data.get("slot_widths", ()))]
        known = {name for name, _ in self.slot_specs}
        self.slot_specs += [(n, w) for n, w in added if n not in known]

    def _snapshot(self):
        return ffi.snapshot(self.handle)

    def _restore_snapshot(self, path):
        return ffi.restore_snapshot(self.handle, path)
