"""Training-lookup throughput and memory of the admission filters.

On a stream of ids where most distinct keys (90% by default) appear exactly
once, four tables, side by side in one process, see the same batches through
their training lookup (``EmbeddingTable.lookup(keys, insert=True)``, which
counts and admits):

* ``none``: no filter; every key gets a row on first sight.
* ``counter``: ``CounterFilter(filter_freq=2)``; a key seen once keeps an
  index entry and its count (no row).
* ``cbf_uint8``: ``CBFFilter(filter_freq=2)`` with 1-byte counters, sized for
  the stream's distinct keys at false-positive probability 0.01; a key seen
  once lives only in the Bloom counters.
* ``cbf_uint64``: the same with 8-byte counters (DeepRec's default type).

Every table is built from ``EmbeddingVariableOption(filter_option=...)
.table_kwargs()``, as ``EmbeddingVariable`` builds it (32 shards; frequency
and version tracked when a filter is on, not without one). No optimizer
slots: memory is index, rows, metadata and Bloom counters.

Stream: hot keys are Zipf(``--zipf-a``) ranks over an unbounded key space;
one-off keys are distinct random keys from a disjoint range. The number of
one-off keys is chosen so that the fraction of distinct keys seen exactly
once is ``--singleton-fraction``, and the hot prefix is sized (by bisection)
so that the stream holds ``--ids`` ids. Both are shuffled together and cut
into batches of ``--batch``. The actual fraction is measured and reported.

Timing: one ``tf.function`` per table (traced before timing) looks up each
batch; a pass feeds the whole stream into a fresh, empty table. The tables
take turns pass by pass, for ``--reps`` passes each; lookups/s is ids /
median pass time. After the last pass the admitted and filtered key counts
are checked against the stream's exact counts (a CBF may admit extra keys:
its false positives, reported).

Memory: ``table.stats()["memory_bytes"]`` after a pass, per distinct key of
the stream and per admitted key, and as a ratio to ``none``.

Run from the repository root (the default takes about 15 s on 2 cores, the
small run about 5 s):

    PYTHONPATH=. .venv/bin/python benchmarks/filters.py
    PYTHONPATH=. .venv/bin/python benchmarks/filters.py --ids 200000 --batch 20000
"""

import os
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

from _common import parser
from _machine import machine_info, write_json_report

FILTER_FREQ = 2
CBF_FALSE_POSITIVE = 0.01
DEFAULT_VALUE_DIM = 4096
ONE_OFF_BIT = np.int64(1) << 62  # set in one-off keys only: disjoint from hot keys
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "filters.json")


def parse_args(argv=None):
    return parser(
        __doc__, ids=(2_000_000, "ids in the stream"), batch=(100_000, "ids per lookup"),
        dim=(16, "row width"),
        singleton_fraction=(0.9, "target fraction of distinct keys seen exactly once"),
        zipf_a=(1.2, "Zipf exponent of hot keys"), reps=(5, "timed passes per table"), seed=0,
        json=(DEFAULT_JSON, "where to write results")).parse_args(argv)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# -- Stream ------------------------------------------------------------------------

def hot_keys(ranks):
    """Zipf ranks scattered over [0, 2**62) by an odd multiplier (a bijection)."""
    with np.errstate(over="ignore"):
        return (ranks * np.int64(0x9E3779B97F4A7C15 - 2**64)) & (ONE_OFF_BIT - 1)


def one_offs_needed(hot, fraction):
    """One-off keys that make `fraction` of the distinct keys singletons, given
    the hot ids `hot` (distinct hot keys d, of which s seen once:
    (u + s) / (u + d) = fraction)."""
    _, counts = np.unique(hot, return_counts=True)
    d, s = counts.size, int(np.sum(counts == 1))
    return max(0, int(np.ceil((fraction * d - s) / (1 - fraction))))


