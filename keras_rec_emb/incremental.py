"""Incremental checkpoints (DeepRec's Incremental Checkpoint) for online training.

A chain of files in one directory: a full checkpoint (every row of every
table, every dense and optimizer variable, the Kafka position), then
incremental ones holding only the rows changed since the previous link
(values, slots, frequencies, versions, keys counted by a filter), the keys
erased since (eviction), and again all dense variables, the optimizer's
variables (its iteration included) and the Kafka position. The tables know
which rows changed (a per-row change epoch kept in C++), so a save costs
what changed, not the table's size.

Each link is one `.npz` file (NumPy's zip of arrays, no pickles) written to a
temporary name and renamed: a crash mid-save leaves the previous chain. A
restore reads the newest full checkpoint that is intact and replays its
chain, stopping with a warning at the first link that is missing or corrupt.
"""

import glob
import json
import os
import re
import tempfile
import time
import warnings
import zipfile

import keras
import numpy as np

from keras_rec_emb import saving as _saving
from keras_rec_emb import variables as _variables

_FORMAT = "keras_rec_emb.checkpoint/1"
_NAME = re.compile(r"^ckpt-(\d{8,})-(full|incremental)\.npz$")
_TABLE_PARTS = _variables.ARRAY_PARTS


def _tables(model):
    """(name, EmbeddingTable) of every table of `model`, in variable order."""
    out, seen = [], set()
    for v in model.variables:
        if _variables.is_table(v) and id(v.table) not in seen:
            seen.add(id(v.table))
            out.append((v.path, v.table))
    return out


def _export_order(model):
    """Table names in the order `model.export` lists them (`_misc_assets`)."""
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


