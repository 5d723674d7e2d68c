"""The `keras-rec-emb` command's `demo`, `bench`, `inspect`, `strip-filtered`
and `ps`, run here; `keras_rec_emb_cli` parses the arguments (and `--help`,
`--version` without importing TensorFlow)."""

import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile

import numpy as np

import keras_rec_emb_cli
from keras_rec_emb.saving import default_mode
from keras_rec_emb.data.synthetic import NUM_DENSE, synthetic_ctr


# Where `bench` looks for a checkout's benchmarks/ folder: next to the
# package (an editable install of a checkout), then the current directory.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_REPORT = "report.py"


def bench(args, forwarded):
    """Runs `benchmarks/report.py` of a source checkout with the options in
    `forwarded`; the benchmarks are not part of the installed package."""
    import importlib.util

    if args.benchmarks_dir is not None:
        candidates = [args.benchmarks_dir]
    else:
        candidates = [os.path.join(_CHECKOUT, "benchmarks"), os.path.abspath("benchmarks")]
    found = next((d for d in candidates if os.path.isfile(os.path.join(d, BENCH_REPORT))),
                 None)
    if found is None:
        print("keras-rec-emb bench: error: the benchmarks are not part of the installed "
              "package; they live in the `benchmarks/` folder of a source checkout of "
              f"keras-rec-emb. No benchmarks/{BENCH_REPORT} in: "
              + ", ".join(dict.fromkeys(candidates))
              + ". Run from a checkout (`make bench`), or pass --benchmarks-dir "
              "/path/to/checkout/benchmarks.", file=sys.stderr)
        return 1
    path = os.path.join(found, BENCH_REPORT)
    spec = importlib.util.spec_from_file_location("keras_rec_emb_bench_report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report.main([*forwarded, "--benchmarks-dir", found], prog="keras-rec-emb bench")


def build_model(num_cat, dim, steps_to_live):
    """A DLRM-style model: a bottom MLP on the dense features, one
    GroupEmbedding over the categorical ones (a table each, with a counter
    filter and global-step eviction), a top MLP on both."""
    import keras

    import keras_rec_emb as kre

    dense_in = {f"I{j + 1}": keras.Input((), name=f"I{j + 1}") for j in range(NUM_DENSE)}
    cat_in = {f"C{j + 1}": keras.Input((), dtype="int64", name=f"C{j + 1}")
              for j in range(num_cat)}
    option = kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(2),
        evict_option=kre.GlobalStepEvict(steps_to_live=steps_to_live))
    group = kre.layers.GroupEmbedding(
        {name: kre.layers.FeatureSpec(kre.layers.EmbeddingVariable(
            dim, name=f"emb_{name}", ev_option=option)) for name in cat_in},
        output_mode="concat", name="embeddings")
    bottom = keras.layers.Dense(dim, activation="relu", name="bottom")(
        keras.layers.Concatenate(name="dense")([keras.ops.expand_dims(x, -1)
                                                for x in dense_in.values()]))
    h = keras.layers.Concatenate(name="features")([bottom, group(cat_in)])
    for i, units in enumerate((64, 32)):
        h = keras.layers.Dense(units, activation="relu", name=f"top_{i}")(h)
    out = keras.layers.Dense(1, activation="sigmoid", name="click")(h)
    model = keras.Model({**dense_in, **cat_in}, out)
    model.compile(optimizer=kre.optimizers.AdagradDecay(
        0.05, accumulator_decay_step=1000, accumulator_decay_rate=0.9),
        loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")])
    return model


def _ev_layers(model):
    """The model's EmbeddingVariable layers in model order (depth first:
    a GroupEmbedding's tables where the group is), each once."""
    from keras_rec_emb.backend.tensorflow import compat as _compat
    from keras_rec_emb.layers import EmbeddingVariable

    seen, out = set(), []

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if isinstance(layer, EmbeddingVariable):
            out.append(layer)
        for child in _compat.child_layers(layer):
            visit(child)

    for layer in model.layers:
        visit(layer)
    return out


def demo(args):
    import keras
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf

    import keras_rec_emb as kre

    keras.utils.set_random_seed(0)
    os.makedirs(args.output, exist_ok=True)
    print(f"Writing {args.rows:,} synthetic click rows to Parquet ({NUM_DENSE} dense, "
          f"{args.features} categorical features, ids in [0, 1e9)) ...", flush=True)
    columns = synthetic_ctr(args.rows, args.features)
    split = int(args.rows * 0.9)
    paths = {}
    for part, rows in (("train", slice(0, split)), ("test", slice(split, None))):
        paths[part] = os.path.join(args.output, f"{part}.parquet")
        pq.write_table(pa.table({k: v[rows] for k, v in columns.items()}), paths[part],
                       row_group_size=65536)

    def dataset(part):
        return kre.data.ParquetDataset(paths[part], batch_size=args.batch_size).map(
            lambda batch: ({k: v for k, v in batch.items() if k != "label"}, batch["label"]))

    steps = -(-split // args.batch_size)
    model = build_model(args.features, args.dim, steps_to_live=max(1, steps // 2))
    start = time.perf_counter()
    model.fit(dataset("train"), epochs=args.epochs, shuffle=False,
              verbose=1 if sys.stdout.isatty() else 2,
              callbacks=[kre.callbacks.EvictionCallback(on_epoch_end=True)])
    train_seconds = time.perf_counter() - start
    _, auc = model.evaluate(dataset("test"), verbose=0)

    path = os.path.join(args.output, "model.keras")
    kre.save_model(model, path)
    reloaded = keras.saving.load_model(path)
    probe, _ = next(iter(dataset("test")))
    expect = model.predict(probe, verbose=0)
    same = np.array_equal(expect, reloaded.predict(probe, verbose=0))
    serving = os.path.join(args.output, "serving")
    model.export(serving, verbose=False)
    loaded = tf.saved_model.load(serving)  # keep it alive while serving
    served = loaded.serve(probe).numpy()
    serves = np.allclose(served, expect, rtol=1e-5, atol=1e-6)

    tables = [layer.table.stats() for layer in _ev_layers(model)]
    print()
    print("keras_rec_emb demo summary")
    print(f"  train rows/s              {split * args.epochs / train_seconds:,.0f}")
    print(f"  test AUC                  {auc:.4f}")
    print(f"  admitted ids              {sum(t['size'] for t in tables):,} in {len(tables)} tables")
    print(f"  ids seen once (filtered)  {sum(t['filtered'] for t in tables):,}")
    print(f"  table memory              {sum(t['memory_bytes'] for t in tables) / 2**20:,.1f} MiB")
    print(f"  saved model               {path}")
    print(f"  serving SavedModel        {serving}")
    print(f"  predictions identical after reload: {'yes' if same else 'NO'}")
    print(f"  SavedModel serves the same predictions: {'yes' if serves else 'NO'}")
    return 0 if same and serves else 1


class _InspectError(Exception):
    pass


def _layer_configs(config):
    """{layer name: its config} of every EmbeddingVariable in a `.keras`
    file's config.json, in model order (depth first, as `_ev_layers`)."""
    found = {}

    def visit(node):
        if isinstance(node, dict):
            inner = node.get("config")
            if (isinstance(inner, dict) and isinstance(inner.get("name"), str)
                    and str(node.get("class_name", "")).endswith("EmbeddingVariable")):
                found.setdefault(inner["name"], inner)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    return found


def _storage_option(config):
    """The `StorageOption` config inside a layer config, or None."""
    if isinstance(config, dict):
        if "storage_type" in config:
            return config
        values = config.values()
    elif isinstance(config, list):
        values = config
    else:
        return None
    for value in values:
        found = _storage_option(value)
        if found is not None:
            return found
    return None


def _table_groups(h5):
    """(h5 group, layer name) of every table in a `.keras` weights file: the
    `vars` groups holding an EmbeddingVariable's `keys` and `values`."""
    import h5py

    out = []

    def visit(name, obj):
        if (isinstance(obj, h5py.Group) and name.rsplit("/", 1)[-1] == "vars"
                and isinstance(obj.get("keys"), h5py.Dataset)
                and isinstance(obj.get("values"), h5py.Dataset)):
            owner = obj.attrs.get("name", name)
            out.append((obj, owner.decode() if isinstance(owner, bytes) else str(owner)))

    h5.visititems(visit)
    return out


class _Window(io.RawIOBase):
    """Bytes [start, start + size) of an open file, as a seekable file: a
    stored zip member read in place (Python's member file seeks backwards
    by reading again from the member's start)."""

    def __init__(self, f, start, size):
        super().__init__()
        self._f, self._start, self._size, self._pos = f, start, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self._size - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


@contextlib.contextmanager
def _zip_member(path, name):
    """Member `name` of the zip at `path` as a seekable binary file, in
    constant memory: read in place when stored (as Keras writes), else
    streamed to a temporary file first."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
        if info.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as f:
                f.seek(info.header_offset)
                header = f.read(30)  # the local file header; its name and extra follow
                if header[:4] != b"PK\x03\x04":
                    raise ValueError(f"bad local header of {name}")
                start = (info.header_offset + 30 + int.from_bytes(header[26:28], "little")
                         + int.from_bytes(header[28:30], "little"))
                yield io.BufferedReader(_Window(f, start, info.file_size), 1 << 16)
            return
        with tempfile.TemporaryFile() as tmp, archive.open(info) as member:
            shutil.copyfileobj(member, tmp, 1 << 20)
            tmp.seek(0)
            yield tmp


def _keras_tables(path, rows):
    """The tables of a `.keras` file, read from its arrays: no table is
    built, so this needs no memory for them and works while the model that
    saved them lives (a file-tier table's folder stays with its trainer)."""
    import h5py

    from keras_rec_emb.saving import check_keras_file

    try:
        check_keras_file(path)
    except (OSError, ValueError) as e:  # names the file and the fix
        raise _InspectError(str(e)) from None
    try:
        with zipfile.ZipFile(path) as archive:
            configs = _layer_configs(json.loads(archive.read("config.json")))
        with _zip_member(path, "model.weights.h5") as f, h5py.File(f, "r") as h5:
            tables = [_keras_table(group, name, configs.get(name), rows)
                      for group, name in _table_groups(h5)]
    except (OSError, ValueError, KeyError) as e:
        raise _InspectError(f"{path} could not be read as a .keras model: "
                            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    order = {name: i for i, name in enumerate(configs)}
    return sorted(tables, key=lambda t: order.get(t["name"], len(order)))


# `inspect` reads a table's per-key arrays this many entries at a time: its
# memory does not grow with the table.
INSPECT_CHUNK = 1 << 20
# Tables of more keys than this say how far the reading has come (stderr).
PROGRESS_KEYS = 4 << 20


def _reduce_chunks(dataset, reduce, name, total, done):
    """`reduce` (max or sum) of an HDF5 `dataset`'s entries, read
    INSPECT_CHUNK at a time; progress of table `name` (`done[0]` of the
    `total` entries to read, counted here) on stderr when it is large."""
    result = None
    for start in range(0, int(dataset.shape[0]), INSPECT_CHUNK):
        chunk = dataset[start:start + INSPECT_CHUNK]
        if chunk.size:
            value = reduce(chunk)
            result = value if result is None else reduce(np.array([result, value]))
        done[0] += len(chunk)
        if total > PROGRESS_KEYS:
            print(f"keras-rec-emb inspect: {name}: {done[0] * 100 // total}% of "
                  f"{total:,} entries read", file=sys.stderr, flush=True)
    return result


def _keras_table(group, name, config, rows):
    def part(key, n):
        data = group.get(key)
        return np.zeros(0, np.int64) if data is None else data[:n]

    keys, values = group["keys"], group["values"]
    n = int(keys.shape[0])
    # The latest version and the total frequency, chunk by chunk.
    progress = sum(int(group[k].shape[0]) for k in ("versions", "versions_filtered", "freqs")
                   if k in group)
    done = [0]
    latest = [_reduce_chunks(group[k], np.max, name, progress, done)
              for k in ("versions", "versions_filtered") if k in group]
    latest = [v for v in latest if v is not None]
    total_freq = (_reduce_chunks(group["freqs"], np.sum, name, progress, done)
                  if "freqs" in group else None)
    storage = _storage_option(config) or {}
    return {
        "name": name, "dim": int(values.shape[1]) if values.ndim == 2 else None,
        "key_dtype": np.dtype(keys.dtype).name, "keys": n,
        "filtered": int(group["keys_filtered"].shape[0]) if "keys_filtered" in group else 0,
        "saved_bytes": int(sum(d.size * d.dtype.itemsize for d in group.values()
                               if hasattr(d, "dtype"))),
        "slots": sorted(k[len("slot:"):] for k in group if k.startswith("slot:")),
        "latest_step": int(max(latest)) if latest else None,
        "total_freq": int(total_freq or 0),
        "storage": {"storage": storage.get("storage_type") or "DRAM",
                    "storage_path": storage.get("storage_path")},
        "rows": _rows(part("keys", rows), part("freqs", rows), part("versions", rows),
                      values[:rows]),
    }


def _rows(keys, freqs, versions, values):
    """The rows `inspect` prints: key, frequency, version, first values."""
    return [{"key": int(k), "freq": int(f), "version": int(v),
             "values": [float(x) for x in row[:6]]}
            for k, f, v, row in zip(keys, freqs, versions, values)]


def is_checkpoint_link(path):
    """Whether `path` is a zip holding an IncrementalCheckpointer link's
    metadata (a `ckpt-*.npz`, whatever its name now)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return "__meta__.npy" in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


_LINK_USE = ("Restore its chain into a model with "
             "keras_rec_emb.IncrementalCheckpointer(model, directory).restore(), or "
             "apply it to a served SavedModel with "
             "keras_rec_emb.apply_to_saved_model(loaded, path).")


def _link_tables(path, rows):
    """(what the link is, its tables) of an IncrementalCheckpointer link."""
    from keras_rec_emb import incremental

    try:
        arrays, meta, digest = incremental._read(path)
    except ValueError as e:
        raise _InspectError(f"{e}. {_LINK_USE}") from None
    link = {k: meta.get(k) for k in ("kind", "seq", "chain", "run", "base", "parent",
                                      "step", "kafka", "time")}
    link["checksum"] = digest
    tables = []
    for j, name in enumerate(meta["tables"]):
        t = {k[len(f"t{j}/"):]: v for k, v in arrays.items() if k.startswith(f"t{j}/")}
        keys = t.get("keys", np.zeros(0, np.int64))
        n = min(rows, len(keys))
        versions = np.concatenate([t.get("versions", np.zeros(0, np.int64)),
                                   t.get("versions_filtered", np.zeros(0, np.int64))])
        values = t.get("values", np.zeros((0, 0), np.float32))
        tables.append({
            "name": name, "dim": int(values.shape[1]) if values.ndim == 2 else None,
            "key_dtype": keys.dtype.name, "keys": int(len(keys)),
            "filtered": int(len(t.get("keys_filtered", ()))),
            "erased": int(len(t.get("erased", ()))),
            "slots": sorted(k[len("slot/"):] for k in t if k.startswith("slot/")),
            "latest_step": int(versions.max()) if versions.size else None,
            "rows": _rows(keys[:n], t["freqs"][:n], t["versions"][:n], values[:n]),
        })
    return link, tables


def _saved_model_tables(path):
    """Tables of a SavedModel from its checkpoint: ours (`model.export`)
    keep `keys` and `values`; `export_for_serving`'s are stock hash tables
    (`table-keys` to row numbers) over a [rows, dim] variable."""
    import tensorflow as tf

    prefix = os.path.join(path, "variables", "variables")
    if not os.path.isfile(os.path.join(path, "saved_model.pb")):
        raise _InspectError(f"{path} is a folder but not a SavedModel "
                            "(no saved_model.pb)")
    try:
        shapes = dict(tf.train.list_variables(prefix))
    except Exception as e:
        raise _InspectError(f"{path}: cannot read the SavedModel's variables: "
                            f"{' '.join(str(e).split())[:300]}") from e
    tables = []
    for name, shape in shapes.items():
        owner, _, part = name.rpartition("/.ATTRIBUTES/")
        if part == "keys" and f"{owner}/.ATTRIBUTES/values" in shapes:
            values = shapes[f"{owner}/.ATTRIBUTES/values"]
            filtered = shapes.get(f"{owner}/.ATTRIBUTES/keys_filtered", [0])
            tables.append({"name": owner, "kind": "keras_rec_emb table", "keys": shape[0],
                           "dim": values[1], "filtered": filtered[0]})
        elif part == "table-keys":
            tables.append({"name": owner, "kind": "tf.lookup hash table (serving)",
                           "keys": shape[0], "dim": None, "filtered": 0})
    return sorted(tables, key=lambda t: _natural(t["name"]))


def _natural(name):
    """Sort key: `_misc_assets/2` before `_misc_assets/10`."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("/")]


def _print_rows(rows):
    for row in rows:
        values = np.array2string(np.array(row["values"], np.float32), precision=4,
                                 separator=", ")
        print(f"  key={row['key']} freq={row['freq']} "
              f"version={row['version']} values[:6]={values}")


# The line `inspect` prints per table, by the kind of file read.
_TABLE_LINES = {
    "keras": ("{name}: dim={dim} key_dtype={key_dtype} keys={keys:,} filtered={filtered:,} "
              "saved={saved_bytes:,} bytes slots={any_slots} latest_step={latest_step} "
              "total_freq={total_freq:,}"),
    "checkpoint link": ("{name}: dim={dim} key_dtype={key_dtype} keys={keys:,} "
                        "filtered={filtered:,} erased={erased:,} slots={any_slots} "
                        "latest_step={latest_step}"),
    "SavedModel": "{name}: {kind} dim={any_dim} keys={keys:,} filtered={filtered:,}",
}


def inspect(args):
    link = None
    try:
        if os.path.isdir(args.model):
            tables, source = _saved_model_tables(args.model), "SavedModel"
        elif is_checkpoint_link(args.model):
            (link, tables), source = _link_tables(args.model, args.rows), "checkpoint link"
        else:
            tables, source = _keras_tables(args.model, args.rows), "keras"
    except _InspectError as e:
        print(f"keras-rec-emb inspect: error: {e}", file=sys.stderr)
        return 2
    totals = {"tables": len(tables), "keys": sum(t["keys"] for t in tables),
              "filtered": sum(t["filtered"] for t in tables)}
    if source == "keras":
        totals["saved_bytes"] = sum(t["saved_bytes"] for t in tables)
    if link is not None:
        totals["erased"] = sum(t["erased"] for t in tables)
    if args.json:
        report = {"model": args.model, "format": source, "tables": tables, "totals": totals}
        if link is not None:
            report["link"] = link
        print(json.dumps(report, indent=2))
        return 0
    if link is not None:
        after = (f", after {link['parent']}" if link["kind"] == "incremental" else "")
        print(f"{args.model}: an IncrementalCheckpointer {link['kind']} checkpoint link "
              f"(#{link['seq']} of chain {str(link['chain'])[:12]}, full checkpoint "
              f"{link['base'] or os.path.basename(args.model)}{after}), optimizer step "
              f"{link['step']}, Kafka position {link['kafka']}. {_LINK_USE}")
    elif not tables:
        print(f"{args.model}: no EmbeddingVariable tables")
        return 0
    for t in tables:
        print(_TABLE_LINES[source].format(**t, any_slots=t.get("slots") or "-",
                                          any_dim="-" if t["dim"] is None else t["dim"]))
        if t.get("storage", {}).get("storage") == "FILE":
            print(f"  file tier: storage_path={t['storage']['storage_path']} (a live "
                  "table's folder; the rows above are those saved in this file)")
        _print_rows(t.get("rows", ()))
    line = f"total: {totals['tables']} tables, {totals['keys']:,} keys, " \
           f"{totals['filtered']:,} filtered"
    if "erased" in totals:
        line += f", {totals['erased']:,} erased"
    if "saved_bytes" in totals:
        line += f", {totals['saved_bytes']:,} bytes saved"
    print(line)
    return 0


def strip_filtered(args):
    """Copies a .keras file without the tables' filtered parts."""
    import h5py

    # Parts that only an admission filter needs (DeepRec's strip tool removes
    # them from checkpoints meant for serving).
    from keras_rec_emb.backend.tensorflow.variables import FILTERED_PARTS

    def keep(name, obj):
        return not (isinstance(obj, h5py.Dataset) and "/vars/" in name
                    and name.rsplit("/", 1)[-1] in FILTERED_PARTS)

    from keras_rec_emb.saving import check_keras_file

    check_keras_file(args.input)  # names the file and the fix (run() prints it)
    with zipfile.ZipFile(args.input) as src:
        for name in src.namelist():
            reason = _unsafe_member(name)
            if reason:
                # Copied as is, the name would make whoever unpacks the output
                # (unzip, a serving pipeline) write outside its folder.
                raise ValueError(
                    f"{args.input}: refusing its archive member {name!r}: {reason}. A "
                    ".keras file saved by Keras holds only relative names inside the "
                    "archive; this one was made or altered by something else.")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {args.output}: the folder {folder} does not exist "
                         "(create it first)")
    removed = []
    # Written beside the output and renamed over it: a failure leaves no
    # partial file and an existing output as it was.
    fd, out_path = tempfile.mkstemp(prefix=".tmp-kre-strip-", suffix=".keras", dir=folder)
    os.close(fd)
    try:
        with zipfile.ZipFile(args.input) as src, \
                zipfile.ZipFile(out_path, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                data = src.read(info)
                if info.filename == "model.weights.h5":
                    try:
                        data = _copy_h5(h5py, data, keep, removed)
                    except (OSError, KeyError, ValueError) as e:
                        raise ValueError(
                            f"{args.input}: its model.weights.h5 is corrupt ({e}). "
                            "Restore the file from a copy or save the model "
                            "again.") from None
                dst.writestr(info, data)
        os.chmod(out_path, default_mode())
        os.replace(out_path, args.output)
    finally:
        if os.path.exists(out_path):
            os.remove(out_path)
    print(f"wrote {args.output}: removed {len(removed)} filtered parts"
          + "".join(f"\n  {name}" for name in removed))
    return 0


def _unsafe_member(name):
    """Why the zip member name `name` could point outside the folder it is
    unpacked into, or "" when it cannot."""
    if not name:
        return "the name is empty"
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        return "the name is an absolute path"
    if ".." in re.split(r"[/\\]", name):
        return "the name climbs out of the archive's folder with '..'"
    return ""


def _copy_h5(h5py, data, keep, removed):
    """Copies an h5 file without the parts `keep` refuses; `removed` gets
    "layer name: part" of each (Keras stores a layer's name on its `vars`
    group, its path is the class name and a counter)."""
    out = io.BytesIO()
    with h5py.File(io.BytesIO(data), "r") as src, h5py.File(out, "w") as dst:
        def visit(name, obj):
            if not keep(name, obj):
                owner = obj.parent.attrs.get("name", obj.parent.name)
                if isinstance(owner, bytes):
                    owner = owner.decode()
                removed.append(f"{owner}: {name.rsplit('/', 1)[-1]}")
            elif isinstance(obj, h5py.Group):
                dst.require_group(name).attrs.update(obj.attrs)
            else:
                src.copy(obj, dst.require_group(os.path.dirname(name) or "/"),
                         name=os.path.basename(name))
        dst.attrs.update(src.attrs)
        src.visititems(visit)
    return out.getvalue()


def run(args, forwarded=()):
    """Runs a command parsed by `keras_rec_emb_cli.parser()` (`bench` gets
    the options it forwards to benchmarks/report.py)."""
    if args.command == "bench":
        return bench(args, list(forwarded))
    if args.command == "ps":
        from keras_rec_emb.distribute import ps

        return ps.main(["--ps", args.ps, "--task", str(args.task)])
    commands = {"demo": demo, "inspect": inspect, "strip-filtered": strip_filtered}
    try:
        return commands[args.command](args)
    except (ValueError, OSError) as e:  # bad files, folders, disks: one line each
        if args.command not in ("inspect", "strip-filtered"):
            raise
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        print(f"keras-rec-emb {args.command}: error: {reason}", file=sys.stderr)
        return 2


def main(argv=None):
    return keras_rec_emb_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
