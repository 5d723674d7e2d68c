"""A/B in one process under Keras's JAX backend: the peer workload's
`GroupEmbedding` training step with every feature's lookup in one table
call (`kre_group_pooled_lookup_distinct`, used when the table calls' pool
has 2+ threads) vs a table call per feature (used on one thread). Two
models of `worker_jax.py` side by side, `fit` rounds interleaved; prints
wall ms a step per form, the per-round ratio's median and range, and JSON.

    .venv/bin/python benchmarks/peers/jax_group_call_ab.py VARIANT THREADS \
        [STEPS [ROUNDS [DATA_DIR]]]

THREADS sizes XLA's CPU pool (`NPROC`). DATA_DIR holds the workload written
by run.py (default /tmp/h19b/peers/peers-data; written there if missing).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ab
import protocol
import workload

variant, threads, steps, rounds, data_dir = _ab.arguments(
    ("variant", str), ("threads", int), ("steps", int, 20), ("rounds", int, 7),
    ("data_dir", str, _ab.DATA_DIR))
protocol.thread_env(threads)
workload.generate(data_dir, workload.FULL)
import worker_jax  # noqa: E402


class Args:
    impl, data = "group", data_dir


Args.threads, Args.variant = threads, variant
worker = worker_jax.make_worker  # sets XLA_FLAGS before JAX's CPU client starts
os.environ["KERAS_BACKEND"] = "jax"
from keras_rec_emb.backend.jax import ffi  # noqa: E402

pool = ffi.pool_threads
forms = {}
for name, fake in (("one_call", 2), ("per_table", 1)):
    # The step is traced in the worker's warm-up: as with a pool of `fake`.
    ffi.pool_threads = lambda fake=fake: fake
    forms[name] = worker(Args)
ffi.pool_threads = pool
res = {name: [] for name in forms}
for r in range(rounds):
    for name in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
        wall, _ = forms[name].train(steps)
        res[name].append(1e3 * wall / steps)
_ab.report({"variant": variant, "threads": threads, "pool_threads": pool(),
            "load": os.getloadavg()[0]}, res, "ms_a_step", "per_table", "one_call")
