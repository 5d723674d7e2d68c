"""Training steps/s of a file-tier table (cache of 10% of its rows) vs DRAM.

Issue 14, item 6. One model, built twice side by side in one process: ids
[--batch, --features] (Zipf(--zipf-a) draws over --vocab ids per feature,
each feature offset into its own id range) -> one
``keras_rec_emb.layers.EmbeddingVariable(--dim)`` (sum over features) ->
Dense(1), mean squared error, ``keras_rec_emb.optimizers.Adagrad`` (fused
sparse update, one slot). The tables differ only in their
``StorageOption``: DRAM, or FILE with a DRAM cache of --cache-fraction of
the table's row bytes (values + accumulator). --batches distinct batches
are made once; every model first trains over all of them (warm-up: every
id inserted), then the models take turns, --reps rounds of --steps steps
each; a model's steps/s is one over its median time per step.

Reported: steps/s of both and their ratio (issue 58's target: >= 0.8x),
the same ratio from the process CPU time per step (less sensitive to
other work on the machine; each round's ratio too), the cache hit rate
during the timed steps (the table's counter, which counts the update's
fetches of the rows the lookup just loaded as hits), the rows read from
file a step (the table's misses) per distinct id of the step, bytes on
disk per key against
``4 * dim * (1 + slots)``, the time of one snapshot, and the peak RSS of
the process (``ru_maxrss``, both models included).

And the file tier's floor on this machine: a step of the FILE table must at
least do the DRAM table's step plus, per distinct id that misses, one read
of its record from the page cache and one append of the dirty row it
evicts (compaction and the table's own work left out).
``benchmarks/bound/file_probe.cc`` measures both rates over a file of the
table's size and record width, at --floor-threads threads: reads with pread
as the file tier does them (sorted, neighbours merged; the best of the
gaps it tries) and, for comparison, from a memory map (the page cache at
memory speed). Misses are counted twice: the rows the table read from
file (measured), and the misses of the static bound (the cached-rows most frequent ids of the trace
always cached, which no replacement policy beats). The floor's ratio
``DRAM step / (DRAM step + misses * (1/read + 1/append))`` is the best
FILE/DRAM any file tier of this cache size could reach here.

With --scale (issue 14's scale run; not part of `make test`, whose
benchmark test runs it tiny): one FILE table of --scale-keys ids (default
100M) x --dim with its Adagrad accumulator and a DRAM cache of
--scale-cache-bytes (default 2 GiB). The table is filled by importing
chunks of --scale-chunk ids (values and accumulators drawn at random, no
row passes through a DRAM table), stopping early after
--scale-fill-seconds; then --scale-steps training steps (batch --batch x
--features, Zipf(--zipf-a) ids over the filled ids) are timed. Reported:
ids filled and fill rate, steps/s, cache hit rate, peak RSS (ru_maxrss)
and the RSS at the end split into anonymous and file pages, DRAM held by
the table, and bytes on disk per key against 4 * dim * (1 + slots).

Run from the repository root:

    .venv/bin/python benchmarks/storage.py                 # small default (~1 min)
    .venv/bin/python benchmarks/storage.py --vocab 4000000 --batches 200
    .venv/bin/python benchmarks/storage.py --scale --storage-dir /work/tmp/kre-scale

Writes --json (default benchmarks/storage.json, with --scale
benchmarks/storage_scale.json).
"""

import datetime
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np

import keras_rec_emb as kre

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser
from bound import build_probe
from _machine import machine_info, write_json_report

TARGET_FILE_VS_DRAM = 0.8  # issue 58, item 5 (issue 14's was 0.5)
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "storage.json")
DEFAULT_SCALE_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                  "storage_scale.json")
TARGET_SCALE_RSS = 6 * 2**30


# The trace: --batches batches of ids [--batch, --features], Zipf(--zipf-a)
# draws over --vocab ids per feature (cache_policy.py replays it).
WORKLOAD = {"batch": 4096, "features": 26, "vocab": 200_000, "zipf_a": 1.1, "batches": 20}


