"""One worker of a 2-worker MultiWorkerMirroredStrategy cluster on
127.0.0.1 (TF_CONFIG set by test_mirrored.py). Checks what TF 2.21's CPU
collectives carry between the workers (all-reduce, all-gather of ids) and
what building an EmbeddingVariable under the strategy does today; writes
OUT.json.

    mwms_probe.py OUT.json
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_rec_emb as kre  # noqa: E402


def main():
    out = {}
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    out["replicas"] = strategy.num_replicas_in_sync

    @tf.function
    def exchange():
        def fn():
            ctx = tf.distribute.get_replica_context()
            ids = tf.constant([10, 20], tf.int64) + 100 * tf.cast(task, tf.int64)
            total = ctx.all_reduce("sum", tf.constant(float(task + 1)))
            return total, ctx.all_gather(ids, axis=0)
        return strategy.run(fn)

    total, gathered = exchange()
    out["all_reduce"] = float(strategy.experimental_local_results(total)[0])
    out["all_gather"] = strategy.experimental_local_results(gathered)[0].numpy().tolist()
    try:
        with strategy.scope():
            layer = kre.layers.EmbeddingVariable(4, name="mwms_emb")
            layer.build()
        out["build"] = "ok"
    except ValueError as e:
        out["build"] = str(e)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
