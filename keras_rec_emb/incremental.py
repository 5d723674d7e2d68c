"""Incremental checkpoints (DeepRec's Incremental Checkpoint) for online training.

A chain of `.npz` links in one directory: a full checkpoint, then links of
the rows changed since the previous one. See docs/semantics.md,
'Incremental checkpoints'.
"""

import hashlib
import json
import os
import re
import time
import uuid
import warnings
import weakref
import zipfile

import keras
import numpy as np

from keras_rec_emb import _backend
from keras_rec_emb import _checks_core as _checks
from keras_rec_emb import saving as _saving
from keras_rec_emb.tables import ARRAY_PARTS

__all__ = ["IncrementalCheckpointer", "apply_to_saved_model"]

_FORMAT = "keras_rec_emb.checkpoint/2"
# /1 links (no chain id, no parent checksum) still restore, checked by name.
_FORMATS = ("keras_rec_emb.checkpoint/1", _FORMAT)
_NAME = re.compile(r"^ckpt-(\d{8,})-(full|incremental)\.npz$")
_META = "__meta__"
# `export_changes` after this mark returns no rows: a cheap probe of a
# table's slots and filter (and, by the op's `dim`, of its width).
_NO_CHANGES = 2**62


class _Mismatch(ValueError):
    """A readable link that does not fit the model (not a reason to fall
    back to an older checkpoint: every one would fit as badly)."""


def _changes():
    """The backend's `changes` module (backend/<name>/changes.py)."""
    if _backend.is_jax():
        from keras_rec_emb.backend.jax import changes
    else:
        from keras_rec_emb.backend.tensorflow import changes
    return changes


def _tables(model):
    return _changes().tables(model)


def _export_order(model):
    """Table names in `model.export`'s order; None under JAX (no SavedModel of our ops)."""
    if _backend.is_jax():
        return None
    import tensorflow as tf
    from tensorflow.saved_model.experimental import TrackableResource

    class View(tf.train.TrackableView):  # as keras's ExportArchive walks it
        cache = {}

        @classmethod
        def children(cls, obj, save_type="savedmodel", **kwargs):
            try:
                return super().children(obj, save_type, cache=cls.cache)
            except TypeError:
                return {}

    names = {id(t): name for name, t in _tables(model)}
    order = []
    try:
        for t in View(model).descendants():
            if isinstance(t, TrackableResource) and id(t) in names and names[id(t)] not in order:
                order.append(names[id(t)])
    except Exception:  # pylint: disable=broad-except
        return None
    return order


# -- Reading and checking links ------------------------------------------------
def _digest(archive):
    """SHA-256 of the members' names, CRC-32s and sizes (reading checks each CRC)."""
    h = hashlib.sha256()
    for info in sorted(archive.infolist(), key=lambda i: i.filename):
        h.update(f"{info.filename}\0{info.CRC:08x}\0{info.file_size}\n".encode())
    return h.hexdigest()


def _unreadable(path, error):
    return ValueError(f"{path} is not a readable checkpoint link: "
                      f"{type(error).__name__}: {error}")


_READ_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile,
                UnicodeDecodeError)


def _parse_meta(raw, path, kind=None):
    try:
        meta = json.loads(np.asarray(raw).tobytes().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from None
    if not isinstance(meta, dict) or meta.get("format") not in _FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path} is not a keras_rec_emb checkpoint link (format "
                         f"{found!r}; this version reads {list(_FORMATS)})")
    if meta.get("kind") not in ("full", "incremental") or (kind and meta["kind"] != kind):
        raise ValueError(f"{path} is named a {kind} checkpoint but holds a "
                         f"{meta.get('kind')!r} one")
    tables = meta.get("tables")
    if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
        raise ValueError(f"{path} has no valid table list in its metadata")
    return meta


def _read_meta(path, kind=None):
    """(meta, digest), reading only the metadata member."""
    try:
        with zipfile.ZipFile(path) as archive:
            with archive.open(_META + ".npy") as f:
                raw = np.lib.format.read_array(f, allow_pickle=False)
            digest = _digest(archive)
    except _READ_ERRORS as e:
        raise _unreadable(path, e) from None
    return _parse_meta(raw, path, kind), digest


def _read(path, kind=None):
    """(arrays, meta, digest), every member read and CRC-checked."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}  # reads (and CRC-checks) every member
            digest = _digest(z.zip)
        raw = arrays.pop(_META)
    except _READ_ERRORS as e:
        raise _unreadable(path, e) from None
    return arrays, _parse_meta(raw, path, kind), digest


def _chain_id(meta, name):
    """The id of the chain a link belongs to (a /1 link: its base's name)."""
    if meta.get("chain"):
        return str(meta["chain"])
    return "name:" + (name if meta["kind"] == "full" else str(meta.get("base")))


def _follows(meta, parent_name, parent_digest):
    """Whether a link was saved right after that parent (a /1 link records only the name)."""
    if meta.get("parent") != parent_name:
        return False
    recorded = meta.get("parent_digest")
    return recorded is None and meta["format"] != _FORMAT or recorded == parent_digest


def _int_array(arrays, key, path, what, n=None):
    a = arrays.get(key)
    if a is None:
        raise ValueError(f"{path}: {what} lacks its '{key}' array")
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)) or (
            n is not None and a.shape[0] != n):
        need = f"[{n}]" if n is not None else "a vector"
        raise ValueError(f"{path}: '{key}' of {what} must be integers shaped {need}; "
                         f"found {a.dtype} {list(a.shape)}")
    return a


