"""The file tier (`StorageOption("FILE", storage_path, storage_size)`) of the
JAX `EmbeddingVariable`, as under TensorFlow.

The rows (values and optimizer slots) live in the engine's file store
(csrc/kv/file_store.h) under `storage_path/<layer name>_embeddings` (the
folder the TensorFlow layer's table uses), with a DRAM cache of about
`storage_size` bytes; lookups, updates, filters, eviction, export/import and
saving are the engine's, as on DRAM. A `.keras` file holds every row
whatever the tier (saving exports them: keras_rec_emb/backend/jax/saving.py), so a
file-tier model saved under one backend loads under the other.

A live table locks its folder. A second one made on it (a model reloaded
beside the one that saved it) works in a folder of its own next to it
(keras_rec_emb/_file_tier.py). When the layer is freed its table is
destroyed: the lock goes and the table's working files with it (the
snapshots and the copy's folder rules are the engine's and
`_file_tier`'s).
"""

import weakref

from keras_rec_emb import _file_tier
from keras_rec_emb.backend.jax import ffi


def _free(handle):
    # The layer is gone (or the process ends): release the folder's lock and
    # the table (its working files go with it). No barrier: this may run
    # from the garbage collector at any point, also inside a trace.
    try:
        ffi.release_storage(handle, wait=False)
        ffi.destroy(handle, wait=False)
    except (ValueError, RuntimeError, ImportError):
        pass  # destroyed already


def create(layer, default_values, storage, **kwargs):
    """The handle of `layer`'s new table (`ffi.create(default_values,
    **kwargs)`), in the file tier of `storage` (a `StorageOption`) when its
    type is "FILE". Sets `layer._kre_storage_dir` (the table's folder under
    `storage_path`, None on DRAM) and `layer._kre_copy_dir` (the folder of a
    copy beside a live table holding that one, else None)."""
    layer._kre_storage_dir = layer._kre_copy_dir = None
    if storage is None or storage.storage_type != "FILE":
        return ffi.create(default_values, **kwargs)
    name = f"{layer.name}/embeddings"  # the TensorFlow layer's table name
    folder = _file_tier.table_folder(storage.storage_path, name)
    layer._kre_storage_dir = folder
    kwargs.update(storage_path=folder, cache_bytes=storage.cache_bytes)
    try:
        handle = ffi.create(default_values, **kwargs)
    except ValueError:
        if not _file_tier.storage_held(folder):
            raise
        layer._kre_copy_dir = _file_tier.copy_folder(layer, name, folder)
        kwargs["storage_path"] = layer._kre_copy_dir
        handle = ffi.create(default_values, **kwargs)
    # Registered after the copy folder's removal: finalizers of one object
    # run newest first, so the table goes before its folder.
    weakref.finalize(layer, _free, handle)
    return handle


def storage_dir(layer):
    """The table's folder (its own under `storage_path`, or a copy's), or
    None (DRAM)."""
    return getattr(layer, "_kre_copy_dir", None) or getattr(layer, "_kre_storage_dir", None)


def _check_file_tier(layer, what):
    if getattr(layer, "_kre_storage_dir", None) is None:
        raise ValueError(
            f"{what} needs a file-tier table (EmbeddingVariableOption("
            "storage_option=StorageOption('FILE', storage_path=...))); EmbeddingVariable "
            f"'{layer.name}' keeps its rows in DRAM.")


def snapshot(layer):
    """`layer.snapshot()` (see the layer)."""
    _check_file_tier(layer, "snapshot()")
    if layer._kre_copy_dir is not None:
        raise ValueError(
            f"EmbeddingVariable '{layer.name}' cannot snapshot(): it is a copy working in the "
            f"temporary folder '{layer._kre_copy_dir}' (its folder "
            f"'{layer._kre_storage_dir}' is held by another live table), which is removed "
            "when it is freed, snapshots included. Give this layer a storage_path of its "
            "own (EmbeddingVariableOption(storage_option=StorageOption('FILE', "
            "storage_path=...))), or snapshot the live table.")
    return ffi.snapshot(layer.handle)


def restore_snapshot(layer, path):
    """`layer.restore_snapshot(path)` (see the layer)."""
    _check_file_tier(layer, "restore_snapshot()")
    if path is not None and not isinstance(path, str):
        raise TypeError(f"`path` must be a str or None. Received: path={path!r}")
    default = layer._kre_storage_dir if layer._kre_copy_dir else ""
    return ffi.restore_snapshot(layer.handle, path or default)


def stats(layer):
    """`layer.stats()` (see the layer)."""
    out = ffi.stats(layer.handle)
    out["storage"] = "FILE" if getattr(layer, "_kre_storage_dir", None) else "DRAM"
    accesses = out["cache_hits"] + out["cache_misses"]
    out["cache_hit_rate"] = out["cache_hits"] / accesses if accesses else 1.0
    return out