def make_batches(opts):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(opts.batches):
        z = rng.zipf(opts.zipf_a, size=(opts.batch, opts.features)) % opts.vocab
        ids = z + np.arange(opts.features, dtype=np.int64) * opts.vocab
        y = rng.normal(size=(opts.batch, 1)).astype(np.float32)
        out.append((ids.astype(np.int64), y))
    return out


def build(opts, storage):
    keras.utils.set_random_seed(1)
    option = kre.EmbeddingVariableOption(storage_option=storage)
    ids = keras.Input((opts.features,), dtype="int64")
    emb = kre.layers.EmbeddingVariable(opts.dim, ev_option=option, combiner="sum",
                                       name="table")(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(emb))
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="mse")
    return model


def time_steps(model, batches, steps, cpu=None):
    """The median wall time of a step; appends the process CPU time per
    step (all threads) to `cpu` when given."""
    times = []
    c0 = time.process_time()
    for i in range(steps):
        ids, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        model.train_on_batch(ids, y)
        times.append(time.perf_counter() - t0)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / steps)
    return statistics.median(times)


def lookup_misses_static(batches, steps, cached_rows):
    """Per timed step (the first `steps` of the cycle over `batches`, as
    time_steps takes them), on average: the distinct ids, and those not
    among the `cached_rows` ids of the trace seen in most batches (the
    static bound)."""
    per_batch = [np.unique(ids) for ids, _ in batches]
    keys, counts = np.unique(np.concatenate(per_batch), return_counts=True)
    top = keys[np.argsort(-counts, kind="stable")[:cached_rows]]
    timed = [per_batch[i % len(per_batch)] for i in range(steps)]
    distinct = statistics.mean(len(s) for s in timed)
    misses = statistics.mean(len(s) - int(np.isin(s, top).sum()) for s in timed)
    return distinct, misses


