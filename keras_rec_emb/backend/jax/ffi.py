"""The table engine (csrc/kv) under JAX, through XLA's FFI.

`keras_rec_emb/_kre_jax.so` (`make jax-ops`, csrc/jax/) holds the handlers;
it links neither TensorFlow nor Python. Each function here binds one
primitive, `kre_table_call`, whose lowering is an XLA custom call to a
handler.

Ordering. A lookup that inserts and an update are side effects on a table
that XLA cannot see. The primitive carries an *ordered* effect (as
`jax.experimental.io_callback(..., ordered=True)` does): JAX threads a token
through every table call, in program order, within a jitted function and
across dispatches. So each call runs exactly once per execution (live even
when its rows are unused, never merged with an identical one by CSE), in
the order the program makes them, and results (`size`, `export`) see every
earlier call's effect. That token reaches the next dispatch as it is when
it is on that dispatch's one device (`_jax_private.pass_tokens_in_place`:
JAX would put it there again at every call, a cost of each dispatch).
The effect keeps such a function off JAX's C++ dispatch; Keras's steps get
`dispatch.OrderedJit`, which runs the compiled executable through JAX's own
execution (the same tokens) without JAX's Python dispatch.

Tables are named by an integer handle (csrc/jax/table_registry.h), a static
attribute of each call. Table management (`create`, `destroy`, `add_slot`,
`size`, `evict`, `stats`, the file tier's and the change tracking's calls)
is not an XLA call: those are plain C functions of the same library
(csrc/jax/table_host.cc), called through ctypes, which take effect when
Python calls them, whatever JAX is tracing (a Keras layer builds its table
inside a trace, where an XLA call would be staged into a computation that
never runs). Each first waits for the table calls already dispatched
(`jax.effects_barrier`). `export` and the save and restore calls run
eagerly only (data-dependent shapes); lookups and applies also run inside
`jit`, `lax.scan`, `custom_vjp` and `grad`.
"""

import ctypes
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Effect, Primitive
from jax.interpreters import mlir

from keras_rec_emb.backend.jax import _jax_private

LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "_kre_jax.so")

# FFI target name -> C symbol of its handler.
TARGETS = {
    "kre_table_lookup": "KreTableLookup",
    "kre_table_apply": "KreTableApply",
    "kre_table_pooled_lookup": "KreTablePooledLookup",
    "kre_table_apply_pooled": "KreTableApplyPooled",
    "kre_table_pooled_lookup_distinct": "KreTablePooledLookupDistinct",
    "kre_table_apply_distinct": "KreTableApplyDistinct",
    "kre_group_pooled_lookup": "KreGroupPooledLookup",
    "kre_group_pooled_lookup_distinct": "KreGroupPooledLookupDistinct",
    "kre_pool_threads": "KrePoolThreads",
    "kre_table_export": "KreTableExport",
    # Save and restore.
    "kre_table_save_info": "KreTableSaveInfo",
    "kre_table_export_aux": "KreTableExportAux",
    "kre_table_import": "KreTableImport",
    # AdaptiveEmbedding's promotion.
    "kre_table_merge": "KreTableMerge",
}

KEY_DTYPES = ("int32", "int64")

_lock = threading.Lock()
_lib = None


def library():
    """The loaded library, its handlers registered with XLA (once)."""
    global _lib
    with _lock:
        if _lib is None:
            if not os.path.exists(LIBRARY):
                raise ImportError(
                    f"the JAX binding's library {LIBRARY} is missing; build it with "
                    "`make jax-ops` in the source checkout")
            lib = ctypes.CDLL(LIBRARY)
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _declare_host_functions(lib)
            _jax_private.pass_tokens_in_place()
            _lib = lib
        return _lib


# csrc/jax/table_host.cc's status codes.
_HOST_OK, _HOST_INVALID = 0, 1
_ERROR_SIZE = 1024


