"""The one place that loads the compiled ops library and wraps its raw ops.

`_kre_ops.so` is loaded on first use or at `import keras_rec_emb` (so a
SavedModel using the ops loads in a fresh process). It is a TensorFlow op
library using TensorFlow's C++ ABI only: one build serves every Python
version, and TensorFlow's minor release must match the one it was built with.
"""

import functools
import json
import os

import tensorflow as tf

_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARY_NAME = "_kre_ops.so"
_REBUILD = (
    "Install the TensorFlow it was built against (`pip install "
    "\"keras-rec-emb[cpu]\"` or `[gpu]` for a released wheel), or rebuild it "
    "against the installed TensorFlow: in a source checkout run `make build` "
    "(or `make install`), otherwise `pip install --no-build-isolation "
    "--no-binary keras-rec-emb --force-reinstall keras-rec-emb`."
)

def _built_against():
    try:
        with open(os.path.join(_DIR, "_kre_ops_build.json")) as f:
            return json.load(f).get("tensorflow")
    except (OSError, ValueError):
        return None


def minor_version(version):
    """`"2.21.0"` -> `"2.21"`: the part of a TensorFlow version that fixes
    its C++ ABI."""
    return ".".join(version.split(".")[:2])


@functools.cache
def gen():
    """Returns the loaded op module (generated wrappers `kre_table_*`)."""
    library = os.path.join(_DIR, LIBRARY_NAME)
    if not os.path.exists(library):
        raise ImportError(
            "keras_rec_emb's compiled ops library (_kre_ops.so) is missing "
            f"from {_DIR}. {_REBUILD}"
        )
    built = _built_against()
    if built is not None and minor_version(built) != minor_version(tf.__version__):
        raise ImportError(
            f"keras_rec_emb's compiled ops ({library}) were built against "
            f"TensorFlow {built}, but TensorFlow {tf.__version__} is "
            f"installed: they load only in TensorFlow {minor_version(built)}.x. "
            f"{_REBUILD}"
        )
    try:
        return tf.load_op_library(library)
    except (tf.errors.NotFoundError, OSError) as e:
        raise ImportError(
            f"keras_rec_emb's compiled ops ({library}) failed to load: {e}. "
            "The library must be built against the installed TensorFlow's "
            f"minor release ({minor_version(tf.__version__)}). {_REBUILD}"
        ) from e


@functools.cache
def _c_library():
    """The same library through ctypes, for its plain C entry points (the
    registry of Arrow exports); dlopen of the same path shares its state
    with the op library."""
    import ctypes

    gen()
    lib = ctypes.CDLL(os.path.join(_DIR, LIBRARY_NAME))
    lib.kre_arrow_register.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.kre_arrow_register.restype = ctypes.c_int
    lib.kre_arrow_unregister.argtypes = [ctypes.c_int64]
    lib.kre_arrow_unregister.restype = ctypes.c_int
    return lib


def arrow_register(array_address, schema_address):
    """Lets `KRE>ArrowBatchToTensors` consume the Arrow C structs at these
    addresses (exported by this package); the op refuses any other."""
    if _c_library().kre_arrow_register(int(array_address), int(schema_address)):
        raise ValueError("cannot register a null Arrow export address")


def arrow_unregister(array_address):
    """Forgets an export that was not consumed; returns whether it was live."""
    return bool(_c_library().kre_arrow_unregister(int(array_address)))


@tf.RegisterGradient("KRE>TableLookup")
def _table_lookup_grad(op, grad):
    """Gradient of a lookup for the table handle: rows per key, like
    ResourceGather's gradient for a tf.Variable. Keys are the indices; the
    dense shape is unknown (a hash table has no dense form)."""
    dim = op.get_attr("dim")
    keys = tf.reshape(op.inputs[1], [-1])
    values = tf.reshape(grad, [-1, dim])
    return [tf.IndexedSlices(values, keys), None]


@tf.RegisterGradient("KRE>TableLookupCounted")
def _table_lookup_counted_grad(op, grad):
    """As TableLookup's: rows per key for the table handle."""
    return [tf.IndexedSlices(grad, op.inputs[1]), None, None]


tf.no_gradient("KRE>UnstackFeatureIds")  # integer ids in, integer ids out


def unstack_feature_ids(ids):
    """`ids` `[batch, F, L]` as F flat int64 `[batch * L]` feature tensors (padding
    kept) and one shared `range(batch + 1) * L` row splits, in one op instead of
    F strided slices."""
    values, splits = gen().kre_unstack_feature_ids(ids, num_features=int(ids.shape[1]))
    return list(values), splits


tf.no_gradient("KRE>UnstackKeptIds")


