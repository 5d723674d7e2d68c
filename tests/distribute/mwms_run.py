"""One worker of a MultiWorkerMirroredStrategy cluster on 127.0.0.1
(TF_CONFIG set by test_multi_worker.py): tables sharded over the worker
processes. Writes OUT/w{task}_*.npz.

    mwms_run.py OUT train      # model.fit / evaluate / predict with SGD, Adam
                               # and Adagrad, global batch BATCH, eviction during
                               # fit; saves the Adagrad model (.keras,
                               # tf.train.Checkpoint, export_for_serving)
    mwms_run.py OUT epochs     # model.fit of 3 epochs with Adam; then with
                               # Adagrad and 2 metrics, 2 steps an execution:
                               # fit, evaluate, predict
    mwms_run.py OUT restore SRC  # restores SRC's Adagrad model into this
                                 # cluster, predicts through a strategy.run
                                 # call, then fits it on more data

The one-process reference imports `build`, `data` and `fit` from here.
"""

import os
import sys
import time

START = time.monotonic()


def phase(name):
    """Seconds since start, in the worker's log (where a slow run spends)."""
    print(f"PHASE {name} {time.monotonic() - START:.1f}s", flush=True)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_rec_emb as kre  # noqa: E402
from keras_rec_emb.backend.tensorflow import compat as _compat  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import compile_mse, counted_table, table_arrays  # noqa: E402

DIM, BATCH, STEPS, IDS = 4, 12, 3, 3  # BATCH: global, a multiple of 2 and 3
STEPS_TO_LIVE = 1  # the GroupEmbedding's table evicts during fit


def data(seed=5):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 40, size=(BATCH * STEPS, IDS)).astype(np.int64)
    y = rng.uniform(size=(BATCH * STEPS, 1)).astype(np.float32)
    return ids, y


def dense_init():
    rng = np.random.default_rng(1)
    return [rng.normal(size=(DIM * (1 + IDS), 1)).astype(np.float32), np.zeros(1, np.float32)]


def build(optimizer, steps_per_execution=1, metrics=None):
    ids = keras.Input(shape=(IDS,), dtype="int64")
    emb = counted_table(DIM, "mean", filter_freq=2)(ids)
    # A GroupEmbedding over a second table (one feature per id column) whose
    # keys not updated for STEPS_TO_LIVE steps are evicted.
    group = kre.layers.GroupEmbedding(
        {f"f{j}": kre.layers.FeatureSpec(0, combiner="sum") for j in range(IDS)},
        tables=[kre.layers.EmbeddingVariable(
            DIM, name="group_0", initializer=keras.initializers.RandomUniform(-1, 1, seed=11),
            ev_option=kre.EmbeddingVariableOption(
                evict_option=kre.GlobalStepEvict(steps_to_live=STEPS_TO_LIVE)))],
        output_mode="concat", name="group")(ids)
    out = keras.layers.Dense(1, name="dense")(keras.layers.Concatenate()([emb, group]))
    return compile_mse(ids, out, optimizer, steps_per_execution, metrics)


def model_arrays(model):
    """Every table's rows (gathered from every shard) and the dense weights."""
    out = table_arrays(model.get_layer("emb").table)
    for t, table in enumerate(model.get_layer("group").tables):
        out.update({f"group{t}_{k}": v for k, v in table_arrays(table.table).items()})
    out["kernel"], out["bias"] = [np.asarray(w) for w in model.get_layer("dense").get_weights()]
    return out


def fit(model, seed=5, reset_dense=True, infer=True, evict_during_fit=True, epochs=1):
    """`model.fit` (one epoch of `data(seed)`, global batch BATCH, evicting
    after every step), then (if `infer`) `evaluate` and `predict` on the same
    data, as written for one process: under the strategy each worker passes
    the whole data and Keras gives each its part of every batch. Without
    `evict_during_fit` the GroupEmbedding's table evicts once after the
    export, at its own last update step."""
    if reset_dense:
        model.get_layer("dense").set_weights(dense_init())
    ids, y = data(seed)
    eviction = kre.callbacks.EvictionCallback(every_n_steps=1)
    history = model.fit(ids, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[eviction] if evict_during_fit else [])
    phase("fit")
    out = model_arrays(model)
    if evict_during_fit:
        out["evicted"] = np.int64(eviction.evicted)
    else:  # collective: every worker evicts its shard
        group_table = model.get_layer("group").tables[0]
        out["evicted"] = np.int64(group_table.evict())
        out["group0_keys_after_evict"] = table_arrays(group_table.table)["keys"]
    out["loss"] = np.float32(history.history["loss"][-1])
    out.update({f"log_{k}": np.float32(v[-1]) for k, v in history.history.items()})
    if not infer:  # (each costs seconds under the strategy: traced anew)
        return out
    out["evaluate"] = np.float32(model.evaluate(ids, y, batch_size=BATCH, verbose=0))
    out["predict"] = model.predict(ids, batch_size=BATCH, verbose=0)
    phase("evaluated, predicted")
    return out


def forward(model, ids):
    """The model's output for `ids` on every worker (each worker passes all
    of them), through the strategy's replica function: the low level under
    `predict`, as a hand-written loop would call it."""
    strategy = model.distribute_strategy
    result = tf.function(lambda x: strategy.run(lambda x: model(x, training=False),
                                                args=(x,)))(tf.constant(ids))
    return strategy.experimental_local_results(result)[0].numpy()


def shard_keys(table):
    """The keys this process's shard holds (no collective)."""
    return np.sort(table.shards[0].export(include_filtered=False)["keys"])