def _float_matrix(arrays, key, path, what, rows=None, cols=None):
    a = arrays.get(key)
    if a is None:
        raise ValueError(f"{path}: {what} lacks its '{key}' array")
    if (a.ndim != 2 or not np.issubdtype(a.dtype, np.floating)
            or rows is not None and a.shape[0] != rows or cols is not None and a.shape[1] != cols):
        raise ValueError(f"{path}: '{key}' of {what} must be floats shaped "
                         f"[{'N' if rows is None else rows}, "
                         f"{'dim' if cols is None else cols}]; found {a.dtype} {list(a.shape)}")
    return a


def _link_table(arrays, meta, j, path):
    """The parts of table `j` (as `export()` gives them), checked here for
    what the import kernel would refuse, before any table is touched."""
    name = meta["tables"][j]
    what, prefix = f"table '{name}'", f"t{j}/"
    arrays = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    keys = _int_array(arrays, "keys", path, what)
    n = keys.shape[0]
    values = _float_matrix(arrays, "values", path, what, rows=n)
    dim = values.shape[1]
    parts = {"keys": keys, "values": values,
             "freqs": _int_array(arrays, "freqs", path, what, n),
             "versions": _int_array(arrays, "versions", path, what, n),
             "default_values": _float_matrix(arrays, "default_values", path, what, cols=dim),
             "keys_filtered": _int_array(arrays, "keys_filtered", path, what)}
    nf = parts["keys_filtered"].shape[0]
    for k in ("freqs_filtered", "versions_filtered"):
        parts[k] = _int_array(arrays, k, path, what, nf)
    bloom = arrays.get("bloom")
    if bloom is None or bloom.ndim != 1 or (bloom.size and bloom.dtype != np.uint8):
        raise ValueError(f"{path}: 'bloom' of {what} must be a uint8 vector")
    parts["bloom"] = bloom
    parts["slots"] = {k[len("slot/"):]: _float_matrix(arrays, k, path, what, rows=n)
                      for k in sorted(arrays) if k.startswith("slot/")}
    if meta["kind"] == "incremental":
        parts["erased"] = _int_array(arrays, "erased", path, what)
    for k, a in [("keys", keys), ("keys_filtered", parts["keys_filtered"])]:
        if np.unique(a).size != a.size:
            raise ValueError(f"{path}: '{k}' of {what} holds a key twice")
    for k in ("freqs", "freqs_filtered"):
        if parts[k].size and parts[k].min() < 0:
            raise ValueError(f"{path}: '{k}' of {what} holds negative counts")
    for k, a in [("values", values)] + [(f"slot '{s}'", b) for s, b in parts["slots"].items()]:
        if not np.isfinite(a).all():
            raise ValueError(f"{path}: {k} of {what} holds NaN or infinite numbers")
    return parts


def _check_table_fits(parts, table, name, path, probe):
    """Key type, slots and filter (`_check_model` checked the width)."""
    for k in ("keys", "keys_filtered", "erased"):
        if k in parts:
            try:
                _checks.check_ids_in_key_range(
                    parts[k], np.dtype(getattr(table.key_dtype, "as_numpy_dtype", table.key_dtype)),
                    f"'{k}' of table '{name}' in {path}")
            except ValueError as e:
                raise _Mismatch(str(e)) from None
    _check_state_fits(parts, name, path, {s: a.shape[1] for s, a in probe["slots"].items()},
                      probe["bloom"].size)


def _check_state_fits(parts, name, path, slot_widths, bloom_bytes, whose="the table's"):
    for slot, block in parts["slots"].items():
        have = slot_widths.get(slot)
        if have is not None and have != block.shape[1]:
            raise _Mismatch(
                f"{path} holds slot '{slot}' of table '{name}' with width "
                f"{block.shape[1]}, but {whose} is {have} (another optimizer?)")
    bloom = parts["bloom"].size
    if bloom and bloom != bloom_bytes:
        raise _Mismatch(
            f"{path} holds a counting Bloom filter of {bloom} bytes for table '{name}', "
            f"but {whose} has {bloom_bytes}: it was saved with other CBFFilter settings")


def _kafka_offsets(meta, path):
    kafka = meta.get("kafka")
    if kafka is None:
        return None
    ok = isinstance(kafka, list) and all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e[1:])
        for e in kafka)
    if not ok:
        raise ValueError(f"{path}: its Kafka position is not a list of "
                         f"[topic, partition, offset]: {kafka!r}")
    return {(t, p): o for t, p, o in kafka}


# -- Serving: links applied to a loaded SavedModel ------------------------------
# The last link each loaded SavedModel took: (chain id, file name, checksum).
_SERVED = weakref.WeakKeyDictionary()


