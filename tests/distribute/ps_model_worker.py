"""A worker of the one-model parameter-server tests (run by
tests/distribute/test_ps_one_model.py and test_ps_failover.py, never
collected by pytest).

    ps_model_worker.py ROLE --ps A,B --worker ADDR --task I --out DIR

Processes meet through files in DIR (`_mark` / `_wait_for`): a worker
writes `<name>` when it reaches a point and waits for the test's.
Models (the same code builds the one-process reference in the tests):

* `m1`: ids -> EmbeddingVariable(mean) + Dense(relu) over dense features
  -> Dense(relu) -> Dense(1), mse, SGD with momentum (slots on the PS):
  one worker equals one process.
* `m2`: the sum of the rows + Dense(1) over dense features, a loss linear
  in the output, plain SGD: every gradient is independent of the
  parameters, so the final tables and dense weights are the initial ones
  minus the sum of every push, in any order.
* `m3`: like `m1` with Adagrad (slots in tables and on the PS), for the
  restart tests.
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import keras_rec_emb as kre

DIM, IDS, FEATURES, BATCH = 4, 3, 2, 8
M1_STEPS, M2_STEPS, M3_STEPS = 6, 6, 8
LR = 0.1
PAUSE_AFTER = 2  # worker 1 of `m2` is killed after this batch (0-based)


@keras.saving.register_keras_serializable(package="kre_tests")
def linear_loss(y_true, y_pred):
    """Linear in the output: each gradient does not depend on the weights."""
    return y_true * y_pred


def data(model, rows, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 40, size=(rows, IDS)).astype(np.int64)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = (rng.uniform(-1, 1, size=(rows, 1)) if model == "m2"
         else rng.normal(size=(rows, 1))).astype(np.float32)
    return ids, x, y


def m1_data():
    return data("m1", M1_STEPS * BATCH, 1)


def m2_data(task):
    """Worker `task`'s part of the `m2` data (workers 0 and 1)."""
    return data("m2", M2_STEPS * BATCH, 10 + task)


def m3_data():
    return data("m3", M3_STEPS * BATCH, 3)


def probe():
    """Inputs every saved or served model is asked to predict."""
    ids = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 39], [0, 0, 12]], np.int64)
    x = np.linspace(-1, 1, 4 * FEATURES, dtype=np.float32).reshape(4, FEATURES)
    return [ids, x]


def build(name):
    init = keras.initializers.RandomUniform(-0.5, 0.5, seed=5)
    ids = keras.Input((IDS,), dtype="int64", name=f"{name}_ids")
    x = keras.Input((FEATURES,), name=f"{name}_x")
    if name == "m2":
        rows = kre.layers.EmbeddingVariable(
            DIM, name="m2_emb", initializer=init,
            ev_option=kre.EmbeddingVariableOption(
                init_option=kre.InitializerOption(default_value_dim=16), track_meta=True))(ids)
        out = keras.ops.expand_dims(keras.ops.sum(rows, axis=(1, 2)), -1) + keras.layers.Dense(
            1, name="m2_dense", kernel_initializer=keras.initializers.GlorotUniform(seed=6),
            bias_initializer=keras.initializers.Constant(0.25))(x)
        model = keras.Model([ids, x], out, name="m2")
        model.compile(optimizer=kre.optimizers.SGD(LR, name="m2_sgd"), loss=linear_loss)
        return model
    emb = kre.layers.EmbeddingVariable(DIM, combiner="mean", name=f"{name}_emb",
                                       initializer=init)(ids)
    bottom = keras.layers.Dense(
        4, activation="relu", name=f"{name}_bottom",
        kernel_initializer=keras.initializers.GlorotUniform(seed=7))(x)
    h = keras.layers.Dense(
        8, activation="relu", name=f"{name}_top",
        kernel_initializer=keras.initializers.GlorotUniform(seed=8))(
        keras.layers.Concatenate()([emb, bottom]))
    out = keras.layers.Dense(1, name=f"{name}_out",
                             kernel_initializer=keras.initializers.GlorotUniform(seed=9))(h)
    model = keras.Model([ids, x], out, name=name)
    optimizer = (kre.optimizers.SGD(0.05, momentum=0.5, name="m1_sgd") if name == "m1"
                 else kre.optimizers.Adagrad(0.1, name="m3_adagrad"))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def state(model):
    """Everything the model holds: its table, dense weights and optimizer
    variables (by path), and its predictions on `probe()`."""
    table = next(layer for layer in model.layers
                 if isinstance(layer, kre.layers.EmbeddingVariable)).table.export()
    out = {f"table/{k}": v for k, v in table.items() if k != "slots"}
    out.update({f"slot/{k}": v for k, v in table["slots"].items()})
    for layer in model.layers:
        for w in layer.weights:
            if isinstance(w, keras.Variable):
                out[f"dense/{w.path}"] = keras.ops.convert_to_numpy(w)
    for v in model.optimizer.variables:
        out[f"opt/{v.path}"] = keras.ops.convert_to_numpy(v)
    out["predictions"] = model.predict(probe(), verbose=0)
    return out


def placement(model):
    """Device of each dense and optimizer variable, by path."""
    pairs = [(w.path, w.value.device) for layer in model.layers for w in layer.weights
             if isinstance(w, keras.Variable)]
    pairs += [(v.path, v.value.device) for v in model.optimizer.variables]
    return dict(pairs)


