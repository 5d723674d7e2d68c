"""Synchronous sharded tables: CPU of every process and bytes sent per step.

By default: a model of --features EmbeddingVariable tables (dim --dim,
--ids ids per feature and example) + Dense(--hidden) trained with
`model.fit` (Adagrad) on global batches of --batch rows, first in one plain
process (no strategy), then under `tf.distribute.MultiWorkerMirroredStrategy`
with N worker processes on 127.0.0.1 (--workers; TF_CONFIG, free ports,
stopped by pid), one replica and --threads intra/inter-op threads each,
every worker passing the whole data (Keras splits each global batch).
Reported per training step, over --steps timed steps after --warmup in the
same `fit` call (`fit`'s own set-up, once per epoch, is not counted):

* CPU seconds of every process together (each reads its own
  `getrusage(RUSAGE_SELF)`, every thread included; also by thread name from
  /proc, to show where it goes), and that against the
  plain process;
* bytes sent: what each process's TCP sockets sent (the kernel's
  `bytes_sent` of `ss -tinp`, gRPC's channels between the workers), summed;
* the all-to-all ideal: for each replica's part of the batch and each
  table, its distinct ids owned by another worker x (8 bytes of id + 4 dim
  of row back + 4 dim of gradient row), computed from the data.

`--replicas 1,2,4` also runs MirroredStrategy over that many logical CPU
devices in one process (steps/s only). The machine has 2 cores: N processes
share them, so steps/s do not scale here; CPU seconds and bytes do not
depend on that.

`--ps P` measures asynchronous parameter-server training instead: the same
model built inside `keras_rec_emb.distribute.parameter_servers` (tables
sharded by key hash and dense weights on the P PS tasks,
`python -m keras_rec_emb.distribute.ps`), N workers (--workers) that
connect at once, each training --steps steps of its own --batch rows after
--warmup, started together at a barrier. Reported: examples/s of all
workers together; CPU seconds of every process (workers and PS tasks, from
/proc/PID/stat) per example against the plain process; bytes every
socket sent per worker step against the ideal exchange (each table's
distinct ids of the batch to the PS (8 bytes), their rows back and their
gradient rows (4 dim each), the dense weights read and their gradients
sent).

    .venv/bin/python benchmarks/distributed.py                # plain, 1, 2, 4 workers
    .venv/bin/python benchmarks/distributed.py --quick --workers 1,2
    .venv/bin/python benchmarks/distributed.py --ps 2 --workers 1,2,4

Writes --json (default benchmarks/distributed.json; the stored runs are
benchmarks/results/distributed.json and, for --ps, distributed_ps.json).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import child_result, child_results, free_addresses, parser, stop  # noqa: E402


def make_data(args, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = args.batch * (args.steps + args.warmup)
    ids = rng.zipf(1.2, size=(rows, args.features, args.ids)).astype(np.int64) % 1_000_000
    y = rng.uniform(size=(rows, 1)).astype(np.float32)
    return ids, y


def build_model(args):
    import keras

    import keras_rec_emb as kre

    inputs = {f"f{i}": keras.Input((args.ids,), dtype="int64", name=f"f{i}")
              for i in range(args.features)}
    if getattr(args, "no_tables", False):  # the floor: the same fit, no table at all
        joined = keras.layers.Concatenate()(
            [keras.ops.cast(inputs[f"f{i}"], "float32") for i in range(args.features)])
    elif getattr(args, "group", False):  # one GroupEmbedding: one exchange for every table
        tables = [kre.layers.EmbeddingVariable(args.dim, name=f"emb{i}")
                  for i in range(args.features)]
        joined = kre.layers.GroupEmbedding(
            {f"f{i}": kre.layers.FeatureSpec(t, combiner="sum") for i, t in enumerate(tables)},
            output_mode="concat")(inputs)
    else:
        embs = [kre.layers.EmbeddingVariable(args.dim, combiner="sum", name=f"emb{i}")(
            inputs[f"f{i}"]) for i in range(args.features)]
        joined = keras.layers.Concatenate()(embs)
    h = keras.layers.Dense(args.hidden, activation="relu")(joined)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    metrics = [m for m in getattr(args, "metrics", "").split(",") if m]
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="mse",
                  metrics=[keras.metrics.AUC(name="auc") if m == "auc" else m for m in metrics])
    return model


def _cpu_seconds():
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _thread_cpu_seconds():
    """CPU seconds of this process's threads by thread name (digits
    dropped: one entry per pool), from /proc/self/task/*/stat."""
    import re

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        key = re.sub(r"\d+", "#", name)
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _socket_bytes_sent(pid):
    """Bytes this process's TCP sockets have sent (the kernel's own counter,
    `ss -tinp`'s bytes_sent): gRPC's channels between the workers."""
    import re

    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():
            mine = f"pid={pid}," in line
        elif mine:
            m = re.search(r"bytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def _loopback_bytes():
    """Bytes the loopback interface has carried (machine-wide: a cross-check
    of the per-socket counts on a quiet machine)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # transmitted bytes
    return 0


def multi_worker_child(args):
    """One MultiWorkerMirroredStrategy worker (TF_CONFIG set by main), or
    the plain one-process reference (no TF_CONFIG, no strategy)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    from keras_rec_emb.distribute import ps_tables

    plain = "TF_CONFIG" not in os.environ
    if plain:
        n, task = 1, 0
        model = build_model(args)
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        n, task = strategy.num_replicas_in_sync, strategy.cluster_resolver.task_id
        with strategy.scope():
            model = build_model(args)
    ids, y = make_data(args)
    x = {f"f{i}": ids[:, i] for i in range(args.features)}

    pid = os.getpid()
    keras = sys.modules["keras"]

    class Meter(keras.callbacks.Callback):
        """Counters after the warm-up steps and at the end of the same `fit`
        call: the timed steps alone, without `fit`'s set-up (distributing
        the dataset, building the step function), a cost per epoch, not per
        step."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == args.warmup - 1:
                self.start = (_loopback_bytes(), _thread_cpu_seconds(), _cpu_seconds(),
                              _socket_bytes_sent(pid), time.perf_counter())

        def on_train_end(self, logs=None):
            self.end = (_loopback_bytes(), _thread_cpu_seconds(), _cpu_seconds(),
                        _socket_bytes_sent(pid), time.perf_counter())

    meter = Meter()
    # Every worker passes the whole data: Keras splits each global batch of
    # args.batch rows over the replicas.
    rows = slice(0, (args.warmup + args.steps) * args.batch)
    model.fit({k: v[rows] for k, v in x.items()}, y[rows], batch_size=args.batch,
              shuffle=False, verbose=0, callbacks=[meter])
    (lo, threads, cpu, sent, start), (lo2, after, cpu2, sent2, end) = meter.start, meter.end
    wall, cpu, sent, lo = end - start, cpu2 - cpu, sent2 - sent, lo2 - lo
    threads = {k: round(v - threads.get(k, 0.0), 3) for k, v in after.items()
               if v - threads.get(k, 0.0) > 0.005}
    # The all-to-all ideal for this replica's part of each global batch: its
    # distinct ids of each table that another worker owns go there (8
    # bytes), their rows come back (4 dim) and their gradient rows go to the
    # owner again (4 dim).
    local = args.batch // n
    ideal = 0
    for step in range(args.warmup, args.warmup + args.steps):
        part = ids[step * args.batch + task * local:step * args.batch + (task + 1) * local]
        for f in range(args.features):
            distinct = np.unique(part[:, f])
            remote = int((ps_tables.shard_of_numpy(distinct, n) != task).sum())
            ideal += remote * (8 + 8 * args.dim)
    print("RESULT " + json.dumps({"task": task, "cpu_s": cpu, "bytes_sent": sent,
                                  "loopback_bytes": lo, "wall_s": wall,
                                  "ideal_bytes": ideal, "threads": threads}), flush=True)


# The model's and the run's sizes: what a child is given of the options.
_SIZES = ("features", "ids", "dim", "batch", "steps", "warmup", "hidden")


def _child_command(args, flag):
    """This script run as a child (`flag`) with the parent's sizes, threads
    and model options."""
    return [sys.executable, os.path.abspath(__file__), flag] + [
        f"--{k}={getattr(args, k)}" for k in (*_SIZES, "threads")] + (
        ["--group"] if args.group else []) + (["--no-tables"] if args.no_tables else [])


def run_cluster(args, n):
    """n MultiWorkerMirroredStrategy workers on 127.0.0.1 (n = 0: the plain
    one-process reference); their summed CPU seconds and bytes per step."""
    addresses = free_addresses(max(n, 1))
    cmd = _child_command(args, "--mw-child") + (
        [f"--metrics={args.metrics}"] if args.metrics else [])
    procs = []
    try:
        for task in range(max(n, 1)):
            env = dict(os.environ)
            env.pop("TF_CONFIG", None)
            if n:
                env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses},
                                               "task": {"type": "worker", "index": task}})
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        stop(procs)
    results = child_results(procs, outs)
    if results is None:
        return None
    steps = args.steps
    return {"workers": n, "cpu_s_per_step": sum(r["cpu_s"] for r in results) / steps,
            "bytes_per_step": sum(r["bytes_sent"] for r in results) / steps,
            "ideal_bytes_per_step": sum(r["ideal_bytes"] for r in results) / steps,
            "steps_per_s": steps / max(r["wall_s"] for r in results),
            "per_worker": results}


def child(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    n = args.child
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * n)

    from keras_rec_emb.distribute import ps_tables

    ids, y = make_data(args)
    x = {f"f{i}": ids[:, i] for i in range(args.features)}

    def build():
        return build_model(args)

    def timed(model):
        warm = args.batch * args.warmup
        model.fit({k: v[:warm] for k, v in x.items()}, y[:warm], batch_size=args.batch,
                  verbose=0, shuffle=False)
        start = time.perf_counter()
        model.fit({k: v[warm:] for k, v in x.items()}, y[warm:], batch_size=args.batch,
                  verbose=0, shuffle=False)
        return args.steps / (time.perf_counter() - start)

    result = {"replicas": n}
    if n == 1:
        result["plain_steps_per_s"] = timed(build())
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    with strategy.scope():
        model = build()
    result["steps_per_s"] = timed(model)
    lookups = args.batch * args.features * args.ids
    result["rows_per_s"] = result["steps_per_s"] * lookups
    # Bytes crossing devices per step, averaged over the timed steps.
    local = args.batch // n
    ideal = ours = 0.0
    for step in range(args.warmup, args.warmup + args.steps):
        batch = ids[step * args.batch:(step + 1) * args.batch]
        for r in range(n):
            mine = batch[r * local:(r + 1) * local].transpose(1, 0, 2).reshape(
                args.features, -1)
            for f in range(args.features):
                owner = ps_tables.shard_of_numpy(mine[f], n)
                remote = int((owner != r).sum())
                sent = 8 + 4 * args.dim
                ideal += remote * sent + remote * (4 * args.dim + 8)
                ours += remote * sent + mine[f].size * (n - 1) * (4 * args.dim + 8)
    result["ideal_bytes_per_step"] = ideal / args.steps
    result["bytes_per_step"] = ours / args.steps
    print("RESULT " + json.dumps(result), flush=True)


# -- Parameter servers (--ps N) ----------------------------------------------------


def _proc_cpu_seconds(pid):
    """CPU seconds of process `pid`, every thread (utime + stime of
    /proc/PID/stat): the PS tasks are measured from outside."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _touch(folder, name):
    with open(os.path.join(folder, name), "w"):
        pass


def _wait_file(folder, name, timeout=1800, procs=(), poll=0.005):
    path = os.path.join(folder, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return False
        time.sleep(poll)
    return True


def ps_worker_child(args):
    """One asynchronous parameter-server worker (`--ps-child`): connects,
    builds the model inside `parameter_servers` (tables and dense weights
    on the PS tasks), trains --warmup steps, waits for every worker at the
    barrier, then trains --steps steps of its own --batch rows."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import keras

    import keras_rec_emb as kre
    from keras_rec_emb.backend.tensorflow.variables import is_table

    task, sync = args.ps_task, args.ps_sync
    devices = kre.distribute.connect(args.ps_cluster.split(","), args.ps_worker, task,
                                     timeout=1800)
    with kre.distribute.parameter_servers(devices):
        model = build_model(args)
    ids, y = make_data(args, seed=1 + task)  # each worker its own data
    x = {f"f{i}": ids[:, i] for i in range(args.features)}

    class Barrier(keras.callbacks.Callback):
        """Every worker's timed steps start together, after its warm-up,
        inside one `fit` call (its set-up is not timed)."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == args.warmup - 1:
                _touch(sync, f"ready.{task}")
                _wait_file(sync, "go")
                self.start = (_cpu_seconds(), time.perf_counter())

        def on_train_end(self, logs=None):
            self.end = (_cpu_seconds(), time.perf_counter())
            _touch(sync, f"done.{task}")

    barrier = Barrier()
    rows = slice(0, (args.warmup + args.steps) * args.batch)
    model.fit({k: v[rows] for k, v in x.items()}, y[rows], batch_size=args.batch,
              shuffle=False, verbose=0, callbacks=[barrier])
    # The ideal exchange of a step: each table's distinct ids of the batch to
    # their PS task (8 bytes), their rows back and their gradient rows to
    # the task (4 dim each); the dense weights read and their gradients
    # sent (4 bytes a float each way).
    dense = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables
                if not is_table(v))
    ideal = 0
    for step in range(args.warmup, args.warmup + args.steps):
        part = ids[step * args.batch:(step + 1) * args.batch]
        for f in range(args.features):
            ideal += np.unique(part[:, f]).size * (8 + 8 * args.dim)
        ideal += 2 * dense
    (cpu, start), (cpu2, end) = barrier.start, barrier.end
    print("RESULT " + json.dumps({"task": task, "cpu_s": cpu2 - cpu, "wall_s": end - start,
                                  "ideal_bytes": ideal, "dense_bytes": dense}), flush=True)
    _wait_file(sync, "exit", poll=0.2)  # (polls rarely: the others' timed steps run)


def run_ps_cluster(args, n):
    """--ps PS tasks (`python -m keras_rec_emb.distribute.ps`) and n workers
    on 127.0.0.1, connecting at once; CPU seconds of every process (read
    from /proc) and bytes their sockets sent (ss) over the timed steps."""
    import tempfile

    addresses = free_addresses(args.ps + n)
    ps, workers = addresses[:args.ps], addresses[args.ps:]
    sync = tempfile.mkdtemp(prefix="kre_bench_ps_")
    cmd = _child_command(args, "--ps-child")
    servers, procs = [], []
    try:
        for task in range(args.ps):
            servers.append(subprocess.Popen(
                [sys.executable, "-m", "keras_rec_emb.distribute.ps", "--ps", ",".join(ps),
                 "--task", str(task)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True))
        for task in range(n):
            procs.append(subprocess.Popen(
                cmd + [f"--ps-cluster={','.join(ps)}", f"--ps-worker={workers[task]}",
                       f"--ps-task={task}", f"--ps-sync={sync}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        everyone = servers + procs
        if not all(_wait_file(sync, f"ready.{t}", procs=everyone) for t in range(n)):
            raise RuntimeError("a process ended before the barrier")
        pids = [p.pid for p in everyone]
        lo = _loopback_bytes()
        before = [(_proc_cpu_seconds(pid), _socket_bytes_sent(pid)) for pid in pids]
        start = time.perf_counter()
        _touch(sync, "go")
        if not all(_wait_file(sync, f"done.{t}", procs=everyone) for t in range(n)):
            raise RuntimeError("a process ended before its timed steps")
        wall = time.perf_counter() - start
        after = [(_proc_cpu_seconds(pid), _socket_bytes_sent(pid)) for pid in pids]
        lo = _loopback_bytes() - lo
        _touch(sync, "exit")
        outs = [p.communicate(timeout=600) for p in procs]
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        for p in servers + procs:
            if p.poll() is not None and p.stderr:
                sys.stderr.write(p.stderr.read()[-3000:])
        sys.stderr.write(f"{e}\n")
        return None
    finally:
        stop(servers + procs)
    results = child_results(procs, outs)
    if results is None:
        return None
    cpu = [b[0] - a[0] for a, b in zip(before, after)]
    sent = [b[1] - a[1] for a, b in zip(before, after)]
    steps = n * args.steps  # worker steps, each of --batch examples
    return {"workers": n, "ps_tasks": args.ps,
            "examples_per_s": steps * args.batch / wall,
            "cpu_s_per_example": sum(cpu) / (steps * args.batch),
            "cpu_s_ps": sum(cpu[:args.ps]), "cpu_s_workers": sum(cpu[args.ps:]),
            "bytes_per_step": sum(sent) / steps,
            "bytes_per_step_ps": sum(sent[:args.ps]) / steps,
            "ideal_bytes_per_step": sum(r["ideal_bytes"] for r in results) / steps,
            "loopback_bytes_per_step": lo / steps, "wall_s": wall, "per_worker": results}


def _write_report(args, argv, benchmark, results):
    with open(args.json, "w") as f:
        json.dump({"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"),
                   "command": shlex.join(["benchmarks/distributed.py", *(argv or sys.argv[1:])]),
                   "load_average": os.getloadavg(), "args": vars(args),
                   "results": results}, f, indent=1)


def ps_main(args, argv):
    """--ps: the plain process, then each --workers count against --ps tasks."""
    plain = run_cluster(args, 0)
    if plain is None:
        return 1
    plain_cpu = plain["cpu_s_per_step"] / args.batch
    plain_rate = args.batch * plain["steps_per_s"]
    runs = []
    for n in [int(w) for w in args.workers.split(",") if w]:
        result = run_ps_cluster(args, n)
        if result is None:
            return 1
        runs.append(result)
    print(f"Parameter servers: {args.ps} PS tasks, asynchronous workers of --batch "
          f"{args.batch} rows, {args.threads} thread(s) a worker; CPU of every process "
          "(PS tasks included) and bytes every socket sent:")
    print(f"{'workers':>8} {'examples/s':>11} {'CPU us/ex':>10} {'vs plain':>9} "
          f"{'PS CPU':>7} {'bytes/step':>12} {'ideal':>12} {'vs ideal':>9}")
    print(f"{'plain':>8} {plain_rate:>11.0f} {plain_cpu * 1e6:>10.2f} {1:>9.2f}")
    for r in runs:
        share = r["cpu_s_ps"] / max(r["cpu_s_ps"] + r["cpu_s_workers"], 1e-9)
        print(f"{r['workers']:>8} {r['examples_per_s']:>11.0f} "
              f"{r['cpu_s_per_example'] * 1e6:>10.2f} {r['cpu_s_per_example'] / plain_cpu:>9.2f} "
              f"{share:>7.0%} {r['bytes_per_step']:>12.0f} {r['ideal_bytes_per_step']:>12.0f} "
              f"{r['bytes_per_step'] / r['ideal_bytes_per_step']:>9.2f}")
    _write_report(args, argv, "distributed_ps", {
        "plain": plain, "plain_examples_per_s": plain_rate,
        "plain_cpu_s_per_example": plain_cpu, "ps": runs})
    return 0


def main(argv=None):
    p = parser(__doc__, replicas=("", "MirroredStrategy logical-device counts, e.g. 1,2,4"),
               features=8, ids=2, dim=16, batch=4096, steps=30, warmup=3)
    p.add_argument("--quick", action="store_true", help="few small steps")
    p.add_argument("--json", default=os.path.join(HERE, "distributed.json"))
    p.add_argument("--workers", default="1,2,4",
                   help="MultiWorkerMirroredStrategy worker process counts (after the "
                        "plain one-process reference)")
    p.add_argument("--hidden", type=int, default=32, help="units of the Dense layer")
    p.add_argument("--metrics", default="",
                   help="compiled metrics, comma-separated Keras names or 'auc' (e.g. "
                        "auc,mae): each a log of every step")
    p.add_argument("--group", action="store_true",
                   help="the tables in one GroupEmbedding (one exchange a step for all)")
    p.add_argument("--no-tables", action="store_true",
                   help="the floor: the same model, data and fit with each feature's ids "
                        "cast to floats instead of looked up (no table, no exchange)")
    p.add_argument("--threads", type=int, default=1, help="intra/inter-op threads a process")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--mw-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ps", type=int, default=0,
                   help="parameter-server tasks: instead of MultiWorkerMirroredStrategy, "
                        "asynchronous workers (--workers counts, --batch rows a step each) "
                        "training one model on this many PS tasks, after the plain "
                        "one-process reference")
    for name in ("ps-cluster", "ps-worker", "ps-sync"):
        p.add_argument(f"--{name}", default="", help=argparse.SUPPRESS)
    p.add_argument("--ps-task", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ps-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.features = 512, 5, 4
    if args.child:
        child(args)
        return 0
    if args.mw_child:
        multi_worker_child(args)
        return 0
    if args.ps_child:
        ps_worker_child(args)
        return 0
    if args.ps:
        return ps_main(args, argv)
    results = []
    for n in [int(r) for r in args.replicas.split(",") if r]:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n)] + [
            f"--{k}={getattr(args, k)}" for k in _SIZES]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        result = child_result(out.returncode, out.stdout, out.stderr)
        if result is None:
            return 1
        results.append(result)
    if results:
        base = results[0].get("plain_steps_per_s") or results[0]["steps_per_s"]
        print("MirroredStrategy over logical CPU devices (one process):")
        print(f"{'replicas':>8} {'steps/s':>9} {'rows/s':>11} {'vs plain':>9}")
        for r in results:
            print(f"{r['replicas']:>8} {r['steps_per_s']:>9.2f} {r['rows_per_s']:>11.0f} "
                  f"{r['steps_per_s'] / base:>9.2f}")
    cluster = []
    workers = [int(w) for w in args.workers.split(",") if w]
    for n in [0] + workers if workers else []:
        result = run_cluster(args, n)
        if result is None:
            return 1
        cluster.append(result)
    if cluster:
        plain = cluster[0]["cpu_s_per_step"]
        print(f"MultiWorkerMirroredStrategy, global batch {args.batch}, {args.threads} "
              "thread(s) a process; CPU of every process and bytes its sockets sent:")
        print(f"{'workers':>8} {'CPU s/step':>11} {'vs plain':>9} {'bytes/step':>12} "
              f"{'ideal':>12} {'vs ideal':>9} {'steps/s':>8}")
        for r in cluster:
            ratio = (r["bytes_per_step"] / r["ideal_bytes_per_step"]
                     if r["ideal_bytes_per_step"] else float("nan"))
            print(f"{r['workers'] or 'plain':>8} {r['cpu_s_per_step']:>11.4f} "
                  f"{r['cpu_s_per_step'] / plain:>9.2f} {r['bytes_per_step']:>12.0f} "
                  f"{r['ideal_bytes_per_step']:>12.0f} {ratio:>9.2f} {r['steps_per_s']:>8.2f}")
        print("CPU s/step of all processes by thread (where the time goes):")
        for r in cluster:
            by_thread = {}
            for w in r["per_worker"]:
                for name, seconds in w.get("threads", {}).items():
                    by_thread[name] = by_thread.get(name, 0.0) + seconds / args.steps
            top = sorted(by_thread.items(), key=lambda kv: -kv[1])[:5]
            print(f"{r['workers'] or 'plain':>8}  " + ", ".join(f"{k} {v:.4f}" for k, v in top))
    _write_report(args, argv, "distributed", {"mirrored": results, "cluster": cluster})
    return 0


if __name__ == "__main__":
    sys.exit(main())
