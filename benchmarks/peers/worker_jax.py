"""Peer-benchmark worker for ours under Keras's JAX backend (`.venv`,
`KERAS_BACKEND=jax`): the tables through XLA's FFI, no TensorFlow.

`--impl`, the forms `worker_keras.py` runs under TensorFlow:

* `group`: one `keras_rec_emb.layers.GroupEmbedding` over one
  `EmbeddingVariable` per feature (combiner "sum", output "concat"),
  called on the workload's stacked `[batch, F, L]` ids as they are
  (padded with -1; L = 1 for the single-id variant).
* `separate`: one `keras_rec_emb.layers.EmbeddingVariable` per feature,
  each called on `ids[:, j, :]` (combiner "sum" and
  `prune_invalid_ids=True`; `ids[:, j, 0]` without a combiner for the
  single-id variant), concatenated.

Then `Dense(1, sigmoid)`, binary
cross-entropy, `keras_rec_emb.optimizers.Adagrad` from `model.compile` (the
workload's `OPTIMIZER` settings, as `worker_keras.py`). Training runs
`model.fit` (jitted by Keras's JAX trainer) over the pre-built batches from
a generator; the forward lookup is the embedding part alone
(`training=False`) in a `jax.jit`, on pre-built batch arrays on the device
(TensorFlow's forward gets pre-built tensors).

Threads: `--threads T` sizes XLA's CPU intra-op pool to T (`NPROC`,
`protocol.thread_env`); the table lookups run on the calling thread, the
table updates on that pool when it has 2 threads or more. `--threads 1`
also makes XLA's own code single-threaded
(`--xla_cpu_multi_thread_eigen=false`).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol
import workload


def make_worker(args):
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.threads == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false").strip()
    import jax
    import keras
    import numpy as np

    ids, labels, meta = workload.load(args.data, args.variant)
    return JaxWorker(args.impl, ids, labels, meta, jax, keras, np)


class JaxWorker(protocol.FitRounds):
    """`FitRounds`' `train` over a generator of the batches (no tf.data);
    its own forward (waiting for JAX's asynchronous results) and loss."""

    def __init__(self, impl, ids, labels, meta, jax, keras, np):
        if impl not in ("group", "separate"):
            raise ValueError(f"--impl must be group or separate; got {impl!r}")
        import keras_rec_emb as kre

        self.meta, self.np, self.keras = meta, np, keras
        self.rss_before_model = protocol.rss_bytes()
        F, dim = meta["features"], meta["dim"]
        multi = meta["max_ids"] > 1
        r = meta["init_range"]
        init = keras.initializers.RandomUniform(-r, r, seed=0)
        # The workload's int64 ids, as TensorFlow gets them (importing
        # keras_rec_emb turns JAX's 64-bit mode on: int64 keys).
        inputs = keras.Input(shape=ids.shape[1:], dtype="int64", batch_size=meta["batch"])
        if impl == "group":
            group = kre.layers.GroupEmbedding(
                {f"f{j}": kre.layers.FeatureSpec(kre.layers.EmbeddingVariable(
                    dim, initializer=init, name=f"t{j}"), combiner="sum") for j in range(F)},
                output_mode="concat")
            self.tables = group.tables
            embedded = group(inputs)
        else:
            pooled = {"combiner": "sum", "prune_invalid_ids": True} if multi else {}
            self.tables = [kre.layers.EmbeddingVariable(dim, initializer=init, name=f"t{j}",
                                                        **pooled) for j in range(F)]
            cols = [inputs[:, j, :] if multi else inputs[:, j, 0] for j in range(F)]
            embedded = keras.layers.Concatenate()([t(c) for t, c in zip(self.tables, cols)])
        self.embed_model = keras.Model(inputs, embedded)
        head = keras.layers.Dense(1, activation="sigmoid")
        self.model = keras.Model(inputs, head(embedded))
        self.model.compile(
            optimizer=kre.optimizers.Adagrad(
                learning_rate=meta["learning_rate"],
                initial_accumulator_value=meta["adagrad_initial_accumulator"],
                epsilon=meta["adagrad_epsilon"] ** 2),
            loss="binary_crossentropy")
        b = meta["batch"]
        self.batches = [ids[i * b:(i + 1) * b] for i in range(meta["batches"])]
        self.labels = [labels[i * b:(i + 1) * b, None] for i in range(meta["batches"])]
        self.first_labels = labels[:b].astype("float64")

        def forever():
            i = 0
            while True:
                yield self.batches[i % len(self.batches)], self.labels[i % len(self.labels)]
                i += 1

        self.dataset = forever()
        self.embed_fn = jax.jit(lambda x: self.embed_model(x, training=False))
        # Pre-built device arrays, as TensorFlow's forward gets tensors.
        self.lookup_batches = [jax.device_put(x) for x in self.batches]
        self.Clock = protocol.clock_callback(keras)
        loss_initial = self.eval_loss()
        self.train(meta["batches"])  # warm-up: trace, build, insert every key once
        self.lookup(3)
        self.info = {"impl": impl, "loss_initial": loss_initial,
                     "loss_after_warmup": self.eval_loss(),
                     "framework_versions": {"jax": jax.__version__, "keras": keras.__version__}}

    def eval_loss(self):
        p = self.np.asarray(self.model.predict(self.batches[0], batch_size=len(self.batches[0]),
                                               verbose=0))[:, 0]
        return protocol.bce(p.astype("float64"), self.first_labels)

    def lookup(self, n):
        t0 = time.perf_counter()
        for i in range(n):
            self.embed_fn(self.lookup_batches[i % len(self.lookup_batches)]).block_until_ready()
        return time.perf_counter() - t0

    def stats(self):
        # (The JAX binding reports no table memory yet: bytes per key left out.)
        return {"table_rows": int(sum(t.table_size() for t in self.tables)),
                "table_bytes": None}


if __name__ == "__main__":
    protocol.serve(make_worker)