def _mark(out, name, text=""):
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _wait_for(out, name, timeout=600):
    path = os.path.join(out, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


class AfterBatch(keras.callbacks.Callback):
    """Calls `action()` once, after batch `batch` (0-based) of `fit`."""

    def __init__(self, batch, action):
        super().__init__()
        self.batch, self.action = batch, action

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.action()


def _save(out, model, name):
    np.savez(os.path.join(out, name + ".npz"), **state(model))


def one_model(args):
    """The chief (task 0) or worker 1 of test_ps_one_model.py."""
    out = args.out
    _mark(out, f"imported{args.task}")
    _wait_for(out, "go")  # both workers connect at the same moment
    devices = kre.distribute.connect(args.ps.split(","), args.worker, args.task, timeout=300)
    if args.task == 0:
        with kre.distribute.parameter_servers(devices):
            m1, m2 = build("m1"), build("m2")
        _save(out, m2, "m2_initial")
        ids, x, y = m1_data()
        m1.fit([ids, x], y, batch_size=BATCH, shuffle=False, verbose=0)
        _save(out, m1, "m1_servers")
        ids, x, y = m2_data(0)
        callbacks = [
            keras.callbacks.ModelCheckpoint(os.path.join(out, "chief_checkpoint.keras"),
                                            save_freq=2),
            keras.callbacks.BackupAndRestore(os.path.join(out, "chief_backup"), save_freq=2),
            kre.callbacks.CheckpointCallback(os.path.join(out, "chief_kre"),
                                             full_every_steps=4, incremental_every_steps=1),
            # The chief goes on training once worker 1 has been killed.
            AfterBatch(1, lambda: _wait_for(out, "worker1_killed")),
        ]
        m2.fit([ids, x], y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
        with open(os.path.join(out, "placement.json"), "w") as f:
            json.dump({"m1": placement(m1), "m2": placement(m2)}, f)
        # While the restarted worker 1 trains.
        _wait_for(out, "worker1_restarted_training")
        m2.save(os.path.join(out, "during.keras"))
        kre.export_for_serving(m2, os.path.join(out, "during_served"))
        _mark(out, "chief_saved_during")
        _wait_for(out, "worker1_done")
        m2.save(os.path.join(out, "final.keras"))
        kre.export_for_serving(m2, os.path.join(out, "final_served"))
        _save(out, m2, "m2_servers")
    else:
        with kre.distribute.parameter_servers(devices):
            m2 = build("m2")
        ids, x, y = m2_data(1)
        first = args.skip * BATCH
        if args.skip == 0:  # paused after PAUSE_AFTER, then killed by the test
            pause = AfterBatch(PAUSE_AFTER, lambda: (_mark(out, "worker1_paused"),
                                                     time.sleep(600)))
            callbacks = [pause]
        else:  # the restarted worker trains the batches left
            callbacks = [AfterBatch(0, lambda: _mark(out, "worker1_restarted_training"))]
        m2.fit([ids[first:], x[first:]], y[first:], batch_size=BATCH, shuffle=False,
               verbose=0, callbacks=callbacks)
        _mark(out, "worker1_done")
    return 0


class OnTrainBegin(keras.callbacks.Callback):
    def __init__(self, action):
        super().__init__()
        self.action = action

    def on_train_begin(self, logs=None):
        self.action()


def ps_failure(args):
    """The chief of test_ps_failover.py: trains `m3` alone with
    BackupAndRestore and CheckpointCallback (both save after batch 3), then
    waits until the test kills PS task 1 and goes on: its next step fails."""
    out = args.out
    devices = kre.distribute.connect(args.ps.split(","), args.worker, 0, timeout=300)
    with kre.distribute.parameter_servers(devices):
        model = build("m3")
    ids, x, y = m3_data()

    def checkpointed():
        _save(out, model, "m3_checkpointed")
        _mark(out, "chief_checkpointed")
        _wait_for(out, "ps1_killed")
        print(f"SAW PS1 KILLED {time.time():.3f}", flush=True)

    callbacks = [
        keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=4),
        kre.callbacks.CheckpointCallback(os.path.join(out, "kre"), full_every_steps=100,
                                         incremental_every_steps=1),
        AfterBatch(3, checkpointed),
    ]
    try:
        model.fit([ids, x], y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=callbacks)
    except Exception as e:  # pylint: disable=broad-except
        print(f"FIT FAILED {time.time():.3f}: {type(e).__name__}: {e}", flush=True)
        return 3
    return 0


def restart(args):
    """The chief after the PS tasks restarted: restores the chain of
    CheckpointCallback inside the scope (before any other worker may
    start), then BackupAndRestore restores its backup as `fit` begins."""
    out = args.out
    devices = kre.distribute.connect(args.ps.split(","), args.worker, 0, timeout=300)
    with kre.distribute.parameter_servers(devices):
        model = build("m3")
        fresh = state(model)["predictions"]
        kre.callbacks.CheckpointCallback(os.path.join(out, "kre")).restore(model)
        _save(out, model, "m3_restored_chain")
    np.save(os.path.join(out, "m3_fresh_predictions.npy"), fresh)
    ids, x, y = m3_data()
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=4),
                 OnTrainBegin(lambda: _save(out, model, "m3_restored_backup"))]
    model.fit([ids, x], y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    _save(out, model, "m3_trained_after_restart")
    return 0


def main(argv):
    # A test that finds this process stuck sends SIGUSR1 before it kills
    # it: every thread's Python stack goes to the log the test reports.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["one_model", "ps_failure", "restart"])
    p.add_argument("--ps", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--task", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--skip", type=int, default=0, help="batches already trained")
    args = p.parse_args(argv)
    return {"one_model": one_model, "ps_failure": ps_failure, "restart": restart}[
        args.role](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
