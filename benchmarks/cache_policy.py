"""Hit rates of cache replacement/admission policies on the storage.py trace.

Issue 14, item 6 (file tier): which policy would keep the hot rows of a
Zipf workload in a cache of 10% of the rows. A trace-driven simulation in
pure Python, no table: the ids of benchmarks/storage.py's batches (same
seed and defaults), each batch's distinct ids looked up in order, a cache
of --cache-fraction of the distinct ids; every batch is one training step
(lookup; the update that follows hits the rows just loaded, so it is left
out). Steps cycle over the --batches batches as storage.py's timed rounds
do; the first cycle warms the cache and is not counted.

Policies: CLOCK as the file tier has it (a loaded row gets its reference
bit), CLOCK with loaded rows unreferenced, GCLOCK (counter up to 3), and
either with frequency admission (a missed id replaces the CLOCK victim only
if it has been seen at least as often: TinyLFU's rule with exact counts,
otherwise it is used once and not cached); and the static bound (the
--cache-fraction most frequent ids always cached).

    .venv/bin/python benchmarks/cache_policy.py      # ~1 min per policy on 2 cores
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parser
from storage import WORKLOAD, make_batches


def simulate(steps, cap, insert_ref, max_ref, admit_by_freq, cycles):
    slot_of, keys, ref, freq = {}, [], [], {}
    hand = hits = misses = 0
    for t in range(cycles * len(steps)):
        counted = t >= len(steps)
        for k in steps[t % len(steps)]:
            freq[k] = freq.get(k, 0) + 1
            s = slot_of.get(k)
            if s is not None:
                ref[s] = min(max_ref, ref[s] + 1)
                hits += counted
                continue
            misses += counted
            if len(keys) < cap:
                slot_of[k] = len(keys)
                keys.append(k)
                ref.append(insert_ref)
                continue
            while ref[hand]:
                ref[hand] -= 1
                hand = (hand + 1) % cap
            victim = hand
            hand = (hand + 1) % cap
            if admit_by_freq and freq[k] < freq[keys[victim]]:
                continue
            del slot_of[keys[victim]]
            keys[victim], slot_of[k], ref[victim] = k, victim, insert_ref
    return hits / max(1, hits + misses)


def main(argv=None):
    opts = parser(__doc__, **WORKLOAD, cache_fraction=0.1, cycles=3).parse_args(argv)
    steps = [np.unique(ids).tolist() for ids, _ in make_batches(opts)]
    keys, counts = np.unique(np.concatenate([np.asarray(s) for s in steps]), return_counts=True)
    cap = max(1, int(opts.cache_fraction * len(keys)))
    top = set(keys[np.argsort(-counts, kind="stable")[:cap]].tolist())
    static = sum(len(top.intersection(s)) for s in steps) / sum(len(s) for s in steps)
    print(f"{len(keys):,} ids, cache {cap:,} rows; lookup hit rate per policy:")
    for name, args in (("CLOCK, loaded rows referenced (file tier)", (1, 1, False)),
                       ("CLOCK, loaded rows unreferenced", (0, 1, False)),
                       ("GCLOCK(3), loaded rows unreferenced", (0, 3, False)),
                       ("CLOCK + frequency admission", (1, 1, True)),
                       ("GCLOCK(3) + frequency admission", (0, 3, True))):
        print(f"  {name:45s} {simulate(steps, cap, *args, opts.cycles):.3f}", flush=True)
    print(f"  {'static: the most frequent ids (bound)':45s} {static:.3f}")


if __name__ == "__main__":
    main()
