"""Synchronous tables sharded over MirroredStrategy replicas (logical CPU
devices): same numbers as one process with the same global batch; the
saved model restores into another shard count."""

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
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
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
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
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
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, keras_rec_emb as kre
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    ids = keras.Input((3,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(
        kre.layers.EmbeddingVariable(4, combiner="sum")(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse", steps_per_execution=2)
try:
    model.fit(np.arange(48).reshape(16, 3), np.ones((16, 1)), batch_size=4, verbose=0)
    print("NOT REFUSED")
except ValueError as e:
    print("REFUSED " + str(e))
"""


def test_steps_per_execution_over_replica_shards_is_refused_by_name():
    """Keras's loop of several steps an execution cannot run the shards'
    collectives (a feed error deep in TensorFlow); `fit` says so first."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _STEPS_PER_EXECUTION], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED `steps_per_execution` must be 1" in proc.stdout, proc.stdout[-2000:]
    assert "Received: steps_per_execution=2" in proc.stdout
