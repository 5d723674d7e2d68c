"""Side-by-side peer benchmark (issue 19): ours vs TorchRec, TFRA and stock Keras.

One matched DLRM-style workload (`workload.py`): 26 categorical features,
one table each, dim 16, batch 4096, ids Zipf(1.1) over 10^6 values per
feature, the same id arrays (generated once, saved as .npy) for every
framework; sum pooling, concat -> Dense(1) -> sigmoid, BCE, Adagrad lr 0.05.

Frameworks (each a worker process in its own virtualenv):

* `ours_group`, `ours_separate`, `keras` (`worker_keras.py`, `.venv`): ours
  with one GroupEmbedding or 26 EmbeddingVariable layers; stock Keras
  `Hashing(10^6)` + `Embedding`.
* `ours_jax_group`, `ours_jax` (`worker_jax.py`, `.venv`,
  `KERAS_BACKEND=jax`): ours under Keras's JAX backend, one GroupEmbedding
  or 26 EmbeddingVariable layers (the tables through XLA's FFI, no
  TensorFlow in the process). Each result of a JAX form has
  `vs_tensorflow`: its paired per-round ratios to the same form on
  TensorFlow (`JAX_PEERS`), steps/s JAX / TF and forward ms TF / JAX
  (above 1: JAX faster); `benchmarks/jax_speed.py` runs just these.
* `torchrec_tbe`, `torchrec_dmp` (`worker_torchrec.py`, `.venv-torchrec`):
  fbgemm's fused table-batched embedding (static 10^6-row tables,
  EXACT_ADAGRAD in the backward), directly and through TorchRec's
  DistributedModelParallel with one rank.
* `tfra` (`worker_tfra.py`, `.venv-tfra`, `TF_USE_LEGACY_KERAS=1`): TFRA
  0.8.1 `dynamic_embedding` Keras layers on TF 2.16.2.

Method: for each (variant, threads) every framework's worker is started,
loads the ids and warms up (one training pass over every batch, so every
key is in the dynamic tables and nothing is traced while timed). Then
rounds are interleaved: each round sends every worker "run a round" in
turn (order reversed every other round: A B C, C B A, ...), only one worker
running at a time; a round is --steps training steps (timed after one
untimed step) and --lookups forward lookups of one batch (the embedding
part alone, inference). Reported per framework: median, min and max over
the rounds of steps/s and forward ms, and bytes per key: the framework's
own table size (ours: the tables' `memory_bytes`, with Adagrad state;
static tables: rows x dim x 4 x 2 for the rows and accumulators) and RSS
growth from before the model was built to after warm-up, both over the
distinct keys in the ids (`workload` meta).

Threads, so that no framework is starved or oversubscribed: only one
worker runs at a time, and each gets T threads (--threads, 1 and 2):
`OMP_NUM_THREADS`/`MKL_NUM_THREADS`=T for all; TensorFlow intra-op pool T,
inter-op pool 1 (ops run in sequence, each one using up to T threads);
torch `set_num_threads(T)`, `set_num_interop_threads(1)`; and
`OMP_WAIT_POLICY=PASSIVE` (--omp-wait-policy): torch's OpenMP (libgomp)
otherwise spins ~300k iterations at every barrier before sleeping, and on
a machine whose cores are shared with other jobs the spinning thread eats
the time slice its preempted partner needs: TorchRec at 2 threads then
burns 100-770 CPU-ms a step instead of 35-70 and runs 2-20x slower (0.6-4
steps/s against 7-19 with PASSIVE, measured side by side at load 8).
TensorFlow's Eigen pools do not read it. With --pin, each worker is also
bound to cores 0..T-1 (`sched_setaffinity`).

Huge pages: our tables keep their indexes and rows on transparent huge
pages by default (`KRE_HUGE_PAGES`, README). torch's CPU allocator does so
for its blocks of 2 MiB and more (TorchRec's tables) only when
`THP_MEM_ALLOC_ENABLE=1` is set, which --torch-huge-pages sets in the
TorchRec workers; the default run leaves torch at its default (off).

Run from the repository root (`make bench-peers` makes the venvs first):

    .venv/bin/python benchmarks/peers/run.py            # 7 rounds, 1 and 2 threads
    .venv/bin/python benchmarks/peers/run.py --quick    # tiny sizes, 2 rounds
    .venv/bin/python benchmarks/peers/run.py --frameworks ours_group,keras

Writes bench-report/peers.json, peers.md (table) and peers.png (plot);
`benchmarks/report.py` adds them to report.md when present.
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

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import workload  # noqa: E402

REFERENCE = "ours_group"
FRAMEWORKS = {
    # name: (label, worker script, venv python (None: this one), --impl, extra env)
    "ours_group": ("ours, GroupEmbedding", "worker_keras.py", None, "group", {}),
    "ours_separate": ("ours, 26 separate EmbeddingVariable", "worker_keras.py", None,
                      "separate", {}),
    "ours_jax_group": ("ours on Keras's JAX backend, GroupEmbedding", "worker_jax.py", None,
                       "group", {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}),
    "ours_jax": ("ours on Keras's JAX backend, 26 separate EmbeddingVariable", "worker_jax.py",
                 None, "separate", {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}),
    "torchrec_tbe": ("TorchRec/fbgemm fused TBE (static tables)", "worker_torchrec.py",
                     ".venv-torchrec", "tbe", {}),
    "torchrec_dmp": ("TorchRec DistributedModelParallel, 1 rank", "worker_torchrec.py",
                     ".venv-torchrec", "dmp", {}),
    "tfra": ("TFRA 0.8.1 dynamic_embedding", "worker_tfra.py", ".venv-tfra", "tfra",
             {"TF_USE_LEGACY_KERAS": "1"}),
    "keras": ("stock Keras Hashing + Embedding", "worker_keras.py", None, "keras", {}),
}
# A JAX form of ours -> the same form on TensorFlow (issue 42's speed item).
JAX_PEERS = {"ours_jax_group": "ours_group", "ours_jax": "ours_separate"}
QUICK = {"rounds": 2, "steps": 5, "lookups": 5}
# Rounds of 20 steps and 20 lookups: with 10 and 5 (0.1-0.2 s of our work a
# round at 1-5 ids) the per-round spread of a framework was up to 15% on
# this 2-core machine, as large as the differences the rounds are to show.
# 100 lookups (~0.8 s of ours at 1-5 ids): with 20, five 5-round runs of
# ours against TorchRec's TBE on a noisier day gave forward medians from
# 0.89x to 1.33x; with 100 and 7 rounds three runs gave 1.07-1.23x.
FULL = {"rounds": 7, "steps": 20, "lookups": 100}
# Frameworks too slow for --steps steps a round (stock Keras trains its dense
# 26 x 10^6-row tables at ~0.2 steps/s): they run steps // N (at least 2).
SLOW = {"keras": 5}
DEFAULT_OUT = ROOT / "bench-report"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (workload.QUICK), 2 rounds of 5 steps")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   help="comma-separated subset of " + ",".join(FRAMEWORKS))
    p.add_argument("--variants", default="single,multi")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="training steps per round")
    p.add_argument("--lookups", type=int, default=None, help="forward lookups per round")
    p.add_argument("--batches", type=int, default=None,
                   help="distinct batches in the ids (default: workload's)")
    p.add_argument("--pin", action="store_true", help="bind each worker to cores 0..T-1")
    p.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE", "unset"),
                   help="OMP_WAIT_POLICY of the workers (default PASSIVE: idle OpenMP "
                        "threads sleep instead of spinning; `unset` keeps libgomp's "
                        "spin-then-sleep default)")
    p.add_argument("--torch-huge-pages", action="store_true",
                   help="THP_MEM_ALLOC_ENABLE=1 for the TorchRec workers: torch's tables on "
                        "transparent huge pages, as ours are by default")
    p.add_argument("--data-dir", default=None,
                   help="where the ids are generated (default: OUT/peers-data[-quick])")
    p.add_argument("--output-dir", default=str(DEFAULT_OUT))
    p.add_argument("--store", action="store_true",
                   help="also write the result to benchmarks/results/peers.json, the stored "
                        "result `keras-rec-emb bench` shows without the peer virtualenvs")
    p.add_argument("--skip-missing", action="store_true",
                   help="leave out frameworks whose virtualenv is missing (default: error)")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="a folder holding another build of keras_rec_emb (a copy of the "
                        "package with its compiled libraries): each of ours in --frameworks "
                        "runs again as NAME_before with DIR first on its PYTHONPATH, in the "
                        "same interleaved rounds (an A/B of two builds)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds a worker may take to answer one command")
    a = p.parse_args(argv)
    mode = QUICK if a.quick else FULL
    for k in ("rounds", "steps", "lookups"):
        if getattr(a, k) is None:
            setattr(a, k, mode[k])
        if getattr(a, k) <= 0:
            p.error(f"--{k} must be a positive integer, got {getattr(a, k)}")
    a.frameworks = [f for f in a.frameworks.split(",") if f]
    a.variants = [v for v in a.variants.split(",") if v]
    a.threads = [int(t) for t in a.threads.split(",") if t]
    bad = sorted(set(a.frameworks) - set(FRAMEWORKS))
    if bad:
        p.error(f"unknown --frameworks {bad}; choose from {list(FRAMEWORKS)}")
    bad = sorted(set(a.variants) - set(workload.VARIANTS))
    if bad:
        p.error(f"unknown --variants {bad}; choose from {list(workload.VARIANTS)}")
    if not a.threads or min(a.threads) <= 0:
        p.error(f"--threads must be positive integers, got {a.threads}")
    if a.before is not None:
        before = pathlib.Path(a.before).resolve()
        if not (before / "keras_rec_emb" / "__init__.py").is_file():
            p.error(f"--before must be a folder holding keras_rec_emb/, got {a.before!r}")
        for name in [n for n in a.frameworks if n.startswith("ours")]:
            label, script, venv, impl, env = FRAMEWORKS[name]
            FRAMEWORKS[name + "_before"] = (f"{label} (build in {before})", script, venv, impl,
                                            {**env, "PYTHONPATH": str(before)})
            a.frameworks.append(name + "_before")
    return a


def worker_env(name, omp_wait_policy="PASSIVE", torch_huge_pages=False):
    """The environment of framework `name`'s worker process (see the module
    docstring for the thread and huge-page settings)."""
    full_env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                **FRAMEWORKS[name][4], "PYTHONUNBUFFERED": "1"}
    full_env.pop("OMP_WAIT_POLICY", None)
    full_env.pop("THP_MEM_ALLOC_ENABLE", None)
    if omp_wait_policy != "unset":
        full_env["OMP_WAIT_POLICY"] = omp_wait_policy
    if torch_huge_pages and name.startswith("torchrec"):
        full_env["THP_MEM_ALLOC_ENABLE"] = "1"
    return full_env


class Worker:
    """One framework's long-lived worker process, driven over its pipes."""

    def __init__(self, name, data_dir, variant, threads, pin, timeout, log_dir,
                 omp_wait_policy="PASSIVE", torch_huge_pages=False):
        _, script, venv, impl, _ = FRAMEWORKS[name]  # the env: worker_env
        python = sys.executable if venv is None else str(ROOT / venv / "bin" / "python")
        self.name, self.timeout = name, timeout
        full_env = worker_env(name, omp_wait_policy, torch_huge_pages)
        self.log_path = log_dir / f"{name}-{variant}-{threads}t.log"
        self.stderr = open(self.log_path, "w")
        cmd = [python, str(HERE / script), "--data", str(data_dir), "--variant", variant,
               "--threads", str(threads), "--impl", impl]
        preexec = (lambda: os.sched_setaffinity(0, range(threads))) if pin else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=full_env,
                                     preexec_fn=preexec)

    def _read(self):
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            tail = "".join(self.log_path.read_text(errors="replace").splitlines(True)[-20:])
            raise RuntimeError(f"worker {self.name} gave no answer (exit status "
                               f"{self.proc.poll()}); its log {self.log_path} ends:\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            self.close()
            raise RuntimeError(f"worker {self.name} failed:\n{msg['error']}")
        return msg

    def ready(self):
        return self._read()

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / statistics.median(values)}


