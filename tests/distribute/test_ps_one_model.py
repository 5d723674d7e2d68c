"""One model on the parameter servers: 2 PS tasks and 2 workers on
127.0.0.1 (real `tf.distribute.Server` processes, TensorFlow's gRPC
runtime), run once for the module (tests/distribute/ps_model_worker.py):

1. both workers connect at the same moment to the fresh PS tasks;
2. the chief (worker 0) trains `m1` alone (SGD with momentum), then both
   train `m2` (plain SGD, a loss linear in the output) on their own data,
   the chief with ModelCheckpoint, BackupAndRestore and CheckpointCallback;
3. worker 1 is killed with SIGKILL after 3 batches while the chief trains,
   and restarted for the batches it had left;
4. the chief saves `m2` (.keras and export_for_serving) while worker 1
   trains, and again once it is done, with the servers' state.
"""

import json
import os
import signal
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import variables as tf_variables

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ps_model_worker as w  # noqa: E402
from ps_cluster import two_ps_tasks  # noqa: E402

pytestmark = pytest.mark.multiprocess

TIMEOUT = 420  # seconds for the whole run (processes start slowly on a loaded machine)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ps_one_model"))
    with two_ps_tasks(out, TIMEOUT, workers=3) as (cluster, ps, workers):
        def worker(name, task, address, *extra):
            return cluster.worker(name, "one_model", ps, task, address, *extra)

        worker("chief", 0, workers[0])
        worker("worker1", 1, workers[1])
        everyone = ("ps0", "ps1", "chief", "worker1")
        cluster.wait_until(
            lambda: all(cluster.exists(f"imported{t}") for t in (0, 1))
            and all("serving" in cluster.log(f"ps{t}") for t in (0, 1)),
            "the PS tasks to serve and the workers to import", everyone)
        w._mark(out, "go")  # both connect now
        cluster.wait_until(lambda: cluster.exists("worker1_paused"), "worker 1's pause",
                           everyone)
        cluster.procs["worker1"].send_signal(signal.SIGKILL)
        killed = cluster.procs["worker1"].wait(timeout=60)
        w._mark(out, "worker1_killed")
        worker("worker1_restarted", 1, workers[2], "--skip", str(w.PAUSE_AFTER + 1))
        cluster.wait_until(lambda: cluster.procs["chief"].poll() is not None
                           and cluster.procs["worker1_restarted"].poll() is not None,
                           "the workers to finish", ("ps0", "ps1"))
        codes = {name: proc.poll() for name, proc in cluster.procs.items()}
        report = cluster.report()
    assert codes["chief"] == 0 and codes["worker1_restarted"] == 0, report
    return {"out": out, "codes": codes, "killed": killed, "report": report}


def _load(run, name):
    return dict(np.load(os.path.join(run["out"], name + ".npz")))


def _rows(state):
    """The table's keys, values and counts, in key order."""
    order = np.argsort(state["table/keys"])
    return {k: state[f"table/{k}"][order] for k in ("keys", "values", "freqs")}


def test_workers_connecting_at_the_same_moment_and_a_killed_worker_leave_the_servers_up(run):
    # Both workers connected at once to fresh PS tasks (no order), and a
    # worker killed with SIGKILL did not stop the others: the PS tasks
    # served to the end and the chief finished its training.
    assert run["killed"] == -signal.SIGKILL
    assert run["codes"]["ps0"] is None and run["codes"]["ps1"] is None, run["report"]
    assert run["codes"]["chief"] == 0


def test_dense_variables_and_slots_live_on_the_parameter_servers(run):
    with open(os.path.join(run["out"], "placement.json")) as f:
        placement = json.load(f)
    devices = placement["m1"]
    assert devices, placement
    for path, device in devices.items():
        assert device.startswith("/job:ps/replica:0/task:"), (path, device)
    # Spread over both tasks; each momentum slot beside its variable.
    assert {d for d in devices.values()} == {f"/job:ps/replica:0/task:{t}/device:CPU:0"
                                             for t in (0, 1)}
    for path, device in devices.items():
        if path.endswith("_momentum"):
            owner = path.split("/", 1)[1][:-len("_momentum")]
            layer, _, weight = owner.rpartition("_")
            assert devices[f"{layer}/{weight}"] == device, path


