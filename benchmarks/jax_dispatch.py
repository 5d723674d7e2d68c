"""The dispatch of a jitted function holding a table call, `jax.jit`'s own
against `OrderedJit`'s (keras_rec_emb/backend/jax/dispatch.py), which
Keras's JAX trainer steps get.

A jitted function of N small float arrays (donated, as Keras donates its
state) that adds one to each; with `--with-call` (the default) it also
looks up 4096 ids in a table, as a training step does. N=86 is Keras's
state for the peer workload's 26 tables with Adagrad. Rounds alternate
the two dispatches (order reversed every other round); each round times
`--calls` calls and waits for the last result. Ratios are the medians of
the per-round ratios (jax.jit ms / OrderedJit ms: above 1 is OrderedJit
faster), and the plain jitted function without the table call (JAX's C++
dispatch) is printed for reference.

    .venv/bin/python benchmarks/jax_dispatch.py            # N = 1, 26, 86
    .venv/bin/python benchmarks/jax_dispatch.py --arrays 86 --rounds 9

Prints a table and the JSON (also bench-report/jax_dispatch.json).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arrays", default="1,26,86")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--output-dir", default=str(ROOT / "bench-report"))
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import jax.numpy as jnp
    import numpy as np

    import keras_rec_emb  # noqa: F401 (JAX's 64-bit mode, the library)
    from keras_rec_emb.backend.jax import dispatch, ffi

    handle = ffi.create(np.zeros((1, 16), np.float32), key_dtype="int64")
    ids = jnp.asarray(np.arange(4096, dtype=np.int64))

    def make(n, with_call):
        def step(state, keys):
            out = [x + 1 for x in state]
            if with_call:
                out[0] = out[0] + ffi.lookup(handle, keys, 16)[0, 0]
            return out
        return step

    def timed(fn, state):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            state = fn(state, ids)
        jax.block_until_ready(state)
        return (time.perf_counter() - t0) / a.calls * 1e3, state

    rows = []
    for n in [int(v) for v in a.arrays.split(",")]:
        fns = {"jax.jit": jax.jit(make(n, True), donate_argnums=0),
               "OrderedJit": dispatch.OrderedJit(jax.jit(make(n, True), donate_argnums=0)),
               "jax.jit, no table call": jax.jit(make(n, False), donate_argnums=0)}
        states = {name: [jnp.zeros((16,), jnp.float32) for _ in range(n)] for name in fns}
        for name, fn in fns.items():  # compile, warm up
            _, states[name] = timed(fn, states[name])
        ms = {name: [] for name in fns}
        for r in range(a.rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t, states[name] = timed(fns[name], states[name])
                ms[name].append(t)
        ratios = [j / o for j, o in zip(ms["jax.jit"], ms["OrderedJit"])]
        rows.append({"arrays": n, "ms_per_call": {k: statistics.median(v) for k, v in ms.items()},
                     "jax_jit_over_ordered_jit": {"median": statistics.median(ratios),
                                                  "min": min(ratios), "max": max(ratios)}})
    print("| arrays | jax.jit ms | OrderedJit ms | jax.jit / OrderedJit | no table call ms |")
    print("|---|---|---|---|---|")
    for row in rows:
        m, q = row["ms_per_call"], row["jax_jit_over_ordered_jit"]
        print(f"| {row['arrays']} | {m['jax.jit']:.3f} | {m['OrderedJit']:.3f} | "
              f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}) | "
              f"{m['jax.jit, no table call']:.3f} |")
    report = {"benchmark": "jax_dispatch", "rounds": a.rounds, "calls": a.calls,
              "load_1min": os.getloadavg()[0], "jax": jax.__version__, "rows": rows}
    out = pathlib.Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "jax_dispatch.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    ffi.destroy(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
