"""What the in-process A/B scripts (stacked_*_ab.py) share: their
positional arguments, TensorFlow's thread pools, and timing rounds that
interleave the two forms."""

import json
import os
import sys
import time

DATA_DIR = "/tmp/h19b/peers/peers-data"  # run.py's default --data-dir


def arguments(*spec):
    """`sys.argv[1:]` by position: `spec` holds a (name, type, default) row
    per argument, (name, type) for a required one; their values in order."""
    values = []
    for i, (name, kind, *default) in enumerate(spec, 1):
        if len(sys.argv) > i:
            values.append(kind(sys.argv[i]))
        elif default:
            values.append(default[0])
        else:
            sys.exit(f"missing argument {i}: {name}; see the module's docstring")
    return values


def tensorflow(threads):
    """TensorFlow, quiet, with `threads` intra-op threads and one inter-op
    thread: set before any op runs."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def interleaved(calls, inputs, rounds, reps):
    """`reps` calls of `calls[name]` per name and round, on `inputs` in
    turn, the order of the names flipping every round; (wall, CPU) ms a
    call, each a list of one figure a round per name."""
    names = list(calls)
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn = calls[name]
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(reps):
                fn(inputs[i % len(inputs)])
            wall[name].append(1e3 * (time.perf_counter() - w0) / reps)
            cpu[name].append(1e3 * (time.process_time() - c0) / reps)
    return wall, cpu


def report(out, res, unit, top, bottom):
    """Prints `out` as JSON with, per form of `res` (name -> a figure a
    round), its median, min and max (`unit`), and the median and range of
    the per-round ratio of form `top` to form `bottom`."""
    for name, v in res.items():
        v = sorted(v)
        out[name] = {f"{unit}_median": round(v[len(v) // 2], 2), "min": round(v[0], 2),
                     "max": round(v[-1], 2)}
    ratios = sorted(a / b for a, b in zip(res[top], res[bottom]))
    out[f"{top}/{bottom} median"] = round(ratios[len(ratios) // 2], 3)
    out["range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
    print(json.dumps(out))