def main():
    keras.config.disable_traceback_filtering()
    folder, mode = sys.argv[1], sys.argv[2]
    phase("imported")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    n = strategy.num_replicas_in_sync
    phase("strategy")
    if mode == "epochs":  # several epochs: a new distributed iterator each
        with strategy.scope():
            model = build("adam")
        out = fit(model, infer=False, epochs=3)
        calls = model.train_function
        # Keras's train function called directly after each epoch's first step.
        out["direct_calls"] = np.int64(getattr(calls, "_calls", None) is not None)
        np.savez(os.path.join(folder, f"w{task}_epochs.npz"), **out)
        # Five steps an execution, at most two written out in one traced
        # function (`_compat.UNROLLED_STEPS_MAX`, 4 by default): each
        # execution calls functions of 2, 2 and 1 steps; over epochs of
        # STEPS = 3 steps the data runs out inside the second function and
        # the third finds none left. Evicting after each call would evict at
        # other steps than one process does.
        # With two metrics: a step's three logs travel in one all-reduce.
        _compat.UNROLLED_STEPS_MAX = 2
        with strategy.scope():
            model = build("adagrad", steps_per_execution=5, metrics=["mae", "mse"])
        out = fit(model, epochs=2, evict_during_fit=False)
        steps = model.train_function
        out["steps_a_call"] = np.array([step._kre_steps for step in steps._plan])
        out["all_reduces"] = np.array([sum(
            node.op == "CollectiveReduceV2"
            for node in [*graph.node, *(n for f in graph.library.function for n in f.node_def)])
            for graph in (concrete.graph.as_graph_def() for concrete, _ in steps._calls)])
        np.savez(os.path.join(folder, f"w{task}_steps_per_execution.npz"), **out)
        # A hand-written loop: each worker trains on its own part of every
        # global batch with `train_on_batch` (as a worker reading its own
        # stream would), then evaluates and predicts its part of the first.
        with strategy.scope():
            model = build("adagrad", steps_per_execution=2)
        model.get_layer("dense").set_weights(dense_init())
        ids, y = data()
        local = BATCH // n
        mine = [slice(step * BATCH + task * local, step * BATCH + (task + 1) * local)
                for step in range(STEPS)]
        losses = [model.train_on_batch(ids[part], y[part]) for part in mine]
        out = model_arrays(model)
        out["train_on_batch"] = np.float32(losses)
        out["test_on_batch"] = np.float32(model.test_on_batch(ids[mine[0]], y[mine[0]]))
        out["predict_on_batch"] = np.asarray(model.predict_on_batch(ids[mine[0]]))
        np.savez(os.path.join(folder, f"w{task}_on_batch.npz"), **out)
    elif mode == "train":
        for optimizer in ("sgd", "adam", "adagrad"):  # the last one is saved
            with strategy.scope():
                model = build(optimizer)
            phase(f"built {optimizer}")
            out = fit(model, infer=optimizer == "adagrad")
            table = model.get_layer("emb").table
            local = table.local_stats()
            out["local_stats"] = np.array([local["size"], local["filtered"]])
            every = table.stats()
            out["stats"] = np.array([every["size"], every["filtered"]])
            out["num_shards"] = np.int64(table.num_shards)
            out["index"] = np.int64(table.index)
            out["group0_shard_keys"] = shard_keys(model.get_layer("group").tables[0].table)
            np.savez(os.path.join(folder, f"w{task}_{optimizer}.npz"), **out)
        # Every worker saves and exports, each to its own path (as Keras and
        # TensorFlow leave it to the program; the chief's copy is the one to
        # keep): these gather every shard, so every worker takes part.
        model.save(os.path.join(folder, f"w{task}.keras"))
        tf.train.Checkpoint(model=model).write(os.path.join(folder, f"ckpt_w{task}", "ckpt"))
        kre.export_for_serving(model, os.path.join(folder, f"serving_w{task}"))
        phase("saved")
        try:  # an eager call outside the replica function is refused by name
            model(np.zeros((2, IDS), np.int64))
            refused = "not refused"
        except ValueError as e:
            refused = str(e)
        np.savez(os.path.join(folder, f"w{task}_refused.npz"), message=np.array(refused))
    else:
        source = sys.argv[3]
        with strategy.scope():
            model = build("adagrad")
            status = tf.train.Checkpoint(model=model).read(
                os.path.join(source, "ckpt_w0", "ckpt"))
            status.assert_existing_objects_matched().expect_partial()
        phase("restored")
        out = {f"ckpt_{k}": v for k, v in table_arrays(model.get_layer("emb").table).items()}
        out["ckpt_local_size"] = np.int64(model.get_layer("emb").table.local_stats()["size"])
        with strategy.scope():
            loaded = keras.saving.load_model(os.path.join(source, "w0.keras"))
        out.update({f"keras_{k}": v
                    for k, v in table_arrays(loaded.get_layer("emb").table).items()})
        ids, _ = data()
        phase("loaded")
        out["keras_predict"] = forward(loaded, ids[:BATCH])
        phase("predicted")
        # Training goes on in this cluster (any worker count) from the
        # restored model, on new data.
        out.update({f"fit_{k}": v
                    for k, v in fit(loaded, seed=6, reset_dense=False, infer=False,
                                        evict_during_fit=False).items()})
        out["num_shards"] = np.int64(n)
        np.savez(os.path.join(folder, f"w{task}_restore.npz"), **out)


if __name__ == "__main__":
    main()
