"""Peer-benchmark worker for Keras 3 models in `.venv`: ours and stock Keras.

`--impl`:

* `group`: ours, one `keras_rec_emb.layers.GroupEmbedding` over one
  `EmbeddingVariable` per feature (combiner "sum"), called on the
  workload's stacked `[batch, F, L]` ids tensor as it is (feature j's ids
  `ids[:, j, :]`, padded with -1; L = 1 for the single-id variant): one op
  splits it per feature, no per-feature slicing.
* `separate`: ours, one `EmbeddingVariable` layer per feature, each called
  on its column of `tf.unstack(ids, axis=1)` (one op splits the stacked
  ids); multi-id ids padded with -1 as they are, with combiner "sum" and
  `prune_invalid_ids=True` (the -1 padding dropped in the fused lookup, no
  conversion to ragged).
* `keras`: stock Keras, per feature `Hashing(vocab)` then
  `Embedding(vocab, dim)`, the -1 padding masked out of the sum.

Then concat -> `Dense(1, sigmoid)`, binary cross-entropy; ours with
`keras_rec_emb.optimizers.Adagrad` (tables and dense), stock with
`keras.optimizers.Adagrad`, both with the workload's `OPTIMIZER` settings
(accumulators from 0, epsilon squared: Keras puts it inside the sqrt). Training runs `model.fit` over a cached
`tf.data` pipeline of the pre-built batches; a callback times the steps
after the fit's first. The forward lookup is the embedding part alone
(`training=False`) in a `tf.function`, on pre-built batch tensors.

Threads: the driver passes `--threads T`; TensorFlow's intra-op pool gets
T threads and its inter-op pool 1 (ops run one after another, each
splitting its work over T threads, as `torch.set_num_threads(T)` does).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol
import workload


def make_worker(args):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    ids, labels, meta = workload.load(args.data, args.variant)
    return KerasWorker(args.impl, ids, labels, meta, tf, keras)


class KerasWorker(protocol.FitRounds):
    def __init__(self, impl, ids, labels, meta, tf, keras):
        if impl not in ("group", "separate", "keras"):
            raise ValueError(f"--impl must be group, separate or keras; got {impl!r}")
        self.tf, self.meta, self.impl = tf, meta, impl
        self.rss_before_model = protocol.rss_bytes()
        F, dim, vocab = meta["features"], meta["dim"], meta["vocab"]
        multi = meta["max_ids"] > 1
        lr = meta["learning_rate"]
        if impl != "keras":
            import keras_rec_emb as kre
        r = meta["init_range"]
        init = keras.initializers.RandomUniform(-r, r, seed=0)

        class Model(keras.Model):
            def __init__(self):
                super().__init__()
                if impl == "group":
                    self.group = kre.layers.GroupEmbedding(
                        {f"f{j}": kre.layers.FeatureSpec(kre.layers.EmbeddingVariable(
                            dim, initializer=init, name=f"t{j}"), combiner="sum")
                         for j in range(F)}, output_mode="concat")
                elif impl == "separate":
                    self.tables = [kre.layers.EmbeddingVariable(
                        dim, initializer=init, combiner="sum" if multi else None,
                        prune_invalid_ids=multi, name=f"t{j}") for j in range(F)]
                else:
                    self.hashers = [keras.layers.Hashing(vocab) for _ in range(F)]
                    self.embs = [keras.layers.Embedding(vocab, dim, embeddings_initializer=init,
                                                        name=f"t{j}") for j in range(F)]
                self.head = keras.layers.Dense(1, activation="sigmoid")

            def embed(self, x, training=None):
                if impl == "group":  # the stacked [batch, F, L] ids as they are
                    return self.group(x, training=training)
                if impl == "separate":
                    cols = tf.unstack(x if multi else x[:, :, 0], axis=1)
                    return tf.concat([t(c, training=training)
                                      for t, c in zip(self.tables, cols)], 1)
                cols = [x[:, j, :] if multi else x[:, j, 0] for j in range(F)]
                outs = []
                for h, e, c in zip(self.hashers, self.embs, cols):
                    rows = e(h(c))
                    if multi:
                        mask = tf.cast(c >= 0, rows.dtype)[..., None]
                        rows = tf.reduce_sum(rows * mask, axis=1)
                    outs.append(rows)
                return tf.concat(outs, 1)

            def call(self, x, training=None):
                return self.head(self.embed(x, training=training))

        self.model = Model()
        self.lookup_batches = protocol.lookup_batches(tf, ids, meta)
        self.model(self.lookup_batches[0])  # build eagerly (EV tables draw their init rows)
        # fbgemm's `g / (sqrt(acc) + eps)` is Keras's `g / sqrt(acc + eps**2)`.
        adagrad = dict(learning_rate=lr,
                       initial_accumulator_value=meta["adagrad_initial_accumulator"],
                       epsilon=meta["adagrad_epsilon"] ** 2)
        opt = (keras.optimizers.Adagrad(**adagrad) if impl == "keras"
               else kre.optimizers.Adagrad(**adagrad))
        self.model.compile(optimizer=opt, loss="binary_crossentropy")
        self.start_rounds(tf, keras, ids, labels, meta,
                          tf.function(lambda x: self.model.embed(x, training=False)))
        self.info = {"impl": impl, **self.loss_check, "framework_versions": {
            "tensorflow": tf.__version__, "keras": keras.__version__}}

    def stats(self):
        if self.impl == "keras":
            # Static tables: the embedding matrices and their Adagrad accumulators.
            emb = sum(int(e.embeddings.numpy().nbytes) for e in self.model.embs)
            return {"table_rows": self.meta["features"] * self.meta["vocab"],
                    "table_bytes": 2 * emb}
        import keras_rec_emb as kre

        evs = [layer for layer in self.model._flatten_layers()
               if isinstance(layer, kre.layers.EmbeddingVariable)]
        return {"table_rows": int(sum(t.table.size() for t in evs)),
                "table_bytes": int(sum(t.table.memory_bytes() for t in evs))}


if __name__ == "__main__":
    protocol.serve(make_worker)
