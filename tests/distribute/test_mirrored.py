"""Synchronous tables sharded over MirroredStrategy replicas (logical CPU
devices): same numbers as one process with the same global batch; the
saved model restores into another shard count."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_rec_emb as kre

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def emb_table(model):
    names = [layer.name for layer in model.layers]
    layer = model.get_layer("emb") if "emb" in names else model.get_layer("group").tables[0]
    return layer.table


def run_mirrored(tmp_path, replicas, optimizer, group=False):
    out = tmp_path / f"mirrored_{replicas}_{optimizer}.npz"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "mirrored_run.py"), str(replicas), optimizer,
         str(out)] + (["group"] if group else []), capture_output=True, text=True, env=env,
        cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return np.load(out)


@pytest.mark.parametrize("replicas, optimizer, group",
                         [(2, "sgd", False), (2, "adagrad", False), (3, "adagrad", True)])
def test_replicas_match_one_process(tmp_path, replicas, optimizer, group):
    """(With `group`, the table is read through a GroupEmbedding.)"""
    got = run_mirrored(tmp_path, replicas, optimizer, group)
    keys = [k[len("one_"):] for k in got.files if k.startswith("one_")]
    assert {"keys", "values", "freqs", "kernel", "bias", "predict"} <= set(keys)
    if optimizer == "adagrad":
        assert "slot_accumulator" in keys
    for key in keys:
        np.testing.assert_allclose(got[f"many_{key}"], got[f"one_{key}"], rtol=1e-5,
                                   atol=1e-5, err_msg=key)
    # Training moved the dense weights (same init in both runs) and the rows.
    init_kernel = np.random.default_rng(1).normal(size=(4, 1)).astype(np.float32)
    assert np.abs(got["one_kernel"] - init_kernel).max() > 1e-3
    # Every replica owns a shard, and each shard holds exactly its keys.
    from keras_rec_emb.distribute import ps_tables

    np.testing.assert_array_equal(
        np.bincount(ps_tables.shard_of_numpy(got["one_keys"], replicas),
                    minlength=replicas), got["shard_sizes"])
    assert [d.rsplit(":", 1)[1] for d in got["shard_devices"]] == [
        str(i) for i in range(replicas)]

    # The model saved under the strategy restores into one process (N -> 1)
    # and into another shard count (N -> N + 1).
    path = tmp_path / f"mirrored_{replicas}_{optimizer}.keras"
    for devices in (None, ["/cpu:0"] * (replicas + 1)):
        if devices is None:
            model = keras.saving.load_model(path)
        else:
            with kre.distribute.parameter_servers(devices):
                model = keras.saving.load_model(path)
            assert emb_table(model).num_shards == replicas + 1
        data = emb_table(model).export()
        order = np.argsort(data["keys"])
        np.testing.assert_array_equal(data["keys"][order], got["one_keys"])
        np.testing.assert_allclose(data["values"][order], got["many_values"], rtol=1e-6)
        ids = got["one_keys"][:6].reshape(2, 3)
        np.testing.assert_allclose(model.predict(got["predict_ids"], verbose=0),
                                   got["many_predict"], rtol=1e-5, atol=1e-5)
        rows = got["many_values"][:6].reshape(2, 3, -1).mean(axis=1)
        np.testing.assert_allclose(
            model.predict(ids, verbose=0), rows @ got["many_kernel"] + got["many_bias"],
            rtol=1e-5, atol=1e-5)


def _resume_run(folder, mode, wait=True):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    log = open(folder / f"{mode}.log", "w")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "mirrored_resume.py"), "2",
                             mode, str(folder)], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)
    if wait:
        try:
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        assert rc == 0, (folder / f"{mode}.log").read_text()[-3000:]
    return proc


def test_killed_synchronous_worker_resumes_from_its_checkpoint(tmp_path):
    """A MirroredStrategy trainer killed (SIGKILL, by pid) one step past its
    last checkpoint and restarted from it ends with the same rows, slots,
    counts and dense weights as a run never interrupted: no row is lost."""
    import time

    _resume_run(tmp_path, "full")
    proc = _resume_run(tmp_path, "crash", wait=False)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, (tmp_path / "crash.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer never reached the crash point"
            time.sleep(0.2)
    finally:
        proc.kill()  # by its pid, mid-training
        proc.wait(timeout=30)
    assert proc.returncode != 0
    assert (tmp_path / "ready").read_text() == "4"  # it had trained a 4th step ...
    _resume_run(tmp_path, "resume")  # ... lost with it: resumes at step 3
    assert "resumed at step 3" in (tmp_path / "resume.log").read_text()
    full = np.load(tmp_path / "final_full.npz")
    resumed = np.load(tmp_path / "final_resume.npz")
    assert int(resumed["iterations"]) == int(full["iterations"]) == 6
    np.testing.assert_array_equal(resumed["keys"], full["keys"])
    assert len(full["keys"]) > 30  # ids of every step, also those after the crash
    np.testing.assert_array_equal(resumed["freqs"], full["freqs"])
    for part in ("values", "accumulator", "kernel"):
        np.testing.assert_allclose(resumed[part], full[part], rtol=1e-6, atol=1e-6,
                                   err_msg=part)


_STEPS_PER_EXECUTION = """
import json, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, keras_rec_emb as kre
sys.path.insert(0, "tests/distribute")
from _models import table_arrays
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
x, y = rng.integers(0, 30, (20, 3)), rng.normal(size=(20, 1)).astype("float32")
out = {}
for tables in (True, False):
    for steps in (1, 5, 9) if tables else (1, 5):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            ids = keras.Input((3,), dtype="int64")
            if tables:
                emb = kre.layers.EmbeddingVariable(
                    4, combiner="sum", name="emb",
                    initializer=keras.initializers.RandomUniform(-1, 1, seed=3))(ids)
                group = kre.layers.GroupEmbedding(
                    {f"f{j}": kre.layers.FeatureSpec(0, combiner="mean") for j in range(3)},
                    tables=[kre.layers.EmbeddingVariable(
                        4, name="group_0",
                        initializer=keras.initializers.RandomUniform(-1, 1, seed=5))],
                    output_mode="concat", name="group")(ids)
                joined = keras.layers.Concatenate()([emb, group])
            else:  # Keras alone: its loop of steps fails under the strategy too
                joined = keras.ops.cast(ids, "float32")
            model = keras.Model(ids, keras.layers.Dense(1, name="dense")(joined))
            model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse",
                          steps_per_execution=steps)
        # 5 steps an epoch. 5 an execution: functions of
        # 4 and 1 written-out steps; the data runs out at the end of the
        # second, the next execution finds none. 9: functions of 4, 4 and 1;
        # the second runs one step, the third finds no data.
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        got = {"loss": history.history["loss"],
               "iterations": int(model.optimizer.iterations.numpy()),
               "evaluate": model.evaluate(x, y, batch_size=4, verbose=0),
               "kernel": model.get_layer("dense").get_weights()[0].tolist()}
        if tables:
            for name, table in (("emb", model.get_layer("emb").table),
                                ("group", model.get_layer("group").tables[0].table)):
                got.update({f"{name}_{k}": v.tolist() for k, v in table_arrays(table).items()})
        out[f"{'tables' if tables else 'dense'}_{steps}"] = got
        if steps > 1:
            out[f"{'tables' if tables else 'dense'}_{steps}_plan"] = [
                f._kre_steps for f in model.train_function._kre_step_functions]