def _declare_host_functions(lib):
    c = ctypes
    i64, out = c.c_int64, c.POINTER(c.c_int64)
    arguments = {
        "KreHostCreate": (c.c_void_p, i64, i64, c.c_int32, c.c_int32, c.c_int32, i64, c.c_float,
                          i64, i64, c.c_int32, c.c_int32, c.c_char_p, i64, out),
        "KreHostEvict": (i64, i64, i64, c.c_float, out),
        "KreHostDestroy": (i64,),
        "KreHostAddSlot": (i64, c.c_char_p, i64, c.c_float),
        "KreHostSize": (i64, out),
        "KreHostStats": (i64, out),
        "KreHostSnapshot": (i64, out),
        "KreHostRestoreSnapshot": (i64, c.c_char_p, out),
        "KreHostReleaseStorage": (i64,),
        "KreHostMarkChanges": (i64, out),
        "KreHostExportChanges": (i64, i64, c.c_void_p, i64, *(c.c_void_p,) * 10),
        "KreHostTrimErased": (i64, i64, out),
        "KreHostErase": (i64, c.c_void_p, i64, c.c_int32, out),
    }
    for name, types in arguments.items():
        fn = getattr(lib, name)
        fn.argtypes = (*types, c.c_char_p, c.c_size_t)  # and the error message's buffer
        fn.restype = c.c_int
    lib.KreLiveTables.argtypes = ()
    lib.KreLiveTables.restype = c.c_int64


def _host(function, *args, wait=True):
    """Calls a management function of csrc/jax/table_host.cc now (after the
    table calls already dispatched, with `wait`); bad input is a ValueError
    with its message, an engine failure a RuntimeError."""
    if wait:
        jax.effects_barrier()
    error = ctypes.create_string_buffer(_ERROR_SIZE)
    status = getattr(library(), function)(*args, error, _ERROR_SIZE)
    if status != _HOST_OK:
        message = error.value.decode("utf-8", "replace")
        raise (ValueError if status == _HOST_INVALID else RuntimeError)(message)


def _host_int(function, *args, wait=True):
    """`_host` for a function whose last argument is an int64 it writes:
    that int."""
    value = ctypes.c_int64(0)
    _host(function, *args, ctypes.byref(value), wait=wait)
    return int(value.value)


class TableEffect(Effect):
    """The effect of a call on an embedding table: ordered (see the top)."""

    def __repr__(self):
        return "KreTableEffect"

    __str__ = __repr__


_EFFECT = TableEffect()
_jax_private.register_ordered_effect(TableEffect)

table_call_p = Primitive("kre_table_call")
table_call_p.multiple_results = True


def _abstract_eval(*avals_in, target, result_avals, attributes):
    del avals_in, target, attributes
    return result_avals, {_EFFECT}


table_call_p.def_effectful_abstract_eval(_abstract_eval)


@functools.lru_cache(maxsize=None)
def _jitted(target, result_avals, attributes):
    return jax.jit(functools.partial(table_call_p.bind, target=target,
                                     result_avals=result_avals, attributes=attributes))


def _impl(*args, target, result_avals, attributes):
    # Outside jit the call is compiled alone (and cached per attributes),
    # also under `jax.disable_jit()` (as JAX's own primitives are): there
    # the jitted bind would call this again, without end.
    with jax.disable_jit(False):
        return _jitted(target, result_avals, attributes)(*args)


table_call_p.def_impl(_impl)


def _lowering(ctx, *operands, target, result_avals, attributes):
    del result_avals
    token = ctx.tokens_in.get(_EFFECT)
    token_aval = _jax_private.abstract_token
    call_ctx = ctx.replace(avals_in=(token_aval, *ctx.avals_in),
                           avals_out=(token_aval, *ctx.avals_out))
    # A tuple attribute (kept hashable for the primitive) is an int64 array.
    attributes = {k: np.asarray(v, np.int64) if isinstance(v, tuple) else v
                  for k, v in attributes}
    op = jax.ffi.build_ffi_lowering_function(target, has_side_effect=True)(
        call_ctx, token, *operands, **attributes)
    results = list(op.results)
    ctx.set_tokens_out(mlir.TokenSet({_EFFECT: results[0]}))
    return results[1:]


mlir.register_lowering(table_call_p, _lowering, platform="cpu")


def _call(target, operands, result_avals, **attributes):
    library()
    return table_call_p.bind(*operands, target=target, result_avals=tuple(result_avals),
                             attributes=tuple(sorted(attributes.items())))


def _aval(shape, dtype):
    return jax.core.ShapedArray(tuple(shape), jnp.dtype(dtype))


