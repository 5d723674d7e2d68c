"""CPU ms per GroupEmbedding forward on the peer workload's stacked ids.

One process, one intra-op thread: builds the 26 tables of the workload
(every key inserted by a training lookup), then times `reps` inference calls
of the layer on the stacked `[batch, 26, L]` id tensor. Used to compare two
builds of the package: run it with each build's interpreter in turn,
alternating a few times, and compare the medians (CPU time is the steadier
figure on a shared machine). Prints one JSON line.

    python benchmarks/peers/forward_cpu.py multi --data-dir DIR --reps 150
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=["single", "multi"])
    parser.add_argument("--data-dir", required=True,
                        help="the workload's .npy directory (benchmarks/peers/run.py --data-dir)")
    parser.add_argument("--reps", type=int, default=150)
    args = parser.parse_args()
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1. Received: --reps={args.reps}")

    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import keras_rec_emb as kre
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import protocol
    import workload

    ids, _, meta = workload.load(args.data_dir, args.variant)
    features, dim = meta["features"], meta["dim"]
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=0)
    group = kre.layers.GroupEmbedding(
        {f"f{j}": kre.layers.FeatureSpec(
            kre.layers.EmbeddingVariable(dim, initializer=init, name=f"t{j}"), combiner="sum")
         for j in range(features)},
        output_mode="concat")
    batches = protocol.lookup_batches(tf, ids, meta)
    for b in batches:
        group(b, training=True)  # inserts every key
    fn = tf.function(lambda x: group(x, training=False))
    for b in batches:
        fn(b)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(args.reps):
        fn(batches[i % len(batches)])
    t1, c1 = time.perf_counter(), time.process_time()
    print(json.dumps({"variant": args.variant, "reps": args.reps,
                      "rows": int(sum(t.table.size() for t in group.tables)),
                      "wall_ms": 1e3 * (t1 - t0) / args.reps,
                      "cpu_ms": 1e3 * (c1 - c0) / args.reps}))


if __name__ == "__main__":
    main()