def test_one_worker_equals_one_process(run):
    got = _load(run, "m1_servers")
    model = w.build("m1")
    ids, x, y = w.m1_data()
    model.fit([ids, x], y, batch_size=w.BATCH, shuffle=False, verbose=0)
    want = w.state(model)
    dense = [k for k in want if k.startswith(("dense/", "opt/"))]
    assert any("momentum" in k for k in dense) and any("m1_top" in k for k in dense)
    for k in dense:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    g, r = _rows(got), _rows(want)
    np.testing.assert_array_equal(g["keys"], r["keys"])
    np.testing.assert_allclose(g["values"], r["values"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(g["freqs"], r["freqs"])
    np.testing.assert_allclose(got["slot/momentum"][np.argsort(got["table/keys"])],
                               want["slot/momentum"][np.argsort(want["table/keys"])],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["predictions"], want["predictions"], rtol=1e-5, atol=1e-5)


def _expected_m2(initial):
    """Initial weights minus LR x the sum of both workers' gradients over
    every batch (worker 1's from before and after its restart)."""
    kernel = initial["dense/m2_dense/kernel"].astype(np.float64)
    bias = initial["dense/m2_dense/bias"].astype(np.float64)
    pushes, counts = {}, {}
    for task in (0, 1):
        ids, x, y = w.m2_data(task)
        for start in range(0, len(ids), w.BATCH):
            b = slice(start, start + w.BATCH)
            scale = y[b, 0].astype(np.float64) / w.BATCH  # d loss / d prediction
            kernel -= w.LR * (x[b].astype(np.float64) * scale[:, None]).sum(0)[:, None]
            bias -= w.LR * scale.sum()
            for row, s in zip(ids[b], scale):
                for key in row:
                    pushes[int(key)] = pushes.get(int(key), 0.0) + s
                    counts[int(key)] = counts.get(int(key), 0) + 1
    keys = np.array(sorted(pushes), np.int64)
    default = initial["table/default_values"]
    values = default[keys % default.shape[0]] - w.LR * np.array([pushes[k] for k in keys])[:, None]
    return keys, values, np.array([counts[k] for k in keys]), kernel, bias


def test_two_workers_sum_of_pushes_reaches_tables_and_dense_weights(run):
    keys, values, counts, kernel, bias = _expected_m2(_load(run, "m2_initial"))
    got = _load(run, "m2_servers")
    rows = _rows(got)
    np.testing.assert_array_equal(rows["keys"], keys)
    np.testing.assert_allclose(rows["values"], values, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(rows["freqs"], counts)
    np.testing.assert_allclose(got["dense/m2_dense/kernel"], kernel, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["dense/m2_dense/bias"], bias, rtol=1e-5, atol=1e-5)
    # The shared step counter counted every worker's steps.
    assert int(got["opt/m2_sgd/iteration"]) == 2 * w.M2_STEPS


def test_chief_saves_what_the_servers_hold(run):
    got = _load(run, "m2_servers")
    model = keras.saving.load_model(os.path.join(run["out"], "final.keras"))
    table = model.get_layer("m2_emb").table
    assert isinstance(table, tf_variables.EmbeddingTable)  # one process, one table
    np.testing.assert_allclose(model.predict(w.probe(), verbose=0), got["predictions"],
                               rtol=1e-5, atol=1e-5)
    loaded = w.state(model)
    for k in ("dense/m2_dense/kernel", "dense/m2_dense/bias"):
        np.testing.assert_allclose(loaded[k], got[k], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_rows(loaded)["values"], _rows(got)["values"], rtol=1e-6)
    served = tf.saved_model.load(os.path.join(run["out"], "final_served"))
    ids, x = w.probe()
    out = served.serve([tf.constant(ids), tf.constant(x)])
    np.testing.assert_allclose(out.numpy(), got["predictions"], rtol=1e-5, atol=1e-5)


def test_chief_saves_while_another_worker_trains(run):
    """Saved while worker 1 trained: a model that loads and predicts, with
    rows of the keys the servers held by then (a subset of the final ones)."""
    final = _rows(_load(run, "m2_servers"))["keys"]
    model = keras.saving.load_model(os.path.join(run["out"], "during.keras"))
    keys = model.get_layer("m2_emb").table.export()["keys"]
    assert len(keys) and set(keys.tolist()) <= set(final.tolist())
    assert np.isfinite(model.predict(w.probe(), verbose=0)).all()
    served = tf.saved_model.load(os.path.join(run["out"], "during_served"))
    ids, x = w.probe()
    assert np.isfinite(served.serve([tf.constant(ids), tf.constant(x)]).numpy()).all()


def test_keras_and_our_checkpoint_callbacks_work_on_the_chief(run):
    out = run["out"]
    # ModelCheckpoint wrote a .keras file of the shared model.
    saved = keras.saving.load_model(os.path.join(out, "chief_checkpoint.keras"))
    assert saved.get_layer("m2_emb").table.size() > 0
    # BackupAndRestore removed its backup at the end of a finished fit.
    assert not os.path.exists(os.path.join(out, "chief_backup", "latest.weights.h5"))
    # CheckpointCallback's chain (each table shard's own rows) restores
    # into a model with as many shards, here in this process.
    with kre.distribute.parameter_servers(["/cpu:0", "/cpu:0"]):
        model = w.build("m2")
    stats = kre.callbacks.CheckpointCallback(os.path.join(out, "chief_kre")).restore(model)
    assert stats["links"] and model.get_layer("m2_emb").table.size() > 0, stats
    # The shared model's trained dense weights, not their initial values.
    kernel = keras.ops.convert_to_numpy(model.get_layer("m2_dense").kernel)
    assert np.abs(kernel - _load(run, "m2_initial")["dense/m2_dense/kernel"]).max() > 1e-3
    assert np.isfinite(model.predict(w.probe(), verbose=0)).all()