def _served_tables(loaded):
    from keras_rec_emb.backend.tensorflow import compat as _compat

    if loaded is None or isinstance(loaded, (str, bytes, os.PathLike)):
        raise TypeError(
            "`loaded` must be the object `tf.saved_model.load(path)` returned (after "
            "`import keras_rec_emb`), not a path: load the SavedModel first and keep "
            f"it, then apply links to it. Received: loaded={loaded!r}")
    if isinstance(loaded, keras.Model):
        raise TypeError(
            "`loaded` must be a SavedModel loaded with `tf.saved_model.load`; to bring "
            "a keras.Model to the state of a chain use "
            "`IncrementalCheckpointer(model, directory).restore()`. Received: "
            f"loaded={loaded!r}")
    handles, seen = [], set()
    for asset in _compat.exported_resources(loaded):
        handle = getattr(asset, "resource_handle", None)
        if handle is None or id(asset) in seen:
            continue
        seen.add(id(asset))
        handles.append(handle)
    if not handles:
        raise ValueError(
            f"`loaded` ({type(loaded).__name__}) holds no keras_rec_emb tables: pass "
            "what `tf.saved_model.load` returned for a `model.export` of a model with "
            "EmbeddingVariable tables, loaded after `import keras_rec_emb`")
    return handles


def _probe_served(handle, name, parts, path):
    """Checks, without changing it, that a served table takes `parts`."""
    import tensorflow as tf

    from keras_rec_emb.backend.tensorflow import ops as _ops

    dim = parts["values"].shape[1]
    key_dtype = tf.as_dtype(parts["keys"].dtype if parts["keys"].size else np.int64)
    try:
        probe = _ops.export_changed_since(handle, key_dtype, dim, _NO_CHANGES)
    except tf.errors.InvalidArgumentError as e:
        raise ValueError(f"Table '{name}' of the loaded model does not take the rows "
                         f"of {path} ({key_dtype.name} keys, dim {dim}): "
                         f"{e.message}") from None
    slots = {n.decode(): int(w) for n, w in zip(probe["slot_names"].numpy(),
                                                 probe["slot_widths"].numpy())}
    _check_state_fits(parts, name, path, slots, int(probe["bloom"].shape[0]),
                      "the served table's")
    return key_dtype


def apply_to_saved_model(loaded: object, path: str | os.PathLike) -> None:
    """Applies checkpoint links in place to a SavedModel loaded with
    `tf.saved_model.load` (DeepRec's incremental model update): it serves
    the new state from its next call, without a reload. See
    docs/semantics.md, 'Incremental checkpoints'.

    Args:
        loaded: the object `tf.saved_model.load` returned.
        path: str or path-like, a `ckpt-*.npz` link of an
            `IncrementalCheckpointer`; or a list of them.

    Returns:
        dict: `tables` (rows imported per table, summed over the links),
        `erased`, `dense` (variables assigned), `links` (the paths applied,
        in order).

    Example:

    >>> import tempfile
    >>> ids = keras.Input((2,), dtype="int64")
    >>> ev = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")
    >>> model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> _ = model.fit(np.array([[1, 2]]), np.ones((1, 1)), verbose=0)
    >>> ckpt = keras_rec_emb.IncrementalCheckpointer(model, tempfile.mkdtemp())
    >>> _ = ckpt.save_full()
    >>> path = tempfile.mkdtemp() + "/served"
    >>> model.export(path, verbose=False)
    >>> served = tf.saved_model.load(path)   # a live server
    >>> _ = model.fit(np.array([[2, 3]]), np.ones((1, 1)), verbose=0)
    >>> stats = keras_rec_emb.apply_to_saved_model(served, ckpt.save_incremental())
    >>> x = tf.constant([[2, 3]], tf.int64)
    >>> bool(np.allclose(served.serve(x), model.predict(x, verbose=0)))
    True
    """
    if _backend.is_jax():
        raise NotImplementedError(
            "apply_to_saved_model updates a TensorFlow SavedModel of this package's ops "
            "in place, which needs the TensorFlow backend. Under JAX, serve the state of a "
            "checkpoint chain by restoring it (IncrementalCheckpointer(model, directory)."
            "restore()) and writing a stock-TensorFlow SavedModel with "
            "keras_rec_emb.export_for_serving(model, path), e.g. on a schedule.")
    import tensorflow as tf

    from keras_rec_emb.backend.tensorflow import ops as _ops
    from keras_rec_emb.backend.tensorflow import variables as _variables

    handles = _served_tables(loaded)
    paths = [path] if isinstance(path, (str, os.PathLike)) else path
    if (not isinstance(paths, (list, tuple)) or not paths
            or not all(isinstance(p, (str, os.PathLike)) for p in paths)):
        raise TypeError("`path` must be the path of a ckpt-*.npz checkpoint link or a "
                        f"non-empty list of them. Received: path={path!r}")
    # Stage: read and check every link before the first is applied.
    staged = []
    for p in paths:
        p = os.fspath(p)
        arrays, meta, digest = _read(p)
        m = _NAME.match(os.path.basename(p))
        seq = int(meta.get("seq", m.group(1) if m else 0))
        staged.append((seq, p, arrays, meta, digest))
    staged.sort(key=lambda s: s[0])
    position = _SERVED.get(loaded)
    positions = []
    for _, p, arrays, meta, digest in staged:
        name = os.path.basename(p)
        chain = _chain_id(meta, name)
        if meta["kind"] == "incremental" and position is not None and not (
                position[0] == chain and _follows(meta, position[1], position[2])):
            same = position[0] == chain
            raise ValueError(
                f"{p} does not follow the last link this model took, {position[1]}: "
                + (f"it was saved after {meta.get('parent')}. Apply the links of a chain "
                   "in order, each once (a full checkpoint starts over)." if same else
                   "it belongs to another chain. Apply that chain's full checkpoint "
                   "first."))
        position = (chain, name, digest)
        positions.append(position)
    stages = []
    for _, p, arrays, meta, _ in staged:
        order = meta.get("export_order")
        if not order or sorted(order) != sorted(meta["tables"]):
            raise ValueError(f"{p} does not record the export order of its tables")
        if len(handles) != len(order):
            raise ValueError(f"The loaded model has {len(handles)} tables but {p} holds "
                             f"{len(order)} ({order}); was it exported from this model?")
        index = {n: j for j, n in enumerate(meta["tables"])}
        tables = []
        for handle, name in zip(handles, order):
            parts = _link_table(arrays, meta, index[name], p)
            tables.append((handle, name, parts, _probe_served(handle, name, parts, p)))
        stages.append((p, arrays, meta, tables))
    stats = {"tables": {}, "erased": 0, "dense": 0, "links": []}
    for (p, arrays, meta, tables), position in zip(stages, positions):
        for handle, name, parts, key_dtype in tables:
            n = len(parts["keys"])
            key_np = key_dtype.as_numpy_dtype
            given = {k: parts[k] for k in _variables.ARRAY_PARTS}
            given["keys"] = parts["keys"].astype(key_np)
            given["keys_filtered"] = parts["keys_filtered"].astype(key_np)
            given["values"] = parts["values"].astype(np.float32)
            given.update(_variables.pack_slots(
                {s: b.astype(np.float32) for s, b in parts["slots"].items()}, n))
            if meta["kind"] == "incremental" and parts["erased"].size:
                stats["erased"] += int(_ops.erase(handle, tf.constant(
                    parts["erased"].astype(key_np))))
            _ops.import_(handle, parts["values"].shape[1], given,
                         clear=meta["kind"] == "full")
            stats["tables"][name] = stats["tables"].get(name, 0) + n
        variables = [v for v in getattr(loaded, "variables", []) or [] if v is not None]
        for i, (vname, shape) in enumerate(meta.get("dense_names", [])):
            for j, v in enumerate(variables):
                if v.name.split(":")[0].endswith(vname) and list(v.shape) == shape:
                    v.assign(arrays[f"dense/{i}"])
                    variables.pop(j)
                    stats["dense"] += 1
                    break
        stats["links"].append(p)
        _SERVED[loaded] = position
    return stats


