"""The worker side of the driver's pipe protocol (stdlib only).

A worker is started once per (framework, variant, threads); it loads the
ids, builds its model, warms up (one training pass over every batch, so
every key is in the tables, and a few lookups), then answers one JSON
line per command line on stdin:

* `{"op": "round", "steps": S, "lookups": L}` -> `{"steps_per_s",
  "cpu_ms_per_step", "lookup_ms", "loss", "rss_bytes"}`: S timed training
  steps (after one untimed step), then L timed forward lookups of a batch
  (inference). `cpu_ms_per_step` is the process's CPU time (all threads,
  `time.process_time`) over the timed steps: on a loaded machine it moves
  less than wall time (time spent waiting for a core is not counted), and a
  2-thread figure far above the 1-thread one shows threads spinning.
* `{"op": "stats"}` -> `{"table_rows", "table_bytes", "rss_bytes"}`.

The ready message carries `loss_initial` and `loss_after_warmup`: the
binary cross-entropy on the first batch before any step and after the
warm-up pass (one step per batch), computed the same way (`bce`) by every
worker, so the driver can check that the frameworks train the same model
at the same pace (a sanity check of the matched workload).
* `{"op": "quit"}`.

Before the first command it writes `{"event": "ready", ...}`; an error is
`{"error": "..."}` and the worker exits. Replies go to the process's
original stdout; the framework's own prints are sent to stderr.
"""

import json
import os
import sys
import time
import traceback


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def bce(p, y):
    """Mean binary cross-entropy of probabilities `p` (NumPy arrays), with
    Keras's clipping to [1e-7, 1 - 1e-7]."""
    import numpy as np

    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def lookup_batches(tf, ids, meta):
    """The workload's ids as `meta["batches"]` tensors of `meta["batch"]` rows."""
    b = meta["batch"]
    return [tf.constant(ids[i * b:(i + 1) * b]) for i in range(meta["batches"])]


def clock_callback(keras):
    """A Keras callback class that times `fit` from the end of its first
    batch to the end of its last: wall (`start`, `end`) and process CPU
    (`cpu_start`, `cpu_end`)."""

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(cb, batch, logs=None):
            now, cpu = time.perf_counter(), time.process_time()
            if batch == 0:
                cb.start, cb.cpu_start = now, cpu
            cb.end, cb.cpu_end = now, cpu

    return Clock


class FitRounds:
    """The round loop of the Keras-based workers (ours and TFRA's): `train`
    times `model.fit` from the end of its first batch to the end of its
    last, `lookup` times `embed_fn` over `lookup_batches`. A worker sets
    `model` (compiled) and `lookup_batches`, then calls `start_rounds`."""

    def start_rounds(self, tf, keras, ids, labels, meta, embed_fn):
        b = meta["batch"]
        self.dataset = (tf.data.Dataset.from_tensor_slices((ids, labels[:, None]))
                        .batch(b, drop_remainder=True).cache().repeat().prefetch(2))
        self.embed_fn = embed_fn
        self.Clock = clock_callback(keras)
        self.first_labels = labels[:b].astype("float64")
        loss_initial = self.eval_loss()
        # Warm-up: trace, build the optimizer, insert every key once.
        self.train(meta["batches"])
        self.lookup(3)
        self.loss_check = {"loss_initial": loss_initial, "loss_after_warmup": self.eval_loss()}

    def eval_loss(self):
        """Binary cross-entropy of the model on the first batch (no update)."""
        p = self.model(self.lookup_batches[0], training=False).numpy()[:, 0]
        return bce(p.astype("float64"), self.first_labels)

    def train(self, steps):
        clock = self.Clock()
        hist = self.model.fit(self.dataset, steps_per_epoch=steps + 1, epochs=1, verbose=0,
                              callbacks=[clock])
        self.cpu_s = clock.cpu_end - clock.cpu_start
        return clock.end - clock.start, hist.history["loss"][-1]

    def lookup(self, n):
        batches = self.lookup_batches
        t0 = time.perf_counter()
        for i in range(n):
            self.embed_fn(batches[i % len(batches)])
        return time.perf_counter() - t0


def thread_env(threads):
    """Environment every framework reads for its thread pools (set before
    the framework is imported)."""
    t = str(threads)
    os.environ.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t,
                       "OPENBLAS_NUM_THREADS": t, "TF_NUM_INTRAOP_THREADS": t,
                       "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                       # The size of XLA's CPU intra-op pool (JAX), where
                       # the table updates run when it has 2 threads or more.
                       "NPROC": t})


def serve(make_worker, argv=None):
    """Runs the loop: `make_worker(args)` returns an object with
    `train(steps) -> (seconds, loss)`, `lookup(n) -> seconds` and
    `stats() -> dict`, already warmed up, plus `info` (dict)."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--variant", required=True, choices=("single", "multi"))
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--impl", required=True)
    args = p.parse_args(argv)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # framework prints go to stderr; replies to `out`
    sys.stdout = sys.stderr

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        thread_env(args.threads)
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        worker = make_worker(args)
        reply({"event": "ready", "warmup_s": time.perf_counter() - t0,
               "rss_start_bytes": rss0, "rss_model_bytes": worker.rss_before_model,
               "rss_ready_bytes": rss_bytes(), **worker.info})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "round":
                seconds, loss = worker.train(cmd["steps"])
                lookup_s = worker.lookup(cmd["lookups"])
                reply({"steps_per_s": cmd["steps"] / seconds,
                       "cpu_ms_per_step": 1e3 * worker.cpu_s / cmd["steps"],
                       "lookup_ms": 1e3 * lookup_s / cmd["lookups"], "loss": float(loss),
                       "rss_bytes": rss_bytes()})
            elif cmd["op"] == "stats":
                reply({**worker.stats(), "rss_bytes": rss_bytes()})
            else:
                reply({"error": f"unknown op {cmd['op']!r}"})
    except Exception:
        reply({"error": traceback.format_exc()})
        sys.exit(1)
