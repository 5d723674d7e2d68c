"""One worker of a 2-worker MultiWorkerMirroredStrategy cluster that trains
with `keras.callbacks.BackupAndRestore` (TF_CONFIG set by
test_mwms_lost_worker.py). Writes OUT/w{task}_*.

    mwms_lost_worker.py OUT run       # fit EPOCHS epochs; worker 1 writes
                                      # OUT/w1_at_kill when epoch KILL_EPOCH
                                      # begins and waits there to be killed
    mwms_lost_worker.py OUT resume    # fit again from the backups: what the
                                      # restarted cluster trains

Each worker backs up into its own folder (OUT/backup_w{task}), as on
machines with their own disks. The one-process reference imports `build`,
`data` and `EPOCHS` from here.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import counted_table, table_arrays

DIM, BATCH, STEPS, IDS, EPOCHS, KILL_EPOCH = 4, 12, 3, 3, 4, 2


def data():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 150, size=(BATCH * STEPS, IDS)).astype(np.int64)
    y = rng.uniform(size=(BATCH * STEPS, 1)).astype(np.float32)
    return ids, y


def build():
    """Adagrad (a slot per row), a CounterFilter (counts of keys not yet
    admitted) and frequencies: what a restart must neither lose nor double."""
    ids = keras.Input(shape=(IDS,), dtype="int64")
    emb = counted_table(DIM, "sum", filter_freq=6)(ids)
    dense = keras.layers.Dense(
        1, name="dense", kernel_initializer=keras.initializers.GlorotUniform(seed=2))(emb)
    model = keras.Model(ids, dense)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def arrays(model):
    out = table_arrays(model.get_layer("emb").table)
    out["kernel"], out["bias"] = [np.asarray(w) for w in model.get_layer("dense").get_weights()]
    out["iterations"] = np.int64(model.optimizer.iterations.numpy())
    return out


class WaitToBeKilled(keras.callbacks.Callback):
    """On worker 1, at the start of epoch KILL_EPOCH: say so and wait."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == KILL_EPOCH:
            with open(os.path.join(self.folder, "w1_at_kill"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)


def main():
    folder, mode = sys.argv[1], sys.argv[2]
    if mode == "run":  # the lost worker's peer fails after LOST_TIMEOUT s
        strategy = kre.distribute.multi_worker_strategy(
            lost_worker_timeout=float(os.environ["LOST_TIMEOUT"]))
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = build()
    ids, y = data()
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(folder, f"backup_w{task}"))]
    if mode == "run" and task == 1:
        callbacks.append(WaitToBeKilled(folder))
    started = time.monotonic()
    try:
        model.fit(ids, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks)
    except Exception as e:  # the lost peer's error, for the test to read
        with open(os.path.join(folder, f"w{task}_{mode}_error.txt"), "w") as f:
            f.write(f"{type(e).__name__} after {time.monotonic() - started:.1f}s: {e}")
        raise
    np.savez(os.path.join(folder, f"w{task}_{mode}.npz"), **arrays(model))


if __name__ == "__main__":
    main()
