"""The `keras-rec-emb` command: `demo`, `bench`, `inspect` and `strip-filtered`.

    keras-rec-emb demo [--rows N] [--epochs E] [--output DIR]
    keras-rec-emb bench [--quick] [--output-dir DIR]
    keras-rec-emb inspect MODEL.keras|SAVEDMODEL_DIR [--rows K] [--json]
    keras-rec-emb strip-filtered IN.keras OUT.keras
    keras-rec-emb ps --ps HOST:PORT,HOST:PORT --task I

Arguments are parsed by `keras_rec_emb_cli` (which answers `--help` and
`--version` without importing TensorFlow); the commands run here.
"""

import io
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile

import numpy as np

import keras_rec_emb_cli
from keras_rec_emb.data.synthetic import NUM_DENSE, synthetic_ctr


def write_parquet(path, columns, row_group_size=65536):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


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
    from keras_rec_emb import _compat
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
        write_parquet(paths[part], {k: v[rows] for k, v in columns.items()})

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


def _load_for_inspect(path):
    import keras

    import keras_rec_emb  # noqa: F401  (registers the layers)

    from keras_rec_emb.saving import check_keras_file

    try:
        check_keras_file(path)
    except (OSError, ValueError) as e:  # names the file and the fix
        raise _InspectError(str(e)) from None
    try:
        return keras.saving.load_model(path, compile=False)
    except Exception as e:  # any reason: one line, no traceback
        reason = " ".join(str(e).split())
        raise _InspectError(f"{path} could not be loaded as a Keras model: "
                            f"{type(e).__name__}: {reason[:300]}") from e


def _keras_tables(model, rows):
    tables = []
    for layer in _ev_layers(model):
        data = layer.export()
        stats = layer.table.counters()  # the numbers of callbacks.TableStats
        storage = layer.table.stats()  # with the row store's (file tier) numbers
        tables.append({
            "name": layer.name, "dim": layer.embedding_dim, "key_dtype": layer.key_dtype,
            "keys": stats["size"], "filtered": stats["filtered"],
            "memory_bytes": stats["memory_bytes"], "slots": sorted(data["slots"]),
            "latest_step": stats["latest_step"],
            "max_version": int(data["versions"].max()) if len(data["versions"]) else None,
            "total_freq": int(data["freqs"].sum()),
            "storage": {k: storage[k] for k in (
                "storage", "rows", "cached_rows", "cache_memory_bytes", "disk_bytes",
                "cache_hits", "cache_misses", "cache_hit_rate", "file_reads", "file_writes")},
            "rows": [{"key": int(data["keys"][i]), "freq": int(data["freqs"][i]),
                      "version": int(data["versions"][i]),
                      "values": [float(v) for v in data["values"][i][:6]]}
                     for i in range(min(rows, len(data["keys"])))],
        })
    return tables


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


def inspect(args):
    try:
        if os.path.isdir(args.model):
            tables, source = _saved_model_tables(args.model), "SavedModel"
        else:
            tables, source = _keras_tables(_load_for_inspect(args.model), args.rows), "keras"
    except _InspectError as e:
        print(f"keras-rec-emb inspect: error: {e}", file=sys.stderr)
        return 2
    totals = {"tables": len(tables), "keys": sum(t["keys"] for t in tables),
              "filtered": sum(t["filtered"] for t in tables)}
    if source == "keras":
        totals["memory_bytes"] = sum(t["memory_bytes"] for t in tables)
    if args.json:
        print(json.dumps({"model": args.model, "format": source, "tables": tables,
                          "totals": totals}, indent=2))
        return 0
    if not tables:
        print(f"{args.model}: no EmbeddingVariable tables")
        return 0
    for t in tables:
        if source == "keras":
            print(f"{t['name']}: dim={t['dim']} key_dtype={t['key_dtype']} "
                  f"keys={t['keys']:,} filtered={t['filtered']:,} "
                  f"memory={t['memory_bytes']:,} bytes slots={t['slots'] or '-'} "
                  f"latest_step={t['latest_step']} total_freq={t['total_freq']:,}")
            st = t["storage"]
            if st["storage"] == "FILE":
                print(f"  file tier: rows={st['rows']:,} in_cache={st['cached_rows']:,} "
                      f"cache={st['cache_memory_bytes']:,} bytes "
                      f"on_disk={st['disk_bytes']:,} bytes "
                      f"hit_rate={st['cache_hit_rate']:.3f} "
                      f"file_reads={st['file_reads']:,} file_writes={st['file_writes']:,}")
            for row in t["rows"]:
                values = np.array2string(np.array(row["values"], np.float32), precision=4,
                                         separator=", ")
                print(f"  key={row['key']} freq={row['freq']} "
                      f"version={row['version']} values[:6]={values}")
        else:
            dim = "-" if t["dim"] is None else t["dim"]
            print(f"{t['name']}: {t['kind']} dim={dim} keys={t['keys']:,} "
                  f"filtered={t['filtered']:,}")
    line = f"total: {totals['tables']} tables, {totals['keys']:,} keys, " \
           f"{totals['filtered']:,} filtered"
    if "memory_bytes" in totals:
        line += f", {totals['memory_bytes']:,} bytes"
    print(line)
    return 0


def strip_filtered(args):
    """Copies a .keras file without the tables' filtered parts."""
    import h5py

    # Parts that only an admission filter needs (DeepRec's strip tool removes
    # them from checkpoints meant for serving).
    from keras_rec_emb.variables import FILTERED_PARTS

    def keep(name, obj):
        return not (isinstance(obj, h5py.Dataset) and "/vars/" in name
                    and name.rsplit("/", 1)[-1] in FILTERED_PARTS)

    from keras_rec_emb.saving import check_keras_file

    try:
        check_keras_file(args.input)
    except (OSError, ValueError) as e:  # names the file and the fix
        print(f"keras-rec-emb strip-filtered: error: {e}", file=sys.stderr)
        return 2
    removed = []
    with zipfile.ZipFile(args.input) as src, tempfile.TemporaryDirectory() as tmp:
        if "model.weights.h5" not in src.namelist():
            print(f"keras-rec-emb strip-filtered: error: {args.input} has no "
                  "model.weights.h5: not a .keras model", file=sys.stderr)
            return 2
        out_path = os.path.join(tmp, "out.keras")
        with zipfile.ZipFile(out_path, "w", zipfile.ZIP_DEFLATED) as dst:
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
        shutil.move(out_path, args.output)
    print(f"wrote {args.output}: removed {len(removed)} filtered parts"
          + "".join(f"\n  {name}" for name in removed))
    return 0


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
    except ValueError as e:
        if args.command not in ("inspect", "strip-filtered"):
            raise
        print(f"keras-rec-emb {args.command}: error: {e}", file=sys.stderr)
        return 2


def main(argv=None):
    return keras_rec_emb_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