def _dense(model):
    return _changes().dense_variables(model)


def _optimizer_vars(model):
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return []
    if not opt.built:
        opt.build(model.trainable_variables)
    return _changes().optimizer_variables(opt)


def _optimizer_keys(paths):
    """Optimizer variable paths without the leading optimizer names (Keras
    numbers them per instance: `adagrad_1`), with `inner/` per level of
    wrapping. An inner optimizer's variable is `loss_scale_optimizer/adam/x`
    when `fit` builds it, `adam/x` when built alone: both are `inner/x`."""
    owners = []
    for path in paths:
        owner = path.partition("/")[0]
        if owner not in owners:
            owners.append(owner)
    keys = []
    for path in paths:
        parts = path.split("/")
        lead = 0
        while lead < len(parts) - 1 and parts[lead] in owners:
            lead += 1
        level = owners.index(parts[lead - 1]) if lead else 0
        keys.append("inner/" * level + "/".join(parts[lead:] if lead else parts))
    return keys


def _refuse_duplicates(names, what):
    """Two variables of one path could not be told apart on restore."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"Cannot checkpoint this model: {what} {twice} name more than one variable. "
            "Incremental checkpoints key variables by path: give the layers (or "
            "variables) that hold them distinct names.")


def _saved_paths(meta, key, path):
    """The paths under `key`, in the order of the members `<dense|opt>/<i>`."""
    paths = meta.get(key, [])
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{path} has no valid list of {key} variables in its metadata")
    if len(set(paths)) != len(paths):
        raise ValueError(f"{path} lists a {key} variable twice: {paths}")
    return paths


def _check_variables(arrays, path, member, what, saved, keys, have):
    """Raises a _Mismatch unless the `member` variables are `have`'s {key: variable}."""
    if sorted(keys) != sorted(have):
        raise _Mismatch(
            f"{path} does not fit this model: its {what} are not the model's (in the "
            f"checkpoint only: {sorted(set(keys) - set(have))}; in the model only: "
            f"{sorted(set(have) - set(keys))}). Nothing was restored. Restore into a model "
            "built as the one that saved the chain, with the same layer names (Keras "
            "numbers the names of unnamed layers per process: name them).")
    kind = "dense" if member == "dense" else "optimizer"
    for i, (key, name) in enumerate(zip(keys, saved)):
        a, v = arrays.get(f"{member}/{i}"), have[key]
        if a is None:
            raise ValueError(f"{path}: {kind} variable {name} lacks its array {member}/{i}")
        if list(a.shape) != list(v.shape):
            raise _Mismatch(
                f"{path} does not fit this model: {kind} variable {name} has shape "
                f"{list(v.shape)} in the model" + (f" (as {v.path})" if v.path != name else "")
                + f" but {list(a.shape)} in the checkpoint")


