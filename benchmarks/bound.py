"""The memory floor of the peer workload's step, and ours as a multiple of it.

Issue 58, item 1. On the machine it runs on:

1. **The machine's random-access rates** (`benchmarks/bound/probe.cc`,
   compiled here with g++): plain C++ loops over arrays of the workload's
   size (one row per distinct key of the workload, dim floats a row),
   random rows, each access prefetched a few iterations ahead:
   * `probe`: a lookup of a present key in an open-addressing index (int64
     key -> row id, load 0.5): the hash probe every lookup pays;
   * `gather`: a copy of one row into a dense output;
   * `rmw`: Adagrad's update of one row and its accumulator row (read and
     written).
   At 1 thread and at every thread of the machine.
2. **What a step must touch**, from the workload's own ids: per batch and
   feature the distinct ids (`D` per step over all tables). A forward
   lookup must probe and gather each distinct id once; a training step
   must also update each distinct id's row and accumulator. Rows of the
   batch that repeat an id, pooling and the dense layer stay in cache and
   are not counted: the floor is what random memory access alone costs.
   Bound time = `D / probe + D / gather` (forward) and that `+ D / rmw`
   (training). Bytes: 64-byte cache lines, one per index slot and one per
   `dim * 4` bytes of a row (rounded up), read, plus the update's row and
   accumulator read and written.
3. **Ours**, measured: the peer benchmark's own workers
   (`benchmarks/peers/worker_keras.py` and `worker_jax.py`, one
   `GroupEmbedding`, `model.fit`, forward = the embedding part alone in a
   traced function), interleaved rounds, medians; each as a multiple of
   the bound of its thread count.

Issue 58's targets: the training step within 3x of the floor, the forward
within 2x.

Run from the repository root (ids are generated once into OUT/peers-data):

    .venv/bin/python benchmarks/bound.py                # full workload, 1 and 2 threads
    .venv/bin/python benchmarks/bound.py --quick        # tiny sizes

Prints a table and writes bench-report/bound.json.
"""

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
import workload  # noqa: E402

FRAMEWORKS = {"ours_group": "TensorFlow", "ours_jax_group": "JAX"}
LINE = 64  # bytes of a cache line


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def build_probe(out_dir, name="probe"):
    """Compiles bound/NAME.cc (probe.cc, or file_probe.cc for the file
    tier's floor, run by storage.py) into out_dir (again when the source is
    newer)."""
    src, exe = HERE / "bound" / f"{name}.cc", pathlib.Path(out_dir) / name
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["g++", "-O3", "-march=native", "-fno-math-errno", "-pthread", "-Wall",
                        "-Wextra", "-Werror", "-o", str(exe), str(src)], check=True)
    return exe


