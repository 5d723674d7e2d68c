"""Synchronous sharded tables: steps/s and rows/s with 1, 2 and 4 replicas.

Issue 15, item 5. One process per replica count (logical CPU devices must be
configured before TensorFlow starts): a model of --features EmbeddingVariable
tables (dim --dim, --ids ids per feature and example) + a small MLP is
trained with `model.fit` for --steps steps of global batch --batch, first
without a strategy (1 process, "plain"), then under
`tf.distribute.MirroredStrategy` over N logical CPU devices, whose tables are
sharded by key hash over the replicas. Reported: steps/s, looked-up
rows/s, the scaling ratio against plain, and the bytes that cross between
devices per step, measured from the step's ids against the ideal:

* ideal: each id not owned by its replica goes to its owner (8 bytes) and
  its row comes back (4 * dim), and the gradient row goes to the owner
  again (4 * dim + 8);
* ours: the same ids and rows (the lookup reads the owner's shard directly:
  in one process the executor copies tensors between devices), but each
  shard's gradient is all-gathered: every replica's gradient rows for a
  shard reach all N replicas (N - 1 copies each), and only the owner applies
  them.

`--workers 2` (a list) also runs MultiWorkerMirroredStrategy clusters of
that many worker processes on 127.0.0.1 (TF_CONFIG, free ports, stopped by
pid), one replica each, trained with `model.fit` (every worker passes the
whole data; Keras splits each global batch). Their bytes per step
and worker: the all-gather of the global batch's ids ((N-1)/N * 8 T), and
two ring all-reduces of [T, dim] float32 rows (forward rows, backward
gradients: 2 * 2 (N-1)/N * 4 T dim), against the same ideal as above.

The machine has few cores: N logical devices share them, so steps/s do not
scale here; the numbers show the overhead of sharding, not a speed-up.

    .venv/bin/python benchmarks/distributed.py                 # 1, 2, 4 replicas
    .venv/bin/python benchmarks/distributed.py --quick
    .venv/bin/python benchmarks/distributed.py --replicas 1,2 --workers 2

Writes --json (default benchmarks/distributed.json).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def make_data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = args.batch * (args.steps + args.warmup)
    ids = rng.zipf(1.2, size=(rows, args.features, args.ids)).astype(np.int64) % 1_000_000
    y = rng.uniform(size=(rows, 1)).astype(np.float32)
    return ids, y


def build_model(args):
    import keras

    import keras_rec_emb as kre

    inputs = {f"f{i}": keras.Input((args.ids,), dtype="int64", name=f"f{i}")
              for i in range(args.features)}
    embs = [kre.layers.EmbeddingVariable(args.dim, combiner="sum", name=f"emb{i}")(
        inputs[f"f{i}"]) for i in range(args.features)]
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(embs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="mse")
    return model


def multi_worker_child(args):
    """One MultiWorkerMirroredStrategy worker (TF_CONFIG set by main)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n, task = strategy.num_replicas_in_sync, strategy.cluster_resolver.task_id
    ids, y = make_data(args)
    with strategy.scope():
        model = build_model(args)

    local = args.batch // n
    x = {f"f{i}": ids[:, i] for i in range(args.features)}

    def fit(first, count):
        # Every worker passes the whole data: Keras splits each global batch
        # of args.batch rows over the replicas.
        rows = slice(first * args.batch, (first + count) * args.batch)
        model.fit({k: v[rows] for k, v in x.items()}, y[rows], batch_size=args.batch,
                  shuffle=False, verbose=0)

    fit(0, args.warmup)
    start = time.perf_counter()
    fit(args.warmup, args.steps)
    steps_per_s = args.steps / (time.perf_counter() - start)
    from keras_rec_emb.distribute import ps_tables

    t = args.batch * args.ids  # ids per feature and global step
    ideal = 0.0
    for s in range(args.warmup, args.warmup + args.steps):
        batch = ids[s * args.batch:(s + 1) * args.batch]
        for r in range(n):
            mine = batch[r * local:(r + 1) * local].transpose(1, 0, 2).reshape(
                args.features, -1)
            remote = int((ps_tables.shard_of_numpy(mine, n) != r).sum())
            ideal += remote * (8 + 4 * args.dim) + remote * (4 * args.dim + 8)
    # Per worker and feature: ids received by the all-gather, two ring
    # all-reduces of [t, dim] float32; summed over the workers.
    ours = n * args.features * ((n - 1) / n * 8 * t + 2 * 2 * (n - 1) / n * 4 * t * args.dim)
    if task == 0:
        result = {"workers": n, "steps_per_s": steps_per_s,
                  "rows_per_s": steps_per_s * args.batch * args.features * args.ids,
                  "ideal_bytes_per_step": ideal / args.steps, "bytes_per_step": ours}
        print("RESULT " + json.dumps(result), flush=True)


