"""A synchronous (MirroredStrategy, N logical CPU devices) trainer that
checkpoints after every step, for test_mirrored.py's kill-and-resume test.

    mirrored_resume.py N MODE DIR

MODE `full`: trains STEPS steps, writes DIR/final_full.npz.
MODE `crash`: trains, checkpointing after each step, until step CRASH_AT;
    then trains one more step without checkpointing, writes DIR/ready and
    waits to be killed (the test kills it by pid).
MODE `resume`: restores DIR's latest checkpoint (tables, dense weights,
    optimizer slots and step), trains the remaining steps, writes
    DIR/final_resume.npz.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

N = int(sys.argv[1])
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * N)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_rec_emb as kre  # noqa: E402

DIM, BATCH, STEPS, IDS, CRASH_AT = 4, 8 * N, 6, 3, 3


def data():
    rng = np.random.default_rng(9)
    # Later steps bring new ids: rows first inserted after the crash point.
    ids = np.concatenate([rng.integers(s * 10, s * 10 + 30, size=(BATCH, IDS))
                          for s in range(STEPS)]).astype(np.int64)
    y = rng.uniform(size=(BATCH * STEPS, 1)).astype(np.float32)
    return ids, y


def build():
    ids = keras.Input(shape=(IDS,), dtype="int64")
    emb = kre.layers.EmbeddingVariable(
        DIM, combiner="mean", name="emb",
        initializer=keras.initializers.RandomUniform(-1, 1, seed=7),
        ev_option=kre.EmbeddingVariableOption(track_meta=True))(ids)
    out = keras.layers.Dense(1, name="dense",
                             kernel_initializer=keras.initializers.GlorotUniform(seed=3))(emb)
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def step(model, ids, y, i):
    rows = slice(i * BATCH, (i + 1) * BATCH)
    model.fit(ids[rows], y[rows], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def dump(model, path):
    exported = model.get_layer("emb").table.export()
    order = np.argsort(exported["keys"])
    out = {"keys": exported["keys"][order], "values": exported["values"][order],
           "freqs": exported["freqs"][order],
           "accumulator": exported["slots"]["accumulator"][order],
           "kernel": model.get_layer("dense").get_weights()[0],
           "iterations": np.array(int(model.optimizer.iterations.numpy()))}
    np.savez(path, **out)


def main():
    mode, folder = sys.argv[2], sys.argv[3]
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(N)])
    with strategy.scope():
        model = build()
        model.optimizer.build(model.trainable_variables)
    ids, y = data()
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, os.path.join(folder, "ckpt"), max_to_keep=2)
    start = 0
    if mode == "resume":
        ckpt.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        start = int(model.optimizer.iterations.numpy())
        print(f"resumed at step {start}", flush=True)
    for i in range(start, STEPS):
        step(model, ids, y, i)
        if mode == "crash" and i + 1 == CRASH_AT + 1:
            # One step past the last checkpoint: its updates are lost with
            # the process and redone after the restart.
            with open(os.path.join(folder, "ready"), "w") as f:
                f.write(str(int(model.optimizer.iterations.numpy())))
            time.sleep(600)  # killed by the test before this ends
            sys.exit(3)
        if mode != "full":
            manager.save(checkpoint_number=i + 1)
    dump(model, os.path.join(folder, f"final_{mode}.npz"))


if __name__ == "__main__":
    main()