def file_floor(folder, rows, rec_bytes, misses, threads, repeats):
    """The file_probe rates (records/s) for `misses` reads a step over a file
    of `rows` records of `rec_bytes` in `folder`."""
    import json
    import subprocess

    exe = build_probe(folder, "file_probe")
    reads = max(1, min(int(round(misses)), rows // 2))
    out = subprocess.run([str(exe), folder, str(rows), str(rec_bytes), str(reads),
                          str(threads), str(repeats)],
                         check=True, capture_output=True, text=True).stdout
    rates = json.loads(out)
    rates["pread_best_per_s"] = max(rates[k] for k in rates if k.startswith("pread_"))
    return rates


def floor_report(dram_step_s, misses, rates):
    """The floor's extra time a step and FILE/DRAM ratio, by pread and by map."""
    out = {"misses_per_step": misses}
    for how, read in (("pread", rates["pread_best_per_s"]), ("map", rates["map_per_s"])):
        extra = misses / read + misses / rates["append_per_s"]
        out[how] = {"extra_ms": 1e3 * extra, "file_over_dram": dram_step_s / (dram_step_s + extra)}
    return out


def rss_now():
    """The process's RSS now, from /proc/self/status: total, anonymous and
    file-backed (mapped file pages) bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def scale_run(opts, folder):
    """The scale run (see the module docstring); returns the report."""
    per_feature = max(1, opts.scale_keys // opts.features)
    total = per_feature * opts.features
    model = build(opts, kre.StorageOption("FILE", storage_path=folder,
                                          storage_size=opts.scale_cache_bytes))
    rng = np.random.default_rng(0)

    def batch():
        z = (rng.zipf(opts.zipf_a, size=(opts.batch, opts.features)) - 1) % per_feature
        ids = z + np.arange(opts.features, dtype=np.int64) * per_feature
        return ids.astype(np.int64), rng.normal(size=(opts.batch, 1)).astype(np.float32)

    model.train_on_batch(*batch())  # builds the optimizer: the accumulator slot exists
    layer = model.get_layer("table")
    slot_names = sorted(layer.export()["slots"])
    rss_built = rss_now()["VmRSS"]
    filled, t0 = 0, time.perf_counter()
    while filled < total and time.perf_counter() - t0 < opts.scale_fill_seconds:
        n = min(opts.scale_chunk, total - filled)
        keys = np.arange(filled, filled + n, dtype=np.int64)
        values = rng.normal(scale=0.05, size=(n, opts.dim)).astype(np.float32)
        slots = {name: rng.uniform(0.1, 1.0, size=(n, opts.dim)).astype(np.float32)
                 for name in slot_names}
        layer.table.import_({"keys": keys, "values": values, "slots": slots}, clear=False)
        filled += n
        if opts.verbose:
            print(f"  filled {filled:,} ids, {time.perf_counter() - t0:.0f} s, "
                  f"RSS {rss_now()['VmRSS'] / 2**30:.2f} GiB", flush=True)
    fill_s = time.perf_counter() - t0
    rss_filled = rss_now()
    if filled < total:  # train only over the ids that are there
        per_feature = max(1, filled // opts.features)
    batches = [batch() for _ in range(min(opts.batches, opts.scale_steps))]
    for ids, y in batches[:2]:  # warm-up
        model.train_on_batch(ids, y)
    before = layer.stats()
    step_s = time_steps(model, batches, opts.scale_steps)
    after = layer.stats()
    hits = after["cache_hits"] - before["cache_hits"]
    misses = after["cache_misses"] - before["cache_misses"]
    bound = 4 * opts.dim * (1 + len(slot_names))
    rows = max(1, int(after["rows"]))
    rss_end = rss_now()
    return {
        "benchmark": "storage_scale", "config": vars(opts), "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["benchmarks/storage.py", *sys.argv[1:]]),
        "target_keys": total, "keys_filled": filled, "complete": filled >= total,
        "fill_s": fill_s, "fill_keys_per_s": filled / max(fill_s, 1e-9),
        "rows": int(after["rows"]), "cached_rows": int(after["cached_rows"]),
        "cache_bytes": opts.scale_cache_bytes,
        "steps_per_s": 1.0 / step_s,
        "cache_hit_rate": hits / max(1, hits + misses),
        "table_memory_bytes": int(after["memory_bytes"]),
        "table_memory_bytes_per_key": after["memory_bytes"] / rows,
        "disk_bytes": int(after["disk_bytes"]),
        "disk_bytes_per_key": after["disk_bytes"] / rows,
        "row_bound_bytes_per_key": bound,
        "disk_over_bound": after["disk_bytes"] / rows / bound,
        "rss_after_build_bytes": rss_built, "rss_after_fill": rss_filled, "rss_end": rss_end,
        "peak_rss_bytes": peak_rss(), "target_peak_rss_bytes": TARGET_SCALE_RSS,
    }


def print_scale(report):
    print(f"scale: {report['keys_filled']:,} of {report['target_keys']:,} ids filled in "
          f"{report['fill_s']:.0f} s ({report['fill_keys_per_s']:,.0f} ids/s); cache "
          f"{report['cache_bytes'] / 2**30:.2f} GiB")
    print(f"steps/s {report['steps_per_s']:.2f}; cache hit rate {report['cache_hit_rate']:.3f}; "
          f"table DRAM {report['table_memory_bytes_per_key']:.1f} B/key")
    print(f"peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB (target <= "
          f"{report['target_peak_rss_bytes'] / 2**30:.0f} GiB); end RSS anon "
          f"{report['rss_end'].get('RssAnon', 0) / 2**30:.2f} GiB, file "
          f"{report['rss_end'].get('RssFile', 0) / 2**30:.2f} GiB")
    print(f"disk {report['disk_bytes_per_key']:.1f} B/key vs 4*dim*(1+slots) = "
          f"{report['row_bound_bytes_per_key']} -> {report['disk_over_bound']:.2f}x")


def main(argv=None):
    p = parser(__doc__, **WORKLOAD, dim=16, steps=10, reps=3, cache_fraction=0.1)
    p.add_argument("--storage-dir", default=None, help="folder for the file tier "
                   "(default: a temporary folder, removed afterwards)")
    p.add_argument("--json", default=None,
                   help="report path (default benchmarks/storage.json, with --scale "
                   "benchmarks/storage_scale.json)")
    p.add_argument("--scale", action="store_true", help="the scale run (see above)")
    p.add_argument("--scale-keys", type=int, default=100_000_000)
    p.add_argument("--scale-cache-bytes", type=int, default=2 * 2**30)
    p.add_argument("--scale-chunk", type=int, default=1_000_000)
    p.add_argument("--scale-fill-seconds", type=float, default=3 * 3600)
    p.add_argument("--scale-steps", type=int, default=20)
    p.add_argument("--floor-threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the file floor's probe (default: every core)")
    p.add_argument("--floor-repeats", type=int, default=5)
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="leave the file floor out")
    p.add_argument("--verbose", action="store_true")
    opts = p.parse_args(argv)
    if opts.scale:
        opts.json = opts.json or DEFAULT_SCALE_JSON
        folder = opts.storage_dir or tempfile.mkdtemp(prefix="kre-storage-scale-")
        try:
            report = scale_run(opts, folder)
        finally:
            if opts.storage_dir is None:
                shutil.rmtree(folder, ignore_errors=True)
        print_scale(report)
        write_json_report(opts.json, report)
        return
    opts.json = opts.json or DEFAULT_JSON
    batches = make_batches(opts)
    rows = len(np.unique(np.concatenate([b[0].ravel() for b in batches])))
    row_bytes = 4 * opts.dim * 2  # value + Adagrad accumulator
    cache_bytes = max(1, int(opts.cache_fraction * rows * row_bytes))
    folder = opts.storage_dir or tempfile.mkdtemp(prefix="kre-storage-bench-")
    try:
        models = {
            "dram": build(opts, None),
            "file": build(opts, kre.StorageOption("FILE", storage_path=folder,
                                                  storage_size=cache_bytes)),
        }
        for model in models.values():  # warm-up: every id inserted, functions traced
            for ids, y in batches:
                model.train_on_batch(ids, y)
        layer = models["file"].get_layer("table")
        before = layer.stats()
        per_step = {name: [] for name in models}
        cpu_per_step = {name: [] for name in models}
        for _ in range(opts.reps):
            for name, model in models.items():
                per_step[name].append(time_steps(model, batches, opts.steps,
                                                 cpu_per_step[name]))
        after = layer.stats()
        hits = after["cache_hits"] - before["cache_hits"]
        misses = after["cache_misses"] - before["cache_misses"]
        t0 = time.perf_counter()
        layer.snapshot()
        snapshot_s = time.perf_counter() - t0
        stats = layer.stats()
        timed_steps = opts.reps * opts.steps
        distinct, static_misses = lookup_misses_static(batches, opts.steps,
                                                       int(stats["cached_rows"]))
        file_reads = misses / timed_steps
        floor = None
        if opts.floor and stats["rows"] >= 1024:  # file_probe's smallest file
            dram_step = statistics.median(per_step["dram"])
            rates = file_floor(folder, int(stats["rows"]), 4 * 2 * opts.dim + 4,
                               file_reads, opts.floor_threads, opts.floor_repeats)
            floor = {"threads": opts.floor_threads, "rates": rates,
                     "measured_misses": floor_report(dram_step, file_reads, rates),
                     "static_bound_misses": floor_report(dram_step, static_misses, rates)}
        steps_per_s = {n: 1.0 / statistics.median(v) for n, v in per_step.items()}
        ratio = steps_per_s["file"] / steps_per_s["dram"]
        # Per round (the models take turns): DRAM's CPU per step / FILE's.
        cpu_ratios = [d / f for d, f in zip(cpu_per_step["dram"], cpu_per_step["file"])]
        cpu_ratio = statistics.median(cpu_ratios)
        bound = 4 * opts.dim * (1 + 1)
        report = {
            "benchmark": "storage", "config": vars(opts), "machine": machine_info(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "command": shlex.join(["benchmarks/storage.py", *(sys.argv[1:] if argv is None
                                                              else argv)]),
            "rows": int(stats["rows"]), "cache_bytes": cache_bytes,
            "cached_rows": int(stats["cached_rows"]),
            "steps_per_s": steps_per_s, "file_over_dram": ratio,
            "cpu_s_per_step": {n: statistics.median(v) for n, v in cpu_per_step.items()},
            "file_over_dram_cpu": cpu_ratio, "file_over_dram_cpu_rounds": cpu_ratios,
            "load_average": os.getloadavg(),
            "target_file_over_dram": TARGET_FILE_VS_DRAM,
            "cache_hit_rate": hits / max(1, hits + misses),
            "distinct_ids_per_step": distinct,
            "file_reads_per_step": file_reads,
            "file_reads_per_distinct_id": file_reads / max(1.0, distinct),
            "static_bound_misses_per_distinct_id": static_misses / max(1.0, distinct),
            "floor": floor,
            "disk_bytes": int(stats["disk_bytes"]),
            "disk_bytes_per_key": stats["disk_bytes"] / max(1, stats["rows"]),
            "row_bound_bytes_per_key": bound,
            "disk_over_bound": stats["disk_bytes"] / max(1, stats["rows"]) / bound,
            "snapshot_s": snapshot_s,
            "peak_rss_bytes": peak_rss(),
        }
    finally:
        if opts.storage_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{report['rows']:,} rows, dim {opts.dim} + Adagrad slot; cache {cache_bytes:,} "
          f"bytes ({opts.cache_fraction:.0%} of the rows)")
    print(f"steps/s  DRAM {steps_per_s['dram']:.2f}  FILE {steps_per_s['file']:.2f}  "
          f"-> FILE/DRAM {ratio:.2f}x (target >= {TARGET_FILE_VS_DRAM}x)")
    print(f"CPU ms/step  DRAM {report['cpu_s_per_step']['dram'] * 1e3:.1f}  FILE "
          f"{report['cpu_s_per_step']['file'] * 1e3:.1f}  -> FILE/DRAM {cpu_ratio:.2f}x "
          f"(rounds {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}); load average "
          f"{' '.join(f'{x:.1f}' for x in report['load_average'])}")
    print(f"rows read from file a step: {report['file_reads_per_distinct_id']:.3f} of the "
          f"{distinct:,.0f} distinct ids (static bound: "
          f"{report['static_bound_misses_per_distinct_id']:.3f} miss)")
    if floor:
        for name, label in (("measured_misses", "misses measured"),
                            ("static_bound_misses", "static bound's misses")):
            f = floor[name]
            print(f"file floor, {label} ({f['misses_per_step']:,.0f} a step, "
                  f"{floor['threads']} threads): FILE/DRAM <= {f['pread']['file_over_dram']:.2f}x "
                  f"by pread (+{f['pread']['extra_ms']:.1f} ms a step), "
                  f"<= {f['map']['file_over_dram']:.2f}x from a memory map "
                  f"(+{f['map']['extra_ms']:.1f} ms)")
    print(f"cache hit rate {report['cache_hit_rate']:.3f}; disk {report['disk_bytes_per_key']:.1f} "
          f"B/key vs 4*dim*(1+slots) = {bound} -> {report['disk_over_bound']:.2f}x; "
          f"snapshot {snapshot_s:.2f} s; peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB")
    write_json_report(opts.json, report)


if __name__ == "__main__":
    main()