def checked_arguments(directory, keep, kafka_position):
    """Checks `IncrementalCheckpointer`'s (and `CheckpointCallback`'s) arguments."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise TypeError("`directory` must be a non-empty path. Received: "
                        f"directory={directory!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"`keep` must be an integer >= 1. Received: keep={keep!r}")
    return os.fspath(directory), keep, _position(kafka_position)


def _position(source):
    if source is None:
        return None
    position = getattr(source, "position", source)
    if not callable(getattr(position, "offsets", None)) or not callable(
            getattr(position, "_advance", None)):
        raise TypeError(
            "`kafka_position` must be a keras_rec_emb.data.KafkaPosition, a Kafka "
            "dataset (KafkaDataset / KafkaGroupIODataset, whose `.position` it takes; "
            "not a dataset mapped from one) or None. Received: "
            f"kafka_position={source!r}")
    return position


class _Link:
    """One `ckpt-*.npz` file and its metadata (or why it cannot be read)."""

    def __init__(self, seq, kind, path):
        self.seq, self.kind, self.path = seq, kind, path
        self.name = os.path.basename(path)
        try:
            self.meta, self.digest = _read_meta(path, kind)
            self.error = None
            self.chain = _chain_id(self.meta, self.name)
        except ValueError as e:
            self.meta = self.digest = self.chain = None
            self.error = e

    def base(self):
        if self.meta is None:
            return None
        return self.name if self.kind == "full" else self.meta.get("base")


def _names(links):
    return [link.name for link in links]


class IncrementalCheckpointer:
    """Full and incremental checkpoints of a model, for custom training loops.

    `save_full()` writes every row of every table; `save_incremental()`
    only the rows changed since the previous save and the keys erased since,
    with all dense and optimizer variables (and the Kafka offsets) each time.
    `restore()` replays the newest intact chain, all-or-nothing. See
    docs/semantics.md, 'Incremental checkpoints'.

    Args:
        model: a built `keras.Model` (its tables exist); its optimizer, if
            compiled, is saved too (built first if needed).
        directory: str. The folder of the chain (created if missing).
        keep: int >= 1. Full checkpoints to keep, each with its chain.
            Defaults to `2`.
        kafka_position: a `keras_rec_emb.data.KafkaPosition`, a Kafka dataset,
            or `None`. Defaults to `None`.

    Example:

    >>> ids = keras.Input((2,), dtype="int64")
    >>> ev = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")
    >>> model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> _ = model.fit(np.arange(8).reshape(4, 2), np.ones((4, 1)), verbose=0)
    >>> import os, tempfile
    >>> ckpt = keras_rec_emb.IncrementalCheckpointer(model, tempfile.mkdtemp())
    >>> full = ckpt.save_full()
    >>> _ = model.fit(np.array([[1, 100]]), np.ones((1, 1)), verbose=0)
    >>> delta = ckpt.save_incremental()   # rows 1 and 100 only
    >>> info = ckpt.restore()
    >>> [os.path.basename(p) for p in info["links"]] == [
    ...     os.path.basename(full), os.path.basename(delta)]
    True
    """

    def __init__(self, model: keras.Model, directory: str | os.PathLike, keep: int | None = 2,
                 kafka_position: object | None = None):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model. Received: model={model!r}")
        self.model = model
        self.directory, self.keep, self.kafka_position = checked_arguments(
            directory, keep, kafka_position)
        self._run = uuid.uuid4().hex  # names this checkpointer's saves in their links
        self._marks = None  # {table name: mark of the last successful save}
        self._base = None   # file name of the chain's full checkpoint
        self._last = None   # file name of the chain's last link
        self._last_digest = None  # its checksum
        self._chain = None  # the chain's id
        self.last_save_bytes = 0
        self._order = None  # (table identities, export order): walking the
        # SavedModel view traces the model's functions (~0.3 s), so it runs
        # once per set of tables, not once per save.

    def _export_order(self):
        key = tuple(id(t) for _, t in _tables(self.model))
        if self._order is None or self._order[0] != key:
            self._order = (key, _export_order(self.model))
        return self._order[1]

    def get_config(self):
        return {"directory": self.directory, "keep": self.keep}

    # -- Saving --------------------------------------------------------------
    def _next_seq(self):
        seqs = [int(m.group(1)) for m in map(_NAME.match, os.listdir(self.directory)) if m]
        return max(seqs, default=-1) + 1

    def _common(self, arrays, meta):
        """Member `dense/<i>` holds `meta["dense"][i]`, `opt/<i>` `meta["optimizer"][i]`
        (a restore matches them by path, never by position)."""
        dense = _dense(self.model)
        opt_vars = _optimizer_vars(self.model)
        _refuse_duplicates([v.path for v in dense], "the dense variable paths")
        _refuse_duplicates(_optimizer_keys([v.path for v in opt_vars]),
                           "the optimizer variable paths")
        for i, v in enumerate(dense):
            arrays[f"dense/{i}"] = keras.ops.convert_to_numpy(v)
        for i, v in enumerate(opt_vars):
            arrays[f"opt/{i}"] = keras.ops.convert_to_numpy(v)
        meta["dense"] = [v.path for v in dense]
        meta["dense_names"] = [[v.name, list(v.shape)] for v in dense]
        meta["export_order"] = self._export_order()
        meta["optimizer"] = [v.path for v in opt_vars]
        opt = getattr(self.model, "optimizer", None)
        meta["step"] = int(keras.ops.convert_to_numpy(opt.iterations)) if opt is not None else 0
        if self.kafka_position is not None:
            meta["kafka"] = [[t, p, o] for (t, p), o in
                             sorted(self.kafka_position.offsets().items())]

    @staticmethod
    def _table_arrays(arrays, j, parts, table):
        for k in ARRAY_PARTS:  # the parts a link holds
            arrays[f"t{j}/{k}"] = np.asarray(parts[k])
        if hasattr(table, "step"):  # a JAX table's step counter (backend/jax/changes.py)
            arrays[f"t{j}/step"] = np.asarray(table.step, np.int64)
        for name, rows in parts["slots"].items():
            arrays[f"t{j}/slot/{name}"] = np.asarray(rows)
        if "erased" in parts:
            arrays[f"t{j}/erased"] = np.asarray(parts["erased"])

    def _write(self, kind, arrays, meta):
        """Returns (name, path, checksum)."""
        os.makedirs(self.directory, exist_ok=True)
        seq = self._next_seq()
        name = f"ckpt-{seq:08d}-{kind}.npz"
        meta.update(format=_FORMAT, kind=kind, seq=seq, time=time.time(), run=self._run)
        arrays[_META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        path = os.path.join(self.directory, name)

        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            with zipfile.ZipFile(tmp) as archive:
                return _digest(archive)

        digest = _saving.write_atomically(path, write, ".tmp-kre-ckpt-")
        self.last_save_bytes = os.path.getsize(path)
        return name, path, digest

    def save_full(self):
        """Writes a full checkpoint and starts a new chain; returns its path."""
        tables = _tables(self.model)
        marks = {name: t.mark_changes() for name, t in tables}
        chain = uuid.uuid4().hex
        arrays, meta = {}, {"tables": [name for name, _ in tables], "chain": chain,
                            "base": None, "parent": None, "parent_digest": None}
        for j, (_, t) in enumerate(tables):
            self._table_arrays(arrays, j, t.export(), t)
        self._common(arrays, meta)
        name, path, digest = self._write("full", arrays, meta)
        self._committed(tables, marks, name, name, digest, chain)
        self._prune()
        return path

    def save_incremental(self):
        """Writes the rows changed since the previous save; returns its path.

        Falls back to `save_full()` when there is no chain yet (first save,
        or after a restore that shortened its chain) or when a table's
        contents were replaced wholesale since (e.g. `load_model` into it).
        """
        tables = _tables(self.model)
        if self._marks is None or set(self._marks) != {n for n, _ in tables}:
            return self.save_full()
        marks = {name: t.mark_changes() for name, t in tables}
        arrays = {}
        meta = {"tables": [name for name, _ in tables], "chain": self._chain,
                "base": self._base, "parent": self._last,
                "parent_digest": self._last_digest}
        for j, (name, t) in enumerate(tables):
            delta = t.export_changes(self._marks[name])
            if not delta["complete"]:
                return self.save_full()
            self._table_arrays(arrays, j, delta, t)
        self._common(arrays, meta)
        name, path, digest = self._write("incremental", arrays, meta)
        self._committed(tables, marks, self._base, name, digest, self._chain)
        return path

    def _committed(self, tables, marks, base, last, digest, chain):
        for name, t in tables:
            t.trim_erased(marks[name])
        self._marks, self._base, self._last = marks, base, last
        self._last_digest, self._chain = digest, chain

    def _forget_chain(self):  # the next save starts a new chain
        self._marks = self._base = self._last = self._last_digest = self._chain = None

    def _prune(self):
        links = self._links()
        fulls = sorted(s for s, (kind, _) in links.items() if kind == "full")
        if len(fulls) <= self.keep:
            return
        oldest_kept = fulls[-self.keep]
        for seq, (_, path) in links.items():
            if seq < oldest_kept:
                try:
                    os.remove(path)
                except OSError:
                    pass

    def _links(self):  # {seq: (kind, path)}
        out = {}
        if not os.path.isdir(self.directory):
            return out
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m:
                out[int(m.group(1))] = (m.group(2), os.path.join(self.directory, name))
        return out

    # -- Restoring -------------------------------------------------------------
    def restore(self, partial=False):
        """Loads the newest chain: its full checkpoint and its links.

        Args:
            partial: bool. When the chain is broken in the middle (a link
                missing, unreadable or replaced while later links of the
                chain exist), `False` raises and changes nothing; `True`
                restores up to the last good link, with a warning naming
                the links it drops. Defaults to `False`.

        Returns:
            dict with `links` (paths applied, in order), `step` (the
            optimizer step of the last link), `skipped` (paths in the folder
            newer than the restored full checkpoint and not applied, each
            named in a warning: a bad full checkpoint and its links, foreign
            links, links after a break), `kafka` (offsets restored or None);
            or `None` when the directory holds no checkpoint.

        Raises:
            ValueError: no intact full checkpoint; the chain is broken in
                the middle (without `partial`); the checkpoint does not fit
                the model (it names what differs: tables, dense or optimizer
                variable paths, shapes). The model is unchanged.
        """
        partial = _checks.check_bool("partial", partial)
        found = self._links()
        if not found:
            return None
        links = [_Link(seq, kind, path) for seq, (kind, path) in sorted(found.items())]
        tables = dict(_tables(self.model))
        full, arrays, meta, digest, skipped, reported = self._pick_full(links, tables)
        staged = [(full.path, arrays, meta)]
        applied, broken = self._walk(links, full, digest, tables, staged, skipped,
                                     reported, partial)
        stage = self._validate(staged, tables)
        self._apply(stage, tables)
        last_meta = staged[-1][2]
        if broken:
            self._forget_chain()
        else:
            self._marks = {name: t.mark_changes() for name, t in _tables(self.model)}
            (self._last, self._last_digest), self._base = applied[-1], full.name
            self._chain = _chain_id(meta, full.name)
        return {"links": [p for p, _, _ in staged], "step": last_meta.get("step", 0),
                "skipped": skipped, "kafka": last_meta.get("kafka")}

    def _pick_full(self, links, tables):
        """Of the intact full checkpoints, the one whose chain reaches furthest
        (one continued after a fallback restore is newer than the corrupt one)."""
        def reach(full):
            if full.meta is None:
                return full.seq
            return max([full.seq] + [link.seq for link in links if link.kind == "incremental"
                                     and link.base() == full.name and link.chain == full.chain])

        fulls = sorted((link for link in links if link.kind == "full"),
                       key=lambda f: (reach(f), f.seq), reverse=True)
        skipped, reported = [], set()
        for full in fulls:
            try:
                if full.error is not None:
                    raise full.error
                arrays, meta, digest = _read(full.path, "full")
            except ValueError as e:
                theirs = [link for link in links if link.kind == "incremental"
                          and link.base() == full.name]
                warnings.warn(
                    f"Skipping full checkpoint {full.path}: {e}"
                    + (f"; its incremental links {_names(theirs)} are not applied either"
                       if theirs else ""), stacklevel=3)
                skipped += [full.path] + [link.path for link in theirs]
                reported.update([full.name] + _names(theirs))
                continue
            self._check_model(meta, arrays, tables, full.path)
            return full, arrays, meta, digest, skipped, reported
        raise ValueError(f"No intact full checkpoint in {self.directory}: "
                         f"{_names(fulls)} are unreadable (see the warnings); nothing "
                         "was restored")

    def _walk(self, links, full, digest, tables, staged, skipped, reported, partial):
        """Stages `full`'s chain; returns ([(name, checksum)], whether it ended early)."""
        chain = _chain_id(staged[0][2], full.name)
        by_name = {link.name: link for link in links}
        applied = [(full.name, digest)]
        foreign, others, unknown, dropped = [], [], [], []
        bad = None  # (file name where the chain breaks, why)
        for link in links:
            if link.seq <= full.seq or link.name in reported:
                continue
            if link.meta is None:
                unknown.append(link)
            elif link.kind == "full" or link.base() != full.name:
                others.append(link)
            elif link.chain != chain:
                foreign.append(link)
            elif bad is not None:
                dropped.append(link)
            elif not _follows(link.meta, *applied[-1]):
                bad = self._why_not_next(link, applied[-1][0], by_name, chain)
                dropped.append(link)
            else:
                try:
                    arrays, meta, link_digest = _read(link.path, "incremental")
                    self._check_model(meta, arrays, tables, link.path)
                    if _chain_id(meta, link.name) != chain:
                        raise ValueError("its contents changed while it was read")
                except ValueError as e:
                    bad = (link.name, f"it cannot be applied: {e}")
                    skipped.append(link.path)
                    continue
                staged.append((link.path, arrays, meta))
                applied.append((link.name, link_digest))
        if bad is not None:
            where = (f"The incremental chain of {full.name} is broken at {bad[0]}: "
                     f"{bad[1]}.")
            if dropped and not partial:
                raise ValueError(
                    f"{where} {len(dropped)} later links of the chain ({_names(dropped)}) "
                    "cannot be applied after the break. Nothing was restored. Put the "
                    "link back, or call restore(partial=True) to restore up to the last "
                    f"good link {applied[-1][0]} and drop them.")
            warnings.warn(
                f"{where} Restored up to the last good link {applied[-1][0]}"
                + (f"; dropped the later links {_names(dropped)}" if dropped else "")
                + ". The next save starts a new full checkpoint.", stacklevel=3)
        for link in foreign:
            warnings.warn(
                f"Skipping {link.path}: it names {full.name} as its full checkpoint but "
                f"belongs to another chain (chain {link.chain[:12]}, written by run "
                f"{str(link.meta.get('run'))[:12]}; the restored chain is {chain[:12]}): a "
                "link of another run copied into this folder? It is not applied.",
                stacklevel=3)
        for link in others:
            what = "a newer full checkpoint" if link.kind == "full" else (
                f"a link of the chain of {link.base()}")
            warnings.warn(
                f"Not applying {link.path}: it is {what}, not part of the restored chain "
                f"of {full.name}, which reaches {applied[-1][0]}.", stacklevel=3)
        last_seq = int(_NAME.match(applied[-1][0]).group(1))
        tail = False
        for link in unknown:
            if bad is not None and link.name == bad[0]:
                continue
            if link.seq > last_seq and link.kind == "incremental":
                tail = True  # perhaps the newest link of this chain
                warnings.warn(
                    f"Not applying {link.path}: {link.error}. If it was the newest link "
                    f"of the chain, the chain is restored up to {applied[-1][0]} and the "
                    "next save starts a new full checkpoint.", stacklevel=3)
            else:
                warnings.warn(f"Not applying {link.path}: {link.error}", stacklevel=3)
        skipped += [link.path for link in foreign + others + unknown + dropped]
        return applied, bad is not None or tail

    @staticmethod
    def _why_not_next(link, last, by_name, chain):
        """(where, why) the chain breaks before `link`."""
        parent = link.meta.get("parent")
        found = by_name.get(parent)
        if found is None:
            return parent, f"it is missing ({link.name} follows it)"
        if found.meta is None:
            return parent, f"it is unreadable ({found.error}) and {link.name} follows it"
        if found.chain != chain:
            return parent, (f"{link.name} follows it, but the file of that name is a link "
                            "of another chain (replaced by another run's file?)")
        if parent == last:
            return parent, (f"{link.name} follows it, but its checksum is not the one "
                            f"{link.name} recorded (rewritten or replaced since)")
        return link.name, (f"it was saved after {parent}, not after {last}, the last link "
                           "of the chain before it (two writers in one folder?)")

    def _check_model(self, meta, arrays, tables, path):
        """Tables and dense variables (a _Mismatch names what differs)."""
        have, want = sorted(tables), sorted(meta["tables"])
        if have != want:
            raise _Mismatch(
                f"{path} does not fit this model: it holds the tables {want} but the "
                f"model has {have} (not in the model: {sorted(set(want) - set(have))}; "
                f"not in the checkpoint: {sorted(set(have) - set(want))}). Restore into "
                "a model built as the one that saved the chain (same layers and names).")
        for j, name in enumerate(meta["tables"]):
            values = arrays.get(f"t{j}/values")
            if values is not None and values.ndim == 2 and values.shape[1] != tables[name].dim:
                raise _Mismatch(
                    f"{path} holds rows of dim {values.shape[1]} for table '{name}', which "
                    f"has dim {tables[name].dim}. Restore into a model whose layer has "
                    f"embedding_dim={values.shape[1]}.")
        saved = _saved_paths(meta, "dense", path)
        _check_variables(arrays, path, "dense", "dense variables", saved, saved,
                         {v.path: v for v in _dense(self.model)})

    @staticmethod
    def _check_optimizer(meta, arrays, opt_vars, path):
        saved = _saved_paths(meta, "optimizer", path)
        _check_variables(arrays, path, "opt", "optimizer variables (paths past the "
                         "optimizer's name; compiled with another optimizer?)", saved,
                         _optimizer_keys(saved),
                         dict(zip(_optimizer_keys([v.path for v in opt_vars]), opt_vars)))

    def _validate(self, staged, tables):
        """Everything `_apply` needs, checked before anything changes."""
        dense = _dense(self.model)
        opt_vars = _optimizer_vars(self.model)  # (builds the tables' slots)
        probes = {name: t.export_changes(_NO_CHANGES) for name, t in tables.items()}
        stage = {"tables": {name: [] for name in tables}, "dense": None, "opt": None,
                 "kafka": None}
        for path, arrays, meta in staged:
            for j, name in enumerate(meta["tables"]):
                parts = _link_table(arrays, meta, j, path)
                _check_table_fits(parts, tables[name], name, path, probes[name])
                stage["tables"][name].append((meta["kind"], parts))
        # The last link's variables, by path (_check_model checked that the
        # dense ones are the model's, shapes included). Only its optimizer
        # state is applied: checked here, once the optimizer is built.
        path, arrays, meta = staged[-1]
        by_path = {p: arrays[f"dense/{i}"] for i, p in enumerate(meta["dense"])}
        stage["dense"] = [by_path[v.path] for v in dense]
        if getattr(self.model, "optimizer", None) is not None:
            self._check_optimizer(meta, arrays, opt_vars, path)
            by_key = {k: arrays[f"opt/{i}"]
                      for i, k in enumerate(_optimizer_keys(meta["optimizer"]))}
            stage["opt"] = [by_key[k] for k in _optimizer_keys([v.path for v in opt_vars])]
        stage["kafka"] = _kafka_offsets(meta, path)
        # A JAX table's step counter: its own, or (a link written under
        # TensorFlow) the optimizer's step, which stamped the versions.
        stage["steps"] = {}
        for j, name in enumerate(meta["tables"]):
            if hasattr(tables[name], "step"):
                step = arrays.get(f"t{j}/step")
                stage["steps"][name] = int(meta.get("step", 0) if step is None else step)
        return stage

    def _apply(self, stage, tables):
        """On any failure puts back what it changed and re-raises."""

        dense = _dense(self.model)
        opt_vars = _optimizer_vars(self.model)
        backup = {"dense": [np.array(keras.ops.convert_to_numpy(v)) for v in dense],
                  "opt": [np.array(keras.ops.convert_to_numpy(v)) for v in opt_vars],
                  "tables": {}, "steps": {n: tables[n].step for n in stage["steps"]}}

        def assign(state):  # the variables and the JAX tables' steps of `state`
            for variables, values in ((dense, state["dense"]), (opt_vars, state["opt"] or ())):
                for v, a in zip(variables, values):
                    v.assign(a)
            for name, step in state["steps"].items():
                tables[name].step = step

        try:
            for name, links in stage["tables"].items():
                table = tables[name]
                backup["tables"][name] = table.export()
                for kind, parts in links:
                    if kind == "full":
                        table.import_(parts, clear=True)
                    else:
                        table.apply_changes(parts)
            assign(stage)
        except BaseException as error:
            try:
                for name, data in backup["tables"].items():
                    tables[name].import_(data, clear=True)
                assign(backup)
            except BaseException as again:
                raise RuntimeError(
                    f"Restoring from {self.directory} failed ({type(error).__name__}: "
                    f"{error}) and putting the model back failed too ({type(again).__name__}: "
                    f"{again}): the model is in an unknown state; rebuild it and restore "
                    "again.") from error
            error.add_note(f"(Restoring from {self.directory} failed; the model was put "
                           "back as it was before the restore.)")
            raise
        if self.kafka_position is not None and stage["kafka"] is not None:
            self.kafka_position._advance(stage["kafka"])  # pylint: disable=protected-access
