"""The training table calls split over XLA's intra-op pool
(csrc/jax/parallel.h): a pooled training lookup's shards and row sums, and
its update's shards, give the same rows and the same tables, bit for bit,
whatever the number of threads XLA's CPU client has."""

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Three steps on three Adagrad tables of rows of 1-5 ids: 16384 rows of ids
# over a vocabulary of 10**6, so that each call has enough distinct ids to
# be split over two threads (jax/parallel.h's kMinIdsPerThread). Prints a
# digest of every pooled output and of each table's export, sorted by key.
_CHILD = r"""
import hashlib, json
import numpy as np
from keras_rec_emb.backend.jax import ffi

DIM, ROWS, L = 8, 16384, 5
digest = hashlib.sha256()
tables = [ffi.create(np.linspace(-1, 1, 7 * DIM, dtype=np.float32).reshape(7, DIM))
          for _ in range(3)]
for t in tables:
    ffi.add_slot(t, "accumulator", DIM, 0.1)
rng = np.random.default_rng(5)
for step in range(3):
    for i, t in enumerate(tables):
        ids = rng.integers(0, 10**6, size=(ROWS, L)).astype(np.int32)
        ids[np.arange(L)[None, :] >= rng.integers(1, L + 1, size=ROWS)[:, None]] = -1
        weights = rng.uniform(0.1, 2.0, size=(ROWS, L)).astype(np.float32)
        combiner = ("sum", "mean", "sqrtn")[i]
        rows, inverse, uniq, count = ffi.pooled_lookup_distinct(t, ids, DIM, combiner, weights,
                                                                prune=True)
        digest.update(np.asarray(rows).tobytes())
        grads = rng.normal(size=(ROWS, DIM)).astype(np.float32)
        ffi.apply_distinct(t, uniq, count, inverse, grads, [0.2, 0.0, 1e-7], step, "adagrad",
                           ("learning_rate", "decay", "epsilon"), ("accumulator",), combiner,
                           weights)
for t in tables:
    got = ffi.export(t, "int32", DIM)
    order = np.argsort(got["keys"])
    for part in ("keys", "values", "freqs", "versions", "slots"):
        digest.update(np.ascontiguousarray(got[part][order]).tobytes())
    ffi.destroy(t)
print(json.dumps({"digest": digest.hexdigest()}))
"""


def _digest(one_thread):
    """The child's digest, with XLA's CPU client on one thread or on as many
    as the cores this process may use (its pool's size follows the CPU
    affinity)."""
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", JAX_ENABLE_X64="0",
               PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    cores = sorted(os.sched_getaffinity(0))
    if one_thread:
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
        cores = cores[:1]
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         timeout=300, cwd=_ROOT, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["digest"]


def test_training_calls_give_the_same_tables_on_one_thread_and_on_every_core():
    one, every = _digest(True), _digest(False)
    assert len(one) == 64
    assert one == every