def run_multi_worker(args, n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    addresses = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in socks]
    for sock in socks:
        sock.close()
    cmd = [sys.executable, os.path.abspath(__file__), "--mw-child"] + [
        f"--{k}={getattr(args, k)}" for k in ("features", "ids", "dim", "batch", "steps",
                                               "warmup")]
    procs = []
    try:
        for task in range(n):
            env = dict(os.environ, TF_CONFIG=json.dumps({
                "cluster": {"worker": addresses}, "task": {"type": "worker", "index": task}}))
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        out, err = procs[0].communicate(timeout=1800)
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by its pid
                p.wait(timeout=30)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if any(codes) or not line:
        sys.stderr.write(err[-3000:])
        return None
    return json.loads(line[0][len("RESULT "):])


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,2,4")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--ids", type=int, default=4)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="few small steps")
    p.add_argument("--json", default=os.path.join(HERE, "distributed.json"))
    p.add_argument("--workers", default="",
                   help="MultiWorkerMirroredStrategy worker counts, e.g. 2 or 2,3")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--mw-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.features = 256, 5, 4
    if args.child:
        child(args)
        return 0
    if args.mw_child:
        multi_worker_child(args)
        return 0
    results = []
    for n in [int(r) for r in args.replicas.split(",")]:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n)] + [
            f"--{k}={getattr(args, k)}" for k in ("features", "ids", "dim", "batch",
                                                   "steps", "warmup")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            sys.stderr.write(out.stderr[-3000:])
            return 1
        results.append(json.loads(line[0][len("RESULT "):]))
    for n in [int(w) for w in args.workers.split(",") if w]:
        result = run_multi_worker(args, n)
        if result is None:
            return 1
        result["replicas"] = f"{n} proc"
        results.append(result)
    base = results[0].get("plain_steps_per_s") or results[0]["steps_per_s"]
    print(f"{'replicas':>8} {'steps/s':>9} {'rows/s':>11} {'vs plain':>9} "
          f"{'bytes/step':>11} {'ideal':>11} {'ratio':>6}")
    for r in results:
        ratio = r["bytes_per_step"] / r["ideal_bytes_per_step"] if r["ideal_bytes_per_step"] \
            else float("nan")
        print(f"{r['replicas']:>8} {r['steps_per_s']:>9.2f} {r['rows_per_s']:>11.0f} "
              f"{r['steps_per_s'] / base:>9.2f} {r['bytes_per_step']:>11.0f} "
              f"{r['ideal_bytes_per_step']:>11.0f} {ratio:>6.2f}")
    if results[0].get("plain_steps_per_s"):
        print(f"plain (no strategy): {results[0]['plain_steps_per_s']:.2f} steps/s")
    with open(args.json, "w") as f:
        json.dump({"benchmark": "distributed", "date": time.strftime("%Y-%m-%d"),
                   "command": shlex.join(["benchmarks/distributed.py", *(argv or sys.argv[1:])]),
                   "load_average": os.getloadavg(), "args": vars(args),
                   "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