def make_stream(rng, total, fraction, zipf_a):
    """`total` shuffled ids: a Zipf hot prefix plus distinct one-off keys."""
    hot = hot_keys(rng.zipf(zipf_a, total).astype(np.int64))
    lo, hi = 1, total  # hot prefix length: lo fits in `total`, hi does not
    if lo + one_offs_needed(hot[:lo], fraction) > total:
        raise ValueError(f"--ids {total} is too small for --singleton-fraction {fraction}")
    while hi - lo > max(1, total // 1000):
        mid = (lo + hi) // 2
        if mid + one_offs_needed(hot[:mid], fraction) <= total:
            lo = mid
        else:
            hi = mid
    one_off = np.unique(rng.integers(0, ONE_OFF_BIT, total - lo, dtype=np.int64))
    stream = np.concatenate([hot[:lo], one_off | ONE_OFF_BIT])
    rng.shuffle(stream)
    return stream


def stream_stats(stream):
    _, counts = np.unique(stream, return_counts=True)
    return {"ids": int(stream.size), "distinct": int(counts.size),
            "singletons": int(np.sum(counts == 1)),
            "singleton_fraction": float(np.mean(counts == 1)),
            "admissible": int(np.sum(counts >= FILTER_FREQ))}


# -- Tables ------------------------------------------------------------------------

def table_options(distinct):
    """The filter option of each benchmarked table."""
    def cbf(counter_type):
        return kre.CBFFilter(FILTER_FREQ, max_element_size=distinct,
                             false_positive_probability=CBF_FALSE_POSITIVE,
                             counter_type=counter_type)
    return {"none": None, "counter": kre.CounterFilter(FILTER_FREQ),
            "cbf_uint8": cbf("uint8"), "cbf_uint64": cbf("uint64")}


def new_table(dim, filter_option, default_values):
    kwargs = kre.EmbeddingVariableOption(filter_option=filter_option).table_kwargs()
    return EmbeddingTable(dim, "int64", default_values, **kwargs)


def run_pass(dim, filter_option, default_values, batches):
    """Feeds every batch into a fresh table; returns (seconds, table)."""
    table = new_table(dim, filter_option, default_values)
    fn = tf.function(lambda keys: table.lookup(keys, insert=True)).get_concrete_function(
        tf.TensorSpec([None], tf.int64))
    start = time.perf_counter()
    for keys in batches:
        fn(keys)
    return time.perf_counter() - start, table


def check_counts(name, stats, truth):
    """Admitted/filtered keys match the stream's exact counts."""
    if name == "none":
        ok = stats["size"] == truth["distinct"] and stats["filtered"] == 0
    elif name == "counter":
        ok = (stats["size"] == truth["admissible"]
              and stats["filtered"] == truth["distinct"] - truth["admissible"])
    else:  # a CBF admits every admissible key, plus its false positives
        ok = stats["size"] >= truth["admissible"] and stats["filtered"] == 0
    if not ok:
        raise AssertionError(f"{name}: table stats {stats} disagree with stream {truth}")


def summarize(name, times, table, truth):
    stats = table.stats()
    check_counts(name, stats, truth)
    median = statistics.median(times)
    mem = stats["memory_bytes"]
    return {"lookups_per_s": truth["ids"] / median, "median_s": median, "times_s": times,
            "admitted": stats["size"], "filtered": stats["filtered"],
            "false_positive_admissions": (stats["size"] - truth["admissible"]
                                          if name.startswith("cbf") else 0),
            "memory_bytes": mem, "bytes_per_distinct_key": mem / truth["distinct"],
            "bytes_per_admitted_key": mem / max(1, stats["size"])}


def add_ratios(results):
    base = results["none"]
    for r in results.values():
        r["throughput_vs_none"] = r["lookups_per_s"] / base["lookups_per_s"]
        r["memory_vs_none"] = r["memory_bytes"] / base["memory_bytes"]


# -- Report --------------------------------------------------------------------------

def print_report(config, truth, results):
    print(f"\nTraining lookups, {truth['ids']:,} ids in batches of {config['batch']:,}, "
          f"dim {config['dim']}, filter_freq {FILTER_FREQ}, median of {config['reps']} passes")
    print(f"distinct keys {truth['distinct']:,}, seen once {truth['singletons']:,} "
          f"({truth['singleton_fraction']:.1%}), seen >= {FILTER_FREQ} times "
          f"{truth['admissible']:,}")
    head = (f"{'table':>10} | {'M lookups/s':>11} {'vs none':>8} | {'admitted':>9} "
            f"{'filtered':>9} | {'MB':>7} {'B/distinct':>10} {'B/admitted':>10} "
            f"{'vs none':>8}")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        print(f"{name:>10} | {r['lookups_per_s'] / 1e6:>11.2f} {r['throughput_vs_none']:>7.2f}x"
              f" | {r['admitted']:>9,} {r['filtered']:>9,} | "
              f"{r['memory_bytes'] / 2**20:>7.1f} {r['bytes_per_distinct_key']:>10.1f} "
              f"{r['bytes_per_admitted_key']:>10.1f} {r['memory_vs_none']:>7.2f}x")
    for name, r in results.items():
        if name.startswith("cbf"):
            print(f"{name}: {r['false_positive_admissions']:,} keys seen once admitted "
                  f"by false positives ({r['false_positive_admissions'] / truth['singletons']:.2%}"
                  " of them)")


def main(argv=None):
    opts = parse_args(argv)
    rng = np.random.default_rng(opts.seed)
    t0 = time.perf_counter()
    stream = make_stream(rng, opts.ids, opts.singleton_fraction, opts.zipf_a)
    truth = stream_stats(stream)
    batches = [tf.constant(stream[i:i + opts.batch]) for i in range(0, stream.size, opts.batch)]
    default_values = rng.standard_normal((DEFAULT_VALUE_DIM, opts.dim)).astype(np.float32)
    log(f"stream of {truth['ids']:,} ids built in {time.perf_counter() - t0:.1f}s; "
        f"{truth['singleton_fraction']:.1%} of {truth['distinct']:,} distinct keys seen once")

    options = table_options(truth["distinct"])
    times = {name: [] for name in options}
    tables = {}
    for _ in range(opts.reps):
        for name, option in options.items():
            seconds, tables[name] = run_pass(opts.dim, option, default_values, batches)
            times[name].append(seconds)
    results = {name: summarize(name, times[name], tables[name], truth)
               for name in options}
    add_ratios(results)

    config = {"ids": opts.ids, "batch": opts.batch, "dim": opts.dim,
              "singleton_fraction_target": opts.singleton_fraction, "zipf_a": opts.zipf_a,
              "reps": opts.reps, "seed": opts.seed, "filter_freq": FILTER_FREQ,
              "cbf_false_positive_probability": CBF_FALSE_POSITIVE,
              "cbf_sizing": {name: list(o.sizing()) for name, o in options.items()
                             if isinstance(o, kre.CBFFilter)}}
    print_report(config, truth, results)
    report = {"benchmark": "filters", "config": config, "stream": truth,
              "machine": machine_info(), "results": results}
    print()
    write_json_report(opts.json, report)


if __name__ == "__main__":
    main()