def run_config(names, data_dir, meta, variant, threads, opts, log_dir):
    """Warm-up and interleaved rounds of every framework for one (variant,
    threads); returns {name: result}."""
    workers = {}
    try:
        for name in names:  # started together: warm-ups overlap, nothing is timed yet
            workers[name] = Worker(name, data_dir, variant, threads, opts.pin, opts.timeout,
                                   log_dir, opts.omp_wait_policy, opts.torch_huge_pages)
        ready = {}
        for name, w in workers.items():
            ready[name] = w.ready()
            log(f"  {name}: ready after {ready[name]['warmup_s']:.0f} s")
        rounds = {name: [] for name in names}
        for r in range(opts.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                steps = max(2, opts.steps // SLOW.get(name, 1))
                reply = workers[name].ask(op="round", steps=steps, lookups=opts.lookups)
                # The machine's 1-minute load average as the round ends: the
                # other jobs that shared the cores with it.
                reply.update(steps=steps, load_avg=os.getloadavg()[0])
                rounds[name].append(reply)
            log(f"  round {r + 1}/{opts.rounds} (load {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{n} {rounds[n][-1]['steps_per_s']:.1f}/s "
                f"({rounds[n][-1]['cpu_ms_per_step']:.0f} cpu-ms) "
                f"{rounds[n][-1]['lookup_ms']:.1f}ms" for n in names))
        stats = {name: w.ask(op="stats") for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    keys = meta["distinct_keys_total"]
    out = {}
    for name in names:
        rs, st, rd = rounds[name], stats[name], ready[name]
        growth = rd["rss_ready_bytes"] - rd["rss_model_bytes"]
        out[name] = {
            "label": FRAMEWORKS[name][0],
            "steps_per_s": _summary([x["steps_per_s"] for x in rs]),
            "cpu_ms_per_step": _summary([x["cpu_ms_per_step"] for x in rs]),
            "load_avg": _summary([x["load_avg"] for x in rs]),
            "loss_initial": rd["loss_initial"],
            "loss_after_warmup": rd["loss_after_warmup"],
            "lookup_ms": _summary([x["lookup_ms"] for x in rs]),
            "loss": [x["loss"] for x in rs],
            "table_rows": st["table_rows"],
            "table_bytes": st["table_bytes"],
            "bytes_per_key_table": None if st["table_bytes"] is None else
            st["table_bytes"] / keys,
            "rss_growth_bytes": growth,
            "bytes_per_key_rss": growth / keys,
            "warmup_s": rd["warmup_s"],
            "versions": rd.get("framework_versions", {}),
            "rounds": rs,
        }
    from report import paired_ratios

    for jax_name, tf_name in JAX_PEERS.items():
        if jax_name in out and tf_name in out:
            out[jax_name]["vs_tensorflow"] = {
                "peer": tf_name,
                **{k: paired_ratios(out[jax_name], out[tf_name], k)
                   for k in ("steps_per_s", "lookup_ms")}}
    ref = out.get(REFERENCE)
    if ref:
        for r in out.values():
            r["train_vs_ours"] = r["steps_per_s"]["median"] / ref["steps_per_s"]["median"]
            r["lookup_vs_ours"] = ref["lookup_ms"]["median"] / r["lookup_ms"]["median"]
    return out


def main(argv=None):
    opts = parse_args(argv)
    out_dir = pathlib.Path(opts.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    names, skipped = [], {}
    for name in opts.frameworks:
        venv = FRAMEWORKS[name][2]
        if venv and not (ROOT / venv / "bin" / "python").exists():
            why = f"{venv} does not exist (make bench-peers creates it)"
            if not opts.skip_missing:
                raise SystemExit(f"run.py: error: framework {name}: {why}")
            skipped[name] = why
            continue
        names.append(name)
    config = dict(workload.QUICK if opts.quick else workload.FULL)
    if opts.batches:
        config["batches"] = opts.batches
    data_dir = pathlib.Path(opts.data_dir or out_dir / ("peers-data" + "-quick" * opts.quick))
    t0 = time.perf_counter()
    metas = workload.generate(str(data_dir), config)
    log(f"ids in {data_dir} ({time.perf_counter() - t0:.0f} s)")
    from _machine import machine_info
    import report as bench_report

    report = {"benchmark": "peers", "date": datetime.date.today().isoformat(),
              "command": " ".join(["python benchmarks/peers/run.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "quick": opts.quick, "workload": config, "data": metas,
              "method": {k: getattr(opts, k) for k in ("rounds", "steps", "lookups", "pin",
                                                       "omp_wait_policy",
                                                       "torch_huge_pages")},
              "load_avg_start": os.getloadavg(),
              "reference": REFERENCE, "skipped": skipped, "machine": machine_info(),
              "results": {}}
    json_path = out_dir / "peers.json"
    for variant in opts.variants:
        for threads in opts.threads:
            key = f"{variant}-{threads}t"
            log(f"{key}: {', '.join(names)}")
            report["results"][key] = {
                "variant": variant, "threads": threads,
                "frameworks": run_config(names, data_dir, metas[variant], variant, threads,
                                         opts, log_dir)}
            # Written after every configuration: a cut-off run keeps what it measured.
            json_path.write_text(json.dumps(report, indent=1))
            md = bench_report.peers_markdown(report)
            (out_dir / "peers.md").write_text("\n".join(md) + "\n")
    if opts.store:
        stored = HERE.parent / bench_report.STORED_PEERS_JSON
        stored.write_text(json.dumps(report, indent=1) + "\n")
        log(f"stored as {stored}")
    try:
        bench_report.peers_plot(report, out_dir / bench_report.PEERS_PLOT)
    except bench_report.BenchError as e:
        log(f"no plot: {e}")
    print("\n".join(md))
    log(f"wrote {json_path}, peers.md, {bench_report.PEERS_PLOT} in {out_dir}")
    return report


if __name__ == "__main__":
    main()