def unstack_kept_ids(ids):
    """`unstack_feature_ids` without the padding (ids < 0): F values and F row
    splits, so the group lookup reads each feature's kept ids where they are."""
    values, splits = gen().kre_unstack_kept_ids(ids, num_features=int(ids.shape[1]))
    return list(values), list(splits)


def create_table(default_values, key_dtype, dim, num_shards, track_meta=True,
                 filter_freq=0, bloom=None, no_permission_value=0.0, freq_cap=0,
                 storage_path="", cache_bytes=64 << 20, shared_name=""):
    """A new table; `bloom`: (counters, hashes, counter_bytes) or None;
    `freq_cap` > 0 caps each key's frequency; `storage_path`: file tier;
    `shared_name`: the device's table of that name. Callers refuse distribution."""
    counters, hashes, counter_bytes = bloom or (0, 0, 8)
    return gen().kre_table_create(
        default_values, key_dtype=key_dtype, dim=dim, num_shards=num_shards,
        track_meta=track_meta, filter_freq=filter_freq, bloom_counters=counters,
        bloom_hashes=hashes, bloom_counter_bytes=counter_bytes,
        no_permission_value=no_permission_value, freq_cap=freq_cap,
        storage_path=storage_path, cache_bytes=cache_bytes,
        table_shared_name=shared_name,
    )


def refuse_xla(what):
    """A clear error instead of XLA's "No registered 'KRE>...' OpKernel for
    XLA_CPU_JIT": our kernels run on TensorFlow's executor only."""
    from keras_rec_emb.backend.tensorflow import compat as _compat

    if _compat.in_xla_context():
        raise ValueError(
            f"{what} cannot run inside an XLA-compiled function "
            "(`jit_compile=True`): embedding tables are C++ hash tables that XLA "
            "cannot compile. With `model.compile`, keep the default "
            "`jit_compile=\"auto\"` (it chooses False for a model with tables) or "
            "pass False; in a custom loop, look ids up outside the "
            "`tf.function(jit_compile=True)` and pass the rows in.")


def refuse_distribution(what):
    """Each replica would train its own copy of a table: refused (sharded tables'
    shards skip this check, `EmbeddingTable._refuse_strategy`)."""
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        kind = type(strategy).__name__
        raise ValueError(
            f"{what} under the tf.distribute strategy "
            f"{kind} ({strategy.num_replicas_in_sync} replicas) is "
            "not supported for this table: a table built outside a MirroredStrategy's "
            "scope (or a GroupEmbedding table) would train one copy per replica, "
            "silently different from one device. Build EmbeddingVariable layers inside "
            "the strategy's scope (`tf.distribute.MirroredStrategy` or "
            "`MultiWorkerMirroredStrategy`: their tables are sharded over the "
            "replicas), use parameter-server tables "
            "(keras_rec_emb.distribute.parameter_servers), or build and fit outside "
            "any strategy scope.")


def lookup(handle, keys, dim, insert):
    refuse_xla("An embedding table lookup")
    return gen().kre_table_lookup(handle, keys, dim=dim, insert=insert)


def lookup_counted(handle, keys, counts, dim, insert):
    """`lookup` of keys [n], `keys[i]` counted `counts[i]` >= 1 times (a
    training lookup counts frequencies as if each occurrence were looked
    up); rows [n, dim], each key's once."""
    refuse_xla("An embedding table lookup")
    return gen().kre_table_lookup_counted(handle, keys, tf.cast(counts, tf.int32), dim=dim,
                                          insert=insert)


def size(handle, key_dtype):
    return gen().kre_table_size(handle, Tkeys=key_dtype)


# -- Statistics: int64 vectors of named parts ---------------------------------
# Each op returns a vector whose parts these tuples name, in order; its kernel
# checks the tuple (its `parts` attr) against csrc/ops/stat_parts.h, so that
# no number is read by a position the library does not agree on (read them
# through `named_parts`).
TABLE_STATS = ("size", "filtered", "memory_bytes", "latest_step")
STORAGE_STATS = ("rows", "cached_rows", "cache_memory_bytes", "disk_bytes", "cache_hits",
                 "cache_misses", "file_reads", "file_writes")
COUNTER_PARTS = TABLE_STATS + ("lookups", "hits", "admitted_total", "erased_total",
                               "change_epoch", "erased_log")


def named_parts(vector, parts):
    """A dict from each name of `parts` to its scalar of `vector` (works
    eagerly and traced)."""
    return dict(zip(parts, tf.unstack(vector, num=len(parts))))


def stats(handle, key_dtype):
    """The table's sizes, a dict of int64 scalars by TABLE_STATS: admitted
    keys, keys counted but not admitted, memory bytes, latest step."""
    return named_parts(gen().kre_table_stats(handle, Tkeys=key_dtype, parts=TABLE_STATS),
                       TABLE_STATS)


