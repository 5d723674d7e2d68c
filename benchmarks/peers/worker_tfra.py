"""Peer-benchmark worker for TensorFlow Recommenders-Addons 0.8.1 (`.venv-tfra`).

Runs with TF 2.16.2 and tf-keras 2.16.0 (`TF_USE_LEGACY_KERAS=1`, set by
the driver). Per feature one `tfra.dynamic_embedding.keras.layers.Embedding
(dim)` (a dynamic hash table); multi-id ids are looked up as the `[batch, 5]`
tensor padded with -1 and the padding masked out of the sum (key -1 gets a
row that is never trained). Then concat -> `Dense(1, sigmoid)`, BCE,
`de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adagrad)` with the
workload's `OPTIMIZER` settings.
Training by `model.fit` over a cached `tf.data` pipeline, timed by a
callback after the first step; forward lookup = the embedding part in a
`tf.function`. Threads: intra-op T, inter-op 1, as in `worker_keras.py`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol
import workload


def make_worker(args):
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tensorflow_recommenders_addons import dynamic_embedding as de

    ids, labels, meta = workload.load(args.data, args.variant)
    return TfraWorker(ids, labels, meta, tf, de)


class TfraWorker(protocol.FitRounds):
    def __init__(self, ids, labels, meta, tf, de):
        import tensorflow_recommenders_addons as tfra

        self.tf, self.meta = tf, meta
        self.rss_before_model = protocol.rss_bytes()
        F, dim, lr, r = meta["features"], meta["dim"], meta["learning_rate"], meta["init_range"]
        multi = meta["max_ids"] > 1
        keras = tf.keras

        class Model(keras.Model):
            def __init__(self):
                super().__init__()
                self.tables = [de.keras.layers.Embedding(
                    dim, initializer=keras.initializers.RandomUniform(-r, r, seed=j),
                    name=f"t{j}") for j in range(F)]
                self.head = keras.layers.Dense(1, activation="sigmoid")

            def embed(self, x):
                outs = []
                for j, t in enumerate(self.tables):
                    if multi:
                        c = x[:, j, :]
                        rows = t(c)
                        mask = tf.cast(c >= 0, rows.dtype)[..., None]
                        outs.append(tf.reduce_sum(rows * mask, axis=1))
                    else:
                        outs.append(t(x[:, j, 0]))
                return tf.concat(outs, 1)

            def call(self, x, training=None):
                return self.head(self.embed(x))

        self.model = Model()
        opt = de.DynamicEmbeddingOptimizer(keras.optimizers.legacy.Adagrad(
            lr, initial_accumulator_value=meta["adagrad_initial_accumulator"],
            epsilon=meta["adagrad_epsilon"]))
        self.model.compile(optimizer=opt, loss="binary_crossentropy")
        self.lookup_batches = protocol.lookup_batches(tf, ids, meta)
        self.start_rounds(tf, keras, ids, labels, meta, tf.function(self.model.embed))
        self.info = {"impl": "tfra", **self.loss_check, "framework_versions": {
            "tensorflow": tf.__version__, "tfra": tfra.__version__}}

    def stats(self):
        # The hash tables do not report their memory; RSS growth stands for it.
        return {"table_rows": int(sum(int(t.params.size()) for t in self.model.tables)),
                "table_bytes": None}


if __name__ == "__main__":
    protocol.serve(make_worker)