def apply_to_saved_model(loaded, path):
    """Applies a checkpoint link (full or incremental) to a SavedModel
    written by `model.export` and loaded with `tf.saved_model.load` (after
    `import keras_rec_emb`), in place: its tables take the changed rows and
    drop the erased keys, its dense variables the saved values. The model
    serves the new state from its next call, without a reload (DeepRec's
    incremental model update). Apply the links of a chain in order, from
    the full checkpoint the model was exported at or after.

    Args:
        loaded: the object `tf.saved_model.load` returned.
        path: str. A `ckpt-*.npz` link of an `IncrementalCheckpointer`.

    Returns:
        dict: `tables` (rows imported per table), `erased`, `dense`
        (variables assigned).

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
    import tensorflow as tf

    from keras_rec_emb import _ops

    arrays, meta = IncrementalCheckpointer._read(os.fspath(path))  # pylint: disable=protected-access
    order = meta.get("export_order")
    if not order:
        raise ValueError(f"{path} does not record the export order of its tables")
    handles, seen = [], set()
    for asset in getattr(loaded, "_misc_assets", []):
        handle = getattr(asset, "resource_handle", None)
        if handle is None or id(asset) in seen:
            continue
        seen.add(id(asset))
        handles.append(handle)
    if len(handles) != len(order):
        raise ValueError(f"The loaded model has {len(handles)} tables but {path} holds "
                         f"{len(order)} ({order}); was it exported from this model?")
    index = {name: j for j, name in enumerate(meta["tables"])}
    stats = {"tables": {}, "erased": 0, "dense": 0}
    for handle, name in zip(handles, order):
        prefix = f"t{index[name]}/"
        keys = arrays[prefix + "keys"]
        dim = arrays[prefix + "values"].shape[1]
        slots = sorted(k[len(prefix) + 5:] for k in arrays if k.startswith(prefix + "slot/"))
        blocks = [arrays[f"{prefix}slot/{s}"] for s in slots]
        parts = {k: arrays[prefix + k] for k in _TABLE_PARTS}
        parts["slot_values"] = (np.concatenate(blocks, 1) if blocks
                                else np.zeros((len(keys), 0), np.float32))
        parts["slot_names"] = tf.constant(slots, tf.string, shape=[len(slots)])
        parts["slot_widths"] = np.array([b.shape[1] for b in blocks], np.int64)
        if meta["kind"] == "incremental" and arrays[prefix + "erased"].size:
            stats["erased"] += int(_ops.erase(handle, tf.constant(arrays[prefix + "erased"])))
        _ops.import_(handle, dim, parts, clear=meta["kind"] == "full")
        stats["tables"][name] = len(keys)
    variables = [v for v in getattr(loaded, "variables", []) or [] if v is not None]
    for i, (vname, shape) in enumerate(meta.get("dense_names", [])):
        for j, v in enumerate(variables):
            if v.name.split(":")[0].endswith(vname) and list(v.shape) == shape:
                v.assign(arrays[f"dense/{i}"])
                variables.pop(j)
                stats["dense"] += 1
                break
    return stats


def _dense(model):
    return [v for v in model.variables if not _variables.is_table(v)]


def _optimizer_vars(model):
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return []
    if not opt.built:
        opt.build(model.trainable_variables)
    return [v for v in opt.variables if not _variables.is_table(v)]


def _position(source):
    """The KafkaPosition of `source` (a KafkaPosition or a dataset with one)."""
    if source is None:
        return None
    position = getattr(source, "position", source)
    if not callable(getattr(position, "offsets", None)):
        raise TypeError(
            "`kafka_position` must be a KafkaPosition or a Kafka dataset (with "
            f"`.position`). Received: kafka_position={source!r}")
    return position


class IncrementalCheckpointer:
    """Full and incremental checkpoints of a model, for custom training loops.

    `save_full()` writes every row of every table; `save_incremental()`
    writes only rows changed (trained, admitted, counted) since the previous
    save of this checkpointer plus the keys erased since (eviction), and all
    dense and optimizer variables. `restore()` loads the newest intact full
    checkpoint and replays its incremental chain: the model then equals, row
    for row, the state at the last good link. A missing or corrupt link stops
    the replay there with a warning that names it (and the next save is then
    a full one). `keep` full checkpoints (with their chains) are kept.

    Dense variables and the optimizer's variables are saved whole in every
    link (they are small next to the tables). With a Kafka source, pass its
    `position` (or the dataset): the offsets are saved in every link and
    restored, so a resumed stream re-reads at most what was read after the
    last link (at-least-once; `prefetch` after the dataset holds elements
    already counted as read, so leave it out for exactly the trained ones).

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

    def __init__(self, model, directory, keep=2, kafka_position=None):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model. Received: model={model!r}")
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError("`directory` must be a non-empty path. Received: "
                            f"directory={directory!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"`keep` must be an integer >= 1. Received: keep={keep!r}")
        self.model = model
        self.directory = os.fspath(directory)
        self.keep = keep
        self.kafka_position = _position(kafka_position)
        self._marks = None  # {table name: mark of the last successful save}
        self._base = None   # file name of the chain's full checkpoint
        self._last = None   # file name of the chain's last link
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
        for i, v in enumerate(_dense(self.model)):
            arrays[f"dense/{i}"] = keras.ops.convert_to_numpy(v)
        opt_vars = _optimizer_vars(self.model)
        for i, v in enumerate(opt_vars):
            arrays[f"opt/{i}"] = keras.ops.convert_to_numpy(v)
        meta["dense"] = [v.path for v in _dense(self.model)]
        meta["dense_names"] = [[v.name, list(v.shape)] for v in _dense(self.model)]
        meta["export_order"] = self._export_order()
        meta["optimizer"] = [v.path for v in opt_vars]
        opt = getattr(self.model, "optimizer", None)
        meta["step"] = int(keras.ops.convert_to_numpy(opt.iterations)) if opt is not None else 0
        if self.kafka_position is not None:
            meta["kafka"] = [[t, p, o] for (t, p), o in
                             sorted(self.kafka_position.offsets().items())]

    @staticmethod
    def _table_arrays(arrays, j, parts):
        for k in _TABLE_PARTS:
            arrays[f"t{j}/{k}"] = np.asarray(parts[k])
        for name, rows in parts["slots"].items():
            arrays[f"t{j}/slot/{name}"] = np.asarray(rows)
        if "erased" in parts:
            arrays[f"t{j}/erased"] = np.asarray(parts["erased"])

    def _write(self, kind, arrays, meta):
        os.makedirs(self.directory, exist_ok=True)
        seq = self._next_seq()
        name = f"ckpt-{seq:08d}-{kind}.npz"
        meta.update(format=_FORMAT, kind=kind, seq=seq, time=time.time())
        arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-kre-ckpt-", suffix=".npz", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, _saving.default_mode())
            os.replace(tmp, os.path.join(self.directory, name))
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        path = os.path.join(self.directory, name)
        self.last_save_bytes = os.path.getsize(path)
        return name, path

    def save_full(self):
        """Writes a full checkpoint and starts a new chain; returns its path."""
        tables = _tables(self.model)
        marks = {name: t.mark_changes() for name, t in tables}
        arrays, meta = {}, {"tables": [name for name, _ in tables], "base": None,
                            "parent": None}
        for j, (_, t) in enumerate(tables):
            self._table_arrays(arrays, j, t.export())
        self._common(arrays, meta)
        name, path = self._write("full", arrays, meta)
        self._committed(tables, marks, name, name)
        self._prune()
        return path

    def save_incremental(self):
        """Writes the rows changed since the previous save; returns its path.

        Falls back to `save_full()` when there is no chain yet (first save,
        or after a restore that stopped at a bad link) or when a table's
        contents were replaced wholesale since (e.g. `load_model` into it).
        """
        tables = _tables(self.model)
        if self._marks is None or set(self._marks) != {n for n, _ in tables}:
            return self.save_full()
        marks = {name: t.mark_changes() for name, t in tables}
        arrays = {}
        meta = {"tables": [name for name, _ in tables], "base": self._base,
                "parent": self._last}
        for j, (name, t) in enumerate(tables):
            delta = t.export_changes(self._marks[name])
            if not delta["complete"]:
                return self.save_full()
            self._table_arrays(arrays, j, delta)
        self._common(arrays, meta)
        name, path = self._write("incremental", arrays, meta)
        self._committed(tables, marks, self._base, name)
        return path

    def _committed(self, tables, marks, base, last):
        for name, t in tables:
            t.trim_erased(marks[name])
        self._marks, self._base, self._last = marks, base, last

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

    def _links(self):
        """{seq: (kind, path)} of the chain files in the directory."""
        out = {}
        if not os.path.isdir(self.directory):
            return out
        for path in glob.glob(os.path.join(self.directory, "ckpt-*.npz")):
            m = _NAME.match(os.path.basename(path))
            if m:
                out[int(m.group(1))] = (m.group(2), path)
        return out

    # -- Restoring -------------------------------------------------------------
    @staticmethod
    def _read(path):
        """All arrays of a link and its meta; raises ValueError naming the
        file when it is unreadable (truncated, CRC mismatch, foreign)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}  # reads (and CRC-checks) every member
            meta = json.loads(arrays.pop("__meta__").tobytes().decode())
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path} is not a readable checkpoint link: "
                             f"{type(e).__name__}: {e}") from None
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a keras_rec_emb checkpoint link "
                             f"(format {meta.get('format')!r})")
        return arrays, meta

    def restore(self):
        """Loads the newest intact full checkpoint and replays its chain.

        Returns:
            dict with `links` (paths applied, in order), `step` (the
            optimizer step of the last link), `skipped` (paths not applied:
            a bad full checkpoint, or the link where the chain broke and
            those after it), `kafka` (offsets restored or None); or `None`
            when the directory holds no checkpoint.
        """
        links = self._links()
        if not links:
            return None
        tables = dict(_tables(self.model))
        fulls = sorted((s for s, (k, _) in links.items() if k == "full"), reverse=True)
        skipped = []
        for full_seq in fulls:
            path = links[full_seq][1]
            try:
                arrays, meta = self._read(path)
                self._check(meta, tables, path)
            except ValueError as e:
                warnings.warn(f"Skipping full checkpoint {path}: {e}", stacklevel=2)
                skipped.append(path)
                continue
            break
        else:
            raise ValueError(f"No intact full checkpoint in {self.directory}: "
                             f"{[os.path.basename(p) for p in skipped]} are unreadable")
        full_name = os.path.basename(path)
        self._apply(arrays, meta, tables, full=True)
        applied, last_meta = [path], meta
        broken = False
        for seq in sorted(s for s in links if s > full_seq):
            kind, lpath = links[seq]
            if kind == "full":
                break  # a newer full that failed to load: its chain is not ours
            try:
                arrays, meta = self._read(lpath)
                self._check(meta, tables, lpath)
            except ValueError as e:
                warnings.warn(f"Incremental checkpoint {lpath} is corrupt ({e}); restored up "
                              f"to the last good link {applied[-1]}", stacklevel=2)
                broken = True
                break
            if meta.get("base") != full_name:
                break
            if meta.get("parent") != os.path.basename(applied[-1]):
                warnings.warn(
                    f"The incremental chain of {full_name} misses link "
                    f"{meta.get('parent')!r} (the parent of {lpath}); restored up to the "
                    f"last good link {applied[-1]}", stacklevel=2)
                broken = True
                break
            self._apply(arrays, meta, tables, full=False)
            applied.append(lpath)
            last_meta = meta
        if broken:
            skipped += [p for s, (_, p) in sorted(links.items())
                        if s > full_seq and p not in applied]
        named = _tables(self.model)
        if broken:
            self._marks, self._base, self._last = None, None, None  # next save: full
        else:
            self._marks = {name: t.mark_changes() for name, t in named}
            self._base, self._last = full_name, os.path.basename(applied[-1])
        return {"links": applied, "step": last_meta.get("step", 0), "skipped": skipped,
                "kafka": last_meta.get("kafka")}

    def _check(self, meta, tables, path):
        if sorted(meta.get("tables", [])) != sorted(tables):
            raise ValueError(f"{path} holds tables {meta.get('tables')} but the model has "
                             f"{sorted(tables)}")
        dense = _dense(self.model)
        if len(meta.get("dense", [])) != len(dense):
            raise ValueError(f"{path} holds {len(meta.get('dense', []))} dense variables but "
                             f"the model has {len(dense)}")

    def _apply(self, arrays, meta, tables, full):
        for j, name in enumerate(meta["tables"]):
            prefix = f"t{j}/"
            parts = {k: arrays[prefix + k] for k in _TABLE_PARTS}
            parts["slots"] = {k[len(prefix) + 5:]: v for k, v in arrays.items()
                              if k.startswith(prefix + "slot/")}
            if full:
                tables[name].import_(parts, clear=True)
            else:
                parts["erased"] = arrays[prefix + "erased"]
                tables[name].apply_changes(parts)
        for i, v in enumerate(_dense(self.model)):
            v.assign(arrays[f"dense/{i}"])
        opt_vars = _optimizer_vars(self.model)
        if len(opt_vars) == len(meta.get("optimizer", [])):
            for i, v in enumerate(opt_vars):
                v.assign(arrays[f"opt/{i}"])
        if self.kafka_position is not None and meta.get("kafka") is not None:
            self.kafka_position._advance(  # pylint: disable=protected-access
                {(t, int(p)): int(o) for t, p, o in meta["kafka"]})