def storage_stats(handle, key_dtype):
    """The row store's counters, a dict of int64 scalars by STORAGE_STATS."""
    return named_parts(gen().kre_table_storage_stats(handle, Tkeys=key_dtype,
                                                     parts=STORAGE_STATS), STORAGE_STATS)


def snapshot(handle, key_dtype):
    """File tier: a snapshot under the table's folder; returns its number."""
    return gen().kre_table_snapshot(handle, Tkeys=key_dtype)


def release_storage(handle, key_dtype):
    """File tier: releases the table's lock on its folder."""
    return gen().kre_table_release_storage(handle, Tkeys=key_dtype)


def restore_snapshot(handle, key_dtype, path=""):
    """File tier: the latest snapshot under `path` (default: the table's
    folder) replaces the contents; returns the number of keys."""
    return gen().kre_table_restore_snapshot(handle, tf.constant(path, tf.string),
                                            Tkeys=key_dtype)


def evict(handle, key_dtype, step, steps_to_live, l2_threshold):
    """Erases stale or small keys (-1 disables a criterion); returns how many."""
    return gen().kre_table_evict(
        handle, tf.constant(step, tf.int64), tf.constant(steps_to_live, tf.int64),
        tf.constant(l2_threshold, tf.float32), Tkeys=key_dtype,
    )


def add_slot(handle, key_dtype, name, width, init):
    return gen().kre_table_add_slot(
        handle, name, tf.constant(width, tf.int64), tf.constant(init, tf.float32),
        Tkeys=key_dtype,
    )


def export(handle, key_dtype, dim, include_filtered=True):
    """The table's parts, a dict by the op's output names (`variables.PARTS`
    declares them)."""
    return gen().kre_table_export(handle, Tkeys=key_dtype, dim=dim,
                                  include_filtered=include_filtered)._asdict()


def import_(handle, dim, parts, clear=True):
    """Loads `parts`, a dict passed by the op's input names (every part of
    `variables.PARTS`)."""
    return gen().kre_table_import(handle, **parts, dim=dim, clear=clear)


def sparse_apply(handle, keys, grads, rule, hyper, step, slots, distinct=False):
    """One fused optimizer step on a table; `hyper` and `slots` in the order
    `keras_rec_emb._update_rules` declares (the kernel checks the names);
    `distinct`: `keys` hold no key twice, so the dedupe is skipped."""
    refuse_xla("An embedding table update")
    names = list(hyper)
    values = tf.stack([tf.cast(h, tf.float32) for h in hyper.values()])
    op = gen().kre_table_sparse_apply_distinct if distinct else gen().kre_table_sparse_apply
    return op(handle, keys, grads, values, tf.cast(step, tf.int64), rule=rule,
              slots=list(slots), hparam_names=names)


def group_sparse_apply(handles, keys, grads, rule, hypers, step, slots):
    """`sparse_apply(..., distinct=True)` of several tables with one key
    dtype, rule and slots in one op, which updates them concurrently;
    `hypers`: each table's hyper-parameters (same names, the rule's order)."""
    refuse_xla("An embedding table update")
    names = list(hypers[0])
    values = [tf.stack([tf.cast(h[n], tf.float32) for n in names]) for h in hypers]
    return gen().kre_group_sparse_apply_distinct(
        list(handles), list(keys), list(grads), values, tf.cast(step, tf.int64), rule=rule,
        slots=list(slots), hparam_names=names)


# -- Change tracking (incremental checkpoints) and counters -----------------

def mark_changes(handle, key_dtype):
    """Closes the table's change epoch; returns it as a mark (int64 scalar)."""
    return gen().kre_table_mark_changes(handle, Tkeys=key_dtype)


def export_changed_since(handle, key_dtype, dim, since):
    """The parts of the keys changed after mark `since` (a dict by the op's
    output names: `variables.PARTS`, plus `erased`, the keys erased after
    it, and `complete`, False when only a full export is correct)."""
    return gen().kre_table_export_changed_since(
        handle, tf.constant(since, tf.int64), Tkeys=key_dtype, dim=dim)._asdict()


def trim_erased(handle, key_dtype, upto):
    """Forgets logged erasures at or before mark `upto`; returns the log size."""
    return gen().kre_table_trim_erased(handle, tf.constant(upto, tf.int64), Tkeys=key_dtype)


def erase(handle, keys):
    """Erases a vector of keys; returns how many were present."""
    return gen().kre_table_erase(handle, keys)


def counters(handle, key_dtype):
    """The table's counters, a dict of int64 scalars by COUNTER_PARTS."""
    return named_parts(gen().kre_table_counters(handle, Tkeys=key_dtype,
                                                parts=COUNTER_PARTS), COUNTER_PARTS)