# One replica (Keras's own loop: no collective), and the loss-scaling
# wrapper over 2 replicas: the losses of one replica, one step a call,
# unwrapped (the shards train as one table with the global batch).
def small_fit(strategy, wrap, steps):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        optimizer = kre.optimizers.Adagrad(0.1)
        if wrap:
            optimizer = kre.optimizers.LossScaleOptimizer(optimizer)
        ids = keras.Input((3,), dtype="int64")
        model = keras.Model(ids, keras.layers.Dense(1)(kre.layers.EmbeddingVariable(
            4, combiner="sum", initializer=keras.initializers.RandomUniform(-1, 1, seed=3))(ids)))
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps)
    return model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]


# (One MirroredStrategy over the same devices a process: each numbers its
# collectives from the same keys.)
one = tf.distribute.MirroredStrategy(["/cpu:0"])
out["reference"] = small_fit(one, False, 1)
out["one_replica"] = small_fit(one, False, 3)
out["loss_scale"] = small_fit(strategy, True, 3)
# `jit_compile=True` keeps Keras's own loop (the written-out steps have no XLA).
with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse", steps_per_execution=2, jit_compile=True)
model.make_train_function()
out["jit_written_out"] = hasattr(model.train_function, "_kre_step_functions")
print("RESULT " + json.dumps(out))
"""


def test_several_steps_an_execution_over_replica_shards_train_as_one_step_a_call():
    """Keras's loop of several steps an execution fails under a
    MirroredStrategy of several replicas for any model (a collective's
    instance key inside its while loop, keras-team/keras#19246): the steps
    are written out (`_compat`), and the shards gather the replicas'
    gradients without a collective. 5 and 9 steps an execution give the
    tables, slots, dense weights, losses and evaluation of one step a call,
    with and without tables."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _STEPS_PER_EXECUTION], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[0][len("RESULT "):])
    for kind in ("tables", "dense"):
        want = out[f"{kind}_1"]
        assert want["iterations"] == 10
        if kind == "tables":
            assert len(want["emb_keys"]) > 15 and "emb_slot_accumulator" in want
        for steps in (5, 9) if kind == "tables" else (5,):
            got = out[f"{kind}_{steps}"]
            assert out[f"{kind}_{steps}_plan"] == {5: [4, 1], 9: [4, 4, 1]}[steps]
            assert set(got) == set(want)
            for key in want:
                np.testing.assert_allclose(np.asarray(got[key], np.float64),
                                           np.asarray(want[key], np.float64), rtol=1e-6,
                                           atol=1e-6, err_msg=f"{kind}, {steps} steps: {key}")
    for name in ("one_replica", "loss_scale"):
        np.testing.assert_allclose(out[name], out["reference"], rtol=1e-5, err_msg=name)
    assert out["jit_written_out"] is False