def machine_rates(exe, rows, dim, threads, ops, repeats):
    """The probe's rates (best of `repeats` runs: the floor is what the
    machine can do, and other jobs only slow a run down)."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([str(exe), str(rows), str(dim), str(threads), str(ops)],
                             check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out))
    return {k: max(r[k] for r in runs) for k in ("probe_per_s", "gather_rows_per_s",
                                                  "rmw_rows_per_s")} | {"runs": runs}


def step_touches(ids, meta):
    """Per step (batch), averaged over the workload's batches: distinct ids
    over all features, ids in all, and the bytes a forward and a training
    step must touch."""
    b, dim = meta["batch"], meta["dim"]
    distinct, total = [], []
    for i in range(meta["batches"]):
        batch = ids[i * b:(i + 1) * b]
        d = n = 0
        for f in range(batch.shape[1]):
            col = batch[:, f, :].ravel()
            col = col[col >= 0]
            n += col.size
            d += int(np.unique(col).size)
        distinct.append(d)
        total.append(n)
    d = statistics.mean(distinct)
    row_lines = -(-dim * 4 // LINE)
    forward_bytes = d * LINE * (1 + row_lines)  # index slot + row, read
    update_bytes = d * LINE * row_lines * 2 * 2  # row and accumulator, read and written
    return {"distinct_ids_per_step": d, "ids_per_step": statistics.mean(total),
            "forward_bytes": forward_bytes, "training_bytes": forward_bytes + update_bytes}


def bounds(touch, rates):
    d = touch["distinct_ids_per_step"]
    forward_s = d / rates["probe_per_s"] + d / rates["gather_rows_per_s"]
    return {"forward_ms": 1e3 * forward_s,
            "training_ms": 1e3 * (forward_s + d / rates["rmw_rows_per_s"])}


def ours(names, data_dir, meta, variant, threads, opts, log_dir):
    import run as peers_run

    popts = peers_run.parse_args(["--rounds", str(opts.rounds), "--steps", str(opts.steps),
                                  "--lookups", str(opts.lookups)] + ["--quick"] * opts.quick)
    return peers_run.run_config(names, data_dir, meta, variant, threads, popts, log_dir)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (workload.QUICK)")
    p.add_argument("--variants", default="single,multi")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lookups", type=int, default=100)
    p.add_argument("--probe-ops", type=int, default=8_000_000,
                   help="random accesses per probe run")
    p.add_argument("--probe-repeats", type=int, default=3)
    p.add_argument("--output-dir", default=str(ROOT / "bench-report"))
    opts = p.parse_args(argv)
    opts.rounds = opts.rounds or (2 if opts.quick else 5)
    variants = [v for v in opts.variants.split(",") if v]
    thread_counts = [int(t) for t in opts.threads.split(",") if t]
    names = [n for n in opts.frameworks.split(",") if n]
    bad = sorted(set(names) - set(FRAMEWORKS))
    if bad:
        p.error(f"unknown --frameworks {bad}; choose from {list(FRAMEWORKS)}")
    out_dir = pathlib.Path(opts.output_dir).resolve()
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    exe = build_probe(out_dir)
    config = dict(workload.QUICK if opts.quick else workload.FULL)
    data_dir = out_dir / ("peers-data" + "-quick" * opts.quick)
    workload.generate(str(data_dir), config)
    from _machine import machine_info

    report = {"benchmark": "bound", "date": datetime.date.today().isoformat(),
              "command": " ".join(["python benchmarks/bound.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "workload": config, "machine": machine_info(),
              "load_avg_start": os.getloadavg(), "results": {}}
    rows = None
    rates = {}
    for variant in variants:
        ids, _, meta = workload.load(str(data_dir), variant)
        touch = step_touches(ids, meta)
        # The table holds every distinct key of the workload (both variants
        # draw from the same vocabularies; sized by this variant's keys).
        rows = max(meta["distinct_keys_total"], 1024)
        for threads in thread_counts:
            key = (rows, threads)
            if key not in rates:
                t0 = time.perf_counter()
                rates[key] = machine_rates(exe, rows, meta["dim"], threads, opts.probe_ops,
                                           opts.probe_repeats)
                log(f"probe {rows} rows, {threads} threads ({time.perf_counter() - t0:.0f} s): "
                    + ", ".join(f"{k} {rates[key][k] / 1e6:.1f}M"
                                for k in ("probe_per_s", "gather_rows_per_s",
                                          "rmw_rows_per_s")))
            bound = bounds(touch, rates[key])
            measured = ours(names, data_dir, meta, variant, threads, opts, log_dir)
            frameworks = {}
            for name in names:
                m = measured[name]
                step_ms = 1e3 / m["steps_per_s"]["median"]
                fwd_ms = m["lookup_ms"]["median"]
                frameworks[name] = {
                    "backend": FRAMEWORKS[name], "step_ms": step_ms, "forward_ms": fwd_ms,
                    "training_vs_bound": step_ms / bound["training_ms"],
                    "forward_vs_bound": fwd_ms / bound["forward_ms"],
                    "steps_per_s": m["steps_per_s"], "lookup_ms": m["lookup_ms"],
                    "cpu_ms_per_step": m["cpu_ms_per_step"]}
            report["results"][f"{variant}-{threads}t"] = {
                "variant": variant, "threads": threads, "table_rows": rows, **touch,
                "machine_rates": {k: v for k, v in rates[key].items() if k != "runs"},
                "probe_runs": rates[key]["runs"], "bound": bound, "frameworks": frameworks}
            (out_dir / "bound.json").write_text(json.dumps(report, indent=1))
    lines = [f"{'config':<10} {'distinct':>9} {'MB fwd':>7} {'MB train':>8} | "
             f"{'bound fwd':>9} {'bound train':>11} | {'backend':<10} {'fwd ms':>7} "
             f"{'x bound':>7} {'step ms':>8} {'x bound':>7}"]
    for key, r in report["results"].items():
        for name, f in r["frameworks"].items():
            lines.append(
                f"{key:<10} {r['distinct_ids_per_step']:>9.0f} {r['forward_bytes'] / 1e6:>7.1f} "
                f"{r['training_bytes'] / 1e6:>8.1f} | {r['bound']['forward_ms']:>7.2f}ms "
                f"{r['bound']['training_ms']:>9.2f}ms | {f['backend']:<10} "
                f"{f['forward_ms']:>7.2f} {f['forward_vs_bound']:>6.1f}x "
                f"{f['step_ms']:>8.2f} {f['training_vs_bound']:>6.1f}x")
    print("\n".join(lines))
    log(f"wrote {out_dir / 'bound.json'}")
    return report


if __name__ == "__main__":
    main()