def int_dtype():
    """The widest integer JAX holds now: int64 with x64 on, else int32."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(np.int64))


def _check_key_dtype(key_dtype):
    name = np.dtype(key_dtype).name
    if name not in KEY_DTYPES:
        raise ValueError(f"key_dtype must be one of {KEY_DTYPES}. Received: key_dtype={name!r}")
    if name == "int64" and int_dtype() != np.int64:
        raise ValueError(
            "key_dtype='int64' needs JAX's 64-bit mode (jax.config.update('jax_enable_x64', "
            "True) before any array is made); without it JAX holds int32 ids. "
            "Received: key_dtype='int64'")
    return name


def _concrete(value, what):
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{what} runs eagerly: call it outside jax.jit / grad / vmap")
    return value


def create(default_values, key_dtype="int32", num_shards=32, track_meta=True, filter_freq=0,
           no_permission_value=0.0, freq_cap=0, bloom=None, storage_path=None,
           cache_bytes=64 << 20):
    """A new table; returns its handle (a Python int). A new key's row is a
    copy of row `key mod default_value_dim` of `default_values`
    ([default_value_dim, dim], the engine's EV initializer). `filter_freq`
    > 1 admits a key at that count, counted exactly or, with `bloom`
    (`(counters, hashes, bytes per counter)`, `CBFFilter.sizing()`), by a
    counting Bloom filter. With `storage_path` (a folder, which the
    table locks) the rows live in the file tier there, with a DRAM cache
    of about `cache_bytes`. Runs at once, also while a function is being
    traced."""
    key_dtype = _check_key_dtype(key_dtype)
    default_values = np.ascontiguousarray(default_values, dtype=np.float32)
    if default_values.ndim != 2 or min(default_values.shape) < 1:
        raise ValueError("default_values must be [default_value_dim >= 1, dim >= 1]. "
                         f"Received: shape {default_values.shape}")
    return _host_int("KreHostCreate", default_values.ctypes.data, *default_values.shape,
                     64 if key_dtype == "int64" else 32, int(num_shards), int(bool(track_meta)),
                     int(filter_freq), float(no_permission_value), int(freq_cap),
                     *((0, 0, 8) if bloom is None else (int(b) for b in bloom)),
                     os.fsencode(storage_path or ""), int(cache_bytes), wait=False)


def evict(handle, now, steps_to_live, l2_threshold):
    """Erases the keys the eviction rules name (`steps_to_live` >= 0: not
    updated since step `now - steps_to_live`, or not looked up since then
    for keys not admitted; `l2_threshold` >= 0: admitted keys with
    `0.5 * sum(row**2) < l2_threshold`; -1 turns a rule off), after every
    table call already dispatched. `now` < 0 is the latest step that
    updated the table. Returns the number of keys erased."""
    return _host_int("KreHostEvict", int(handle), int(now), int(steps_to_live),
                     float(l2_threshold))


def destroy(handle, wait=True):
    """Destroys table `handle` (after every earlier call on it, with
    `wait`)."""
    _host("KreHostDestroy", int(handle), wait=wait)


def add_slot(handle, name, width, init=0.0):
    """Adds optimizer slot `name` of `width` floats per row (init `init`);
    an existing slot keeps its rows, must have the same width, and takes
    `init` for rows created from now on."""
    _host("KreHostAddSlot", int(handle), str(name).encode(), int(width), float(init))


def lookup(handle, keys, dim, insert=True, prune=False):
    """Rows [*keys.shape, dim] for `keys` (any shape). With `insert`
    (training) missing keys are added with their initializer row and
    every occurrence counts towards its key's frequency; without it
    nothing changes (missing keys read their initializer row). With
    `prune`, keys < 0 are padding: never inserted nor counted, rows of
    zeros."""
    keys = jnp.asarray(keys)
    (rows,) = _call("kre_table_lookup", [keys], [_aval((*keys.shape, dim), np.float32)],
                    table=np.int64(handle), insert=bool(insert), prune=bool(prune))
    return rows


def apply(handle, keys, grads, hyper, step, rule, hparam_names, slots, prune=False):
    """The fused sparse update of rule `rule` (csrc/core/update_rules.h):
    gradients of equal keys summed, then each distinct key's row and slots
    updated once and its version stamped with `step`. `hyper` holds the
    rule's hyper-parameters in the order `hparam_names` names them
    (keras_rec_emb/_update_rules.py), `slots` the slot names it reads.
    With `prune`, keys < 0 (padding) are skipped."""
    keys, grads, hyper, step = _apply_operands(keys, grads, hyper, step)
    _call("kre_table_apply", [keys, grads, hyper, step], [], table=np.int64(handle),
          **_rule_attributes(rule, hparam_names, slots, prune))


def _apply_operands(keys, grads, hyper, step):
    """An update's keys, float32 gradient and hyper-parameters, and its step
    as an integer of JAX's width."""
    step = jnp.asarray(step)
    if step.dtype not in (jnp.int32, jnp.int64):
        step = step.astype(int_dtype())
    return (jnp.asarray(keys), jnp.asarray(grads, dtype=jnp.float32),
            jnp.asarray(hyper, dtype=jnp.float32), step)


def _rule_attributes(rule, hparam_names, slots, prune):
    return dict(rule=str(rule), hparam_names=",".join(hparam_names), slots=",".join(slots),
                prune=bool(prune))


def merge_rows(handle, keys, values, freqs, mask):
    """Writes `values[i]` ([n, dim]) as the row of `keys[i]` ([n]) for each
    i with `mask[i]` != 0, inserting and admitting an absent key (past any
    filter); its frequency becomes `freqs[i]` (-1 keeps the count of a key
    admitted or counted) and its version the table's latest step: the TensorFlow table's
    `merge_rows`, under jit as eagerly (fixed shapes: `mask` marks the
    entries that count). Other keys, slots and filter state stay."""
    keys = jnp.asarray(keys)
    _call("kre_table_merge", [keys, jnp.asarray(values, jnp.float32), jnp.asarray(freqs),
                              jnp.asarray(mask, jnp.int32)], [], table=np.int64(handle))


def _pooled_weights(keys, weights):
    if weights is None:
        return jnp.zeros((0,), jnp.float32)
    return jnp.asarray(weights, dtype=jnp.float32)


def pooled_lookup(handle, keys, dim, combiner, weights=None, insert=True, prune=False):
    """A combiner's lookup in one call: ids `keys` [rows, L] (optional
    per-id `weights` of their shape) -> [rows, dim], each row
    `sum(w * row(id))` divided by the combiner's denominator ("sum": 1,
    "mean": `sum(w)`, "sqrtn": `sqrt(sum(w**2))`; w = 1 without weights;
    zeros when it is 0), as `layers.combine_last_axis` computes it from
    `lookup`'s rows, with no [rows, L, dim] array of rows. With "mean"
    and "sqrtn" a weight <= 0 counts as 0. `insert` and `prune` as
    `lookup`'s (a pruned id has weight 0)."""
    keys = jnp.asarray(keys)
    (out,) = _call("kre_table_pooled_lookup", [keys, _pooled_weights(keys, weights)],
                   [_aval((keys.shape[0], dim), np.float32)], table=np.int64(handle),
                   insert=bool(insert), prune=bool(prune), combiner=str(combiner))
    return out


def group_pooled_lookup(handles, keys, dims, combiners, weights=None, prune=True):
    """The inference lookup of a group of features in one call: ids `keys`
    [rows, F, L] (feature f's ids `keys[:, f, :]`, optional `weights` of
    their shape), feature f pooled by `combiners[f]` from table
    `handles[f]` (of dim `dims[f]`) as `pooled_lookup` (insert=False) does
    -> [rows, sum(dims)], the features' rows concatenated in order."""
    keys = jnp.asarray(keys)
    (out,) = _call("kre_group_pooled_lookup", [keys, _pooled_weights(keys, weights)],
                   [_aval((keys.shape[0], int(sum(dims))), np.float32)],
                   tables=tuple(int(h) for h in handles), combiners=",".join(combiners),
                   prune=bool(prune))
    return out


def group_pooled_lookup_distinct(handles, keys, dims, combiners, weights=None, prune=True):
    """The training lookup of a group of features in one call, each with a
    table of its own: ids `keys` [F, rows, L] (feature f's ids `keys[f]`,
    optional `weights` of their shape) pooled into `group_pooled_lookup`'s
    output, each table inserting as `pooled_lookup_distinct` does, whose
    other outputs come per feature: (rows [rows, sum(dims)], `inverse`
    [F, rows, L] int32, `distinct` [F, rows * L], `count` [F]). With
    XLA's CPU pool of 2+ threads, features are looked up side by side."""
    keys = jnp.asarray(keys)
    if keys.ndim != 3:
        raise ValueError(f"`keys` must be [features, rows, L], got {list(keys.shape)}")
    features, rows, length = keys.shape
    blocks, *distinct = _call(
        "kre_group_pooled_lookup_distinct", [keys, _pooled_weights(keys, weights)],
        [_aval((rows * int(sum(dims)),), np.float32), _aval(keys.shape, np.int32),
         _aval((features, rows * length), keys.dtype), _aval((features,), int_dtype())],
        tables=tuple(int(h) for h in handles), combiners=",".join(combiners), prune=bool(prune))
    # Feature after feature, each its rows [rows, dim] (the handler's
    # comment): joined by XLA, as the per-table calls' outputs are.
    ends = np.cumsum([0, *dims]) * rows
    return (jnp.concatenate([blocks[a:b].reshape(rows, -1) for a, b in zip(ends, ends[1:])],
                            axis=1), *distinct)


@functools.cache
def pool_threads():
    """How many threads a table call gets (XLA's CPU intra-op pool, its
    size set by `NPROC`): 1 when it has none to spare. Asked of XLA once,
    run now (compiled alone) even while a step is traced."""
    library()
    ask = _jitted("kre_pool_threads", (_aval((), np.int32),), ())
    (threads,) = ask.lower().compile()()
    return int(threads)


def apply_pooled(handle, keys, grads, hyper, step, rule, hparam_names, slots, combiner,
                 weights=None, prune=False):
    """`apply` for the gradient `grads` [rows, dim] of a `pooled_lookup`
    of `keys` [rows, L]: id (r, k)'s gradient is its share of row r,
    `w[r, k] / denominator(r) * grads[r]`; then as `apply`: equal ids
    summed, one update per distinct id."""
    keys, grads, hyper, step = _apply_operands(keys, grads, hyper, step)
    _call("kre_table_apply_pooled", [keys, _pooled_weights(keys, weights), grads, hyper, step],
          [], table=np.int64(handle), combiner=str(combiner),
          **_rule_attributes(rule, hparam_names, slots, prune))


def pooled_lookup_distinct(handle, keys, dim, combiner, weights=None, prune=False):
    """A training `pooled_lookup` (it inserts) that looks each distinct id
    up once (counted as often as it occurs) and also returns what
    `apply_distinct` needs to update each distinct id without
    deduplicating the ids again: (rows [rows, dim], `inverse` [rows, L]
    int32, each id's index among the distinct ids (-1 for a pruned one),
    `distinct` [rows * L], the distinct ids first seen first, `count`,
    how many)."""
    keys = jnp.asarray(keys)
    return tuple(_call("kre_table_pooled_lookup_distinct", [keys, _pooled_weights(keys, weights)],
                       [_aval((keys.shape[0], dim), np.float32), _aval(keys.shape, np.int32),
                        _aval((keys.size,), keys.dtype), _aval((), int_dtype())],
                       table=np.int64(handle), prune=bool(prune), combiner=str(combiner)))


def apply_distinct(handle, distinct, count, inverse, grads, hyper, step, rule, hparam_names,
                   slots, combiner, weights=None):
    """`apply_pooled` for the gradient `grads` [rows, dim] of a
    `pooled_lookup_distinct` (its `distinct`, `count` and `inverse`, and
    the same `weights` and `combiner`): each id's share summed per distinct
    id through `inverse`, then one update per distinct id."""
    inverse = jnp.asarray(inverse, jnp.int32)
    distinct, grads, hyper, step = _apply_operands(distinct, grads, hyper, step)
    _call("kre_table_apply_distinct",
          [distinct, jnp.asarray(count), inverse, _pooled_weights(inverse, weights), grads, hyper,
           step], [], table=np.int64(handle), combiner=str(combiner),
          rule=str(rule), hparam_names=",".join(hparam_names), slots=",".join(slots))


def size(handle):
    """[admitted keys, keys counted but not admitted, total slot width,
    number of slots] now (after every table call already dispatched), an
    int64 NumPy array."""
    out = np.zeros(4, np.int64)
    _host("KreHostSize", int(handle), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
    return out


# KreHostStats's values, in its order (keras_rec_emb/backend/tensorflow/ops.py's
# TABLE_STATS, STORAGE_STATS and the rest of COUNTER_PARTS).
STATS = ("size", "filtered", "memory_bytes", "latest_step", "rows", "cached_rows",
         "cache_memory_bytes", "disk_bytes", "cache_hits", "cache_misses", "file_reads",
         "file_writes", "lookups", "hits", "admitted_total", "erased_total", "change_epoch",
         "erased_log")


def stats(handle):
    """The table's statistics and counters now (after every table call
    already dispatched), {name: int} by `STATS`."""
    out = np.zeros(len(STATS), np.int64)
    _host("KreHostStats", int(handle), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
    return dict(zip(STATS, (int(v) for v in out)))


def snapshot(handle):
    """File tier: writes a crash-safe snapshot of the table under its
    folder (after every table call already dispatched); returns its
    number. An I/O error is a RuntimeError naming the file."""
    return _host_int("KreHostSnapshot", int(handle))


def restore_snapshot(handle, path=""):
    """File tier: replaces the contents with the latest snapshot under
    `path` (the table's folder when empty); returns the number of keys. A
    missing or corrupt snapshot is a ValueError naming the file, and
    leaves the table as it was."""
    return _host_int("KreHostRestoreSnapshot", int(handle), os.fsencode(path or ""))


def release_storage(handle, wait=True):
    """File tier: releases the table's lock on its folder (the table works
    on; another may take the folder)."""
    _host("KreHostReleaseStorage", int(handle), wait=wait)


# -- change tracking (incremental checkpoints) ------------------------------

def mark_changes(handle):
    """Closes the table's change epoch (after every table call already
    dispatched) and returns it, an int mark: `export_changes(mark)` later
    returns what changed after it."""
    return _host_int("KreHostMarkChanges", int(handle))


def export_changes(handle, key_dtype, dim, slot_specs, since):
    """The keys changed after mark `since`, shaped like `export_parts`
    (`default_values` and `bloom` whole), plus `erased` (keys erased after
    it) and `complete` (False when the contents were replaced wholesale
    since: only a full export is then correct)."""
    key_dtype = _check_key_dtype(key_dtype)
    width = sum(int(w) for _, w in slot_specs)
    capacity = np.zeros(3, np.int64)
    counts = np.zeros(5, np.int64)
    while True:
        n, nf, ne = (int(c) for c in capacity)
        out = {"keys": np.zeros(n, key_dtype), "values": np.zeros((n, dim), np.float32),
               "freqs": np.zeros(n, np.int64), "versions": np.zeros(n, np.int64),
               "slots": np.zeros((n, width), np.float32),
               "keys_filtered": np.zeros(nf, key_dtype), "freqs_filtered": np.zeros(nf, np.int64),
               "versions_filtered": np.zeros(nf, np.int64), "erased": np.zeros(ne, key_dtype)}
        _host("KreHostExportChanges", int(handle), int(since), capacity.ctypes.data, width,
              *(a.ctypes.data for a in out.values()), counts.ctypes.data)
        if (counts[:3] <= capacity).all():
            break
        capacity = counts[:3].copy()  # (the first call only counts)
    n, nf, ne = (int(c) for c in counts[:3])
    out = {k: a[:nf if k.endswith("_filtered") else ne if k == "erased" else n]
           for k, a in out.items()}
    out["slots"] = _unpacked_slots(out["slots"], slot_specs, int(counts[3]))
    aux = export_aux(handle, key_dtype, dim)
    out.update(default_values=aux[0], bloom=aux[1], complete=bool(counts[4]))
    return out


def trim_erased(handle, upto):
    """Forgets logged erasures at or before mark `upto`; returns how many
    stay logged."""
    return _host_int("KreHostTrimErased", int(handle), int(upto))


def erase(handle, key_dtype, keys):
    """Erases `keys` (absent ones are skipped); returns how many were
    present."""
    key_dtype = _check_key_dtype(key_dtype)
    keys = np.ascontiguousarray(keys, key_dtype).reshape(-1)
    return _host_int("KreHostErase", int(handle), keys.ctypes.data, keys.size,
                     64 if key_dtype == "int64" else 32)


def export(handle, key_dtype, dim):
    """Every admitted key with its row, frequency, version and slot rows
    (slot columns in the order the slots were added), as NumPy arrays in
    `{"keys", "values", "freqs", "versions", "slots"}`. Eager only."""
    key_dtype = _check_key_dtype(key_dtype)
    stats = size(handle)
    capacity, width = int(stats[0]), int(stats[2])
    ints = int_dtype()
    while True:
        *arrays, count = (np.asarray(o) for o in _call("kre_table_export", [], [
            _aval((capacity,), key_dtype), _aval((capacity, dim), np.float32),
            _aval((capacity,), ints), _aval((capacity,), ints),
            _aval((capacity, width), np.float32), _aval((), ints)], table=np.int64(handle)))
        if int(count) <= capacity:
            break
        capacity = int(count)  # rows added on another thread since `size`
    return {n: a[:int(count)] for n, a in zip(("keys", "values", "freqs", "versions", "slots"),
                                              arrays)}


# -- save and restore ---------------------------------------------------------
# The parts of a saved table, as the TensorFlow backend names them
# (keras_rec_emb/backend/tensorflow/variables.py's PARTS; a `.keras` file holds each one under
# its name, and each slot as `slot:NAME`).


def export_parts(handle, key_dtype, dim, slot_specs):
    """`export`'s arrays, with `slots` unpacked into {name: [N, width]} by
    `slot_specs` ((name, width) of each slot, in the order they were
    added), plus the parts `export` lacks: `default_values` (the
    initializer matrix), `bloom` (the counting Bloom filter's bytes) and
    `keys_filtered`, `freqs_filtered`, `versions_filtered` (keys counted
    but not admitted). Eager only."""
    key_dtype = _check_key_dtype(key_dtype)
    defaults, bloom, keys_f, freqs_f, versions_f = export_aux(handle, key_dtype, dim)
    parts = export(handle, key_dtype, dim)
    parts["slots"] = _unpacked_slots(parts["slots"], slot_specs, parts["slots"].shape[1])
    parts.update(default_values=defaults, bloom=bloom, keys_filtered=keys_f,
                 freqs_filtered=freqs_f, versions_filtered=versions_f)
    return parts


def _unpacked_slots(packed, slot_specs, width):
    """{name: [N, width]} of the packed slot columns [N, total] by
    `slot_specs` ((name, width) of each slot, in the order they were
    added), which must describe the table's `width` columns."""
    slot_specs = [(str(name), int(w)) for name, w in slot_specs]
    if sum(w for _, w in slot_specs) != width:
        raise ValueError(f"`slot_specs` must describe the table's {width} slot columns. "
                         f"Received: slot_specs={slot_specs}")
    starts = np.cumsum([0] + [w for _, w in slot_specs])
    return {name: packed[:, a:a + w] for (name, w), a in zip(slot_specs, starts)}


def export_aux(handle, key_dtype, dim):
    """The parts `export` lacks: (`default_values`, `bloom`, `keys_filtered`,
    `freqs_filtered`, `versions_filtered`). Eager only."""
    key_dtype = _check_key_dtype(key_dtype)
    ints = int_dtype()
    (info,) = _call("kre_table_save_info", [], [_aval((3,), ints)], table=np.int64(handle))
    default_rows, bloom_bytes, capacity = (int(v) for v in np.asarray(_concrete(info, "export")))
    while True:
        outs = _call("kre_table_export_aux", [], [
            _aval((default_rows, dim), np.float32), _aval((bloom_bytes,), np.uint8),
            _aval((capacity,), key_dtype), _aval((capacity,), ints), _aval((capacity,), ints),
            _aval((), ints)], table=np.int64(handle))
        defaults, bloom, keys_f, freqs_f, versions_f, count = (np.asarray(o) for o in outs)
        count = int(count)
        if count <= capacity:
            break
        capacity = count  # keys counted since `save_info`
    return defaults, bloom, keys_f[:count], freqs_f[:count], versions_f[:count]


def _parts_array(data, name, dtype, shape, default=None):
    """`data[name]` as a NumPy array of `dtype`, checked against `shape`
    (None: any length there); a ValueError names the part."""
    if name not in data or data[name] is None:
        if default is None:
            raise ValueError(f"the saved table has no `{name}`")
        return default
    value = np.asarray(data[name])
    if value.ndim != len(shape) or any(w is not None and w != g
                                       for w, g in zip(shape, value.shape)):
        want = "[" + ", ".join("any" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"`{name}` must have shape {want}. Received: shape {value.shape}")
    dtype = np.dtype(dtype)
    if value.size and dtype.kind in "iu":
        if value.dtype.kind not in "iu":
            raise ValueError(f"`{name}` must hold integers. Received: dtype {value.dtype}")
        info = np.iinfo(dtype)
        if value.min() < info.min or value.max() > info.max:
            raise ValueError(
                f"`{name}` holds values outside {dtype.name} (range [{value.min()}, "
                f"{value.max()}]); JAX holds {dtype.name} without its 64-bit mode "
                "(jax.config.update('jax_enable_x64', True))")
    elif value.size and dtype.kind == "f" and value.dtype.kind not in "fiu":
        raise ValueError(f"`{name}` must hold numbers. Received: dtype {value.dtype}")
    return value.astype(dtype, copy=False)


def import_parts(handle, key_dtype, dim, data, clear=True):
    """Replaces the contents of table `handle` with the parts in `data`
    (what `export_parts` returns, or a TensorFlow-backend `export()`:
    `slots` a {name: [N, width]} dict, or packed as `slots` [N, total
    width] with `slot_names` and `slot_widths`). `keys` and `values` are
    required; a missing part is empty (no slots, zero frequencies and
    versions, the table's own initializer and Bloom counters). Eager only;
    a failed import leaves the table as it was. With `clear=False` the
    parts are written into the live table instead (rows overwritten or
    added, other keys kept: an incremental checkpoint's delta)."""
    key_dtype = _check_key_dtype(key_dtype)
    ints = int_dtype()
    keys = _parts_array(data, "keys", key_dtype, (None,))
    n = len(keys)
    values = _parts_array(data, "values", np.float32, (n, dim))
    zeros = np.zeros(n, ints)
    freqs = _parts_array(data, "freqs", ints, (n,), zeros)
    versions = _parts_array(data, "versions", ints, (n,), zeros)
    slots = data.get("slots")
    if isinstance(slots, dict):
        names = [str(name) for name in slots]
        blocks = [_parts_array(slots, name, np.float32, (n, None)) for name in names]
        widths = [b.shape[1] for b in blocks]
        slot_values = (np.concatenate(blocks, axis=1) if blocks
                       else np.zeros((n, 0), np.float32))
    else:
        names = [name.decode() if isinstance(name, bytes) else str(name)
                 for name in data.get("slot_names", ())]
        widths = [int(w) for w in data.get("slot_widths", ())]
        if len(names) != len(widths):
            raise ValueError("`slot_names` and `slot_widths` must have one length. Received: "
                             f"{len(names)} and {len(widths)}")
        slot_values = _parts_array(data, "slots", np.float32, (n, sum(widths)),
                                   np.zeros((n, 0), np.float32))
    for name in names:
        if not name or "," in name:
            raise ValueError(f"slot names must be non-empty without ','. Received: {name!r}")
    defaults = _parts_array(data, "default_values", np.float32, (None, dim),
                            np.zeros((0, dim), np.float32))
    keys_f = _parts_array(data, "keys_filtered", key_dtype, (None,), np.zeros(0, key_dtype))
    nf = len(keys_f)
    freqs_f = _parts_array(data, "freqs_filtered", ints, (nf,), np.zeros(nf, ints))
    versions_f = _parts_array(data, "versions_filtered", ints, (nf,), np.zeros(nf, ints))
    bloom = _parts_array(data, "bloom", np.uint8, (None,), np.zeros(0, np.uint8))
    outs = _call("kre_table_import", [
        keys, values, freqs, versions, slot_values, np.asarray(widths, ints), defaults, keys_f,
        freqs_f, versions_f, bloom], [], table=np.int64(handle), slot_names=",".join(names),
        clear=bool(clear))
    jax.block_until_ready(outs)
