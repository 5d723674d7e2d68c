"""Tables sharded over MultiWorkerMirroredStrategy worker processes (2 and 3
workers on 127.0.0.1, TF_CONFIG, free ports, bounded in time, stopped by
pid): same numbers as one process with the global batch; the saved model
restores into another worker count and into one process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _net import free_ports  # noqa: E402

pytestmark = pytest.mark.multiprocess


def run_cluster(folder, workers, *args, timeout=480):
    """Runs mwms_run.py on `workers` worker processes; every process is
    stopped by its pid if it has not ended in `timeout` seconds."""
    addresses = [f"127.0.0.1:{p}" for p in free_ports(workers)]
    procs = []
    try:
        for task in range(workers):
            config = {"cluster": {"worker": addresses},
                      "task": {"type": "worker", "index": task}}
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
                       PYTHONFAULTHANDLER="1", TF_CONFIG=json.dumps(config))
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
            log = open(folder / f"w{task}_{args[0]}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "mwms_run.py"), str(folder), *args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        for task, proc in enumerate(procs):
            rc = proc.wait(timeout=timeout)
            log = (folder / f"w{task}_{args[0]}.log").read_text()
            assert rc == 0, f"worker {task} exited {rc}: " + log[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # by its pid
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mwms2")
    run_cluster(folder, 2, "train")
    return folder


def runner():
    """mwms_run (the workers' script), for the one-process references."""
    sys.path.insert(0, HERE)
    try:
        import mwms_run
    finally:
        sys.path.remove(HERE)
    return mwms_run


def assert_same(got, want, what, keys=None):
    for key in (want if keys is None else keys):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5,
                                   err_msg=f"{what}: {key}")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_two_workers_fit_evaluate_predict_match_one_process(two_workers, optimizer):
    """`model.fit` / `evaluate` / `predict` as written for one process, on 2
    workers with global batch B: the same rows, slots, filtered keys,
    dense weights, loss, evaluation loss and predictions (in input order)
    as one process with batch B; eviction during fit removes the same keys."""
    mwms_run = runner()
    infer = optimizer == "adagrad"  # evaluate / predict with one optimizer: seconds each
    one = mwms_run.fit(mwms_run.build(optimizer), infer=infer)
    assert {"keys", "values", "freqs", "kernel", "bias", "loss", "evicted",
            "group0_keys"} <= set(one)
    ids, y = mwms_run.data()
    # Adagrad's and Adam's slots are compared too (SGD has none).
    assert any(k.startswith("slot_") for k in one) == (optimizer != "sgd"), sorted(one)
    if infer:
        assert "slot_accumulator" in one and "group0_slot_accumulator" in one
        assert one["predict"].shape == (len(ids), 1)
        np.testing.assert_allclose(one["evaluate"], np.mean((one["predict"] - y) ** 2),
                                   rtol=1e-5)
    for task in (0, 1):
        got = np.load(two_workers / f"w{task}_{optimizer}.npz")
        assert int(got["num_shards"]) == 2 and int(got["index"]) == task
        assert_same(got, one, f"worker {task}")
    # Training moved the dense weights and rows; the filter held some keys
    # back; the evaluation is the loss of the trained model on the data.
    assert np.abs(one["kernel"] - mwms_run.dense_init()[0]).max() > 1e-3
    assert len(one["group0_keys"]) > 5  # the GroupEmbedding's tables trained too
    assert len(one["keys_filtered"]) > 0 and len(one["keys"]) > 10
    # Eviction (steps_to_live=1, after every step): keys went, and those
    # left were all looked up in the last two steps.
    assert one["evicted"] > 0
    recent = ids[-(mwms_run.STEPS_TO_LIVE + 1) * mwms_run.BATCH:]
    assert set(one["group0_keys"]) <= set(recent.ravel()) < set(ids.ravel())
    shards = [np.load(two_workers / f"w{task}_{optimizer}.npz")["group0_shard_keys"]
              for task in (0, 1)]
    assert len(shards[0]) > 0 and len(shards[1]) > 0
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), one["group0_keys"])
    # Per-shard statistics add up to the table's (and to one process's).
    stats = [np.load(two_workers / f"w{task}_{optimizer}.npz")["local_stats"]
             for task in (0, 1)]
    assert all(s[0] > 0 for s in stats)  # both workers own keys
    total = np.load(two_workers / f"w0_{optimizer}.npz")["stats"]
    np.testing.assert_array_equal(stats[0] + stats[1], total)
    np.testing.assert_array_equal(total, [len(one["keys"]), len(one["keys_filtered"])])


def test_one_worker_fit_evaluate_predict_match_one_process(tmp_path):
    """One worker holds every row in its only shard: its lookups read that
    shard with the fused kernels, nothing exchanged. `fit` / `evaluate` /
    `predict` give what one process gives, for SGD, Adam and Adagrad."""
    run_cluster(tmp_path, 1, "train")
    mwms_run = runner()
    for optimizer in ("sgd", "adam", "adagrad"):
        infer = optimizer == "adagrad"
        one = mwms_run.fit(mwms_run.build(optimizer), infer=infer)
        got = np.load(tmp_path / f"w0_{optimizer}.npz")
        assert int(got["num_shards"]) == 1
        assert_same(got, one, f"one worker, {optimizer}")
        assert ("predict" in got.files) == infer and one["evicted"] > 0
        np.testing.assert_array_equal(got["stats"], [len(one["keys"]), len(one["keys_filtered"])])


def test_two_workers_fit_several_epochs_as_one_process(tmp_path):
    """Each epoch's distributed iterator is new: after Keras's first call on
    it, the train function is called directly on it (no per-step
    tf.function dispatch); 3 epochs give what one process gives. Then
    several steps an execution, and `train_on_batch` / `test_on_batch` /
    `predict_on_batch` in a hand-written loop."""
    run_cluster(tmp_path, 2, "epochs")
    mwms_run = runner()
    one = mwms_run.fit(mwms_run.build("adam"), infer=False, epochs=3)
    for task in (0, 1):
        got = np.load(tmp_path / f"w{task}_epochs.npz")
        assert int(got["direct_calls"]) == 1
        assert_same(got, one, f"worker {task}", keys=[k for k in one if k != "evicted"])
        assert int(got["evicted"]) == int(one["evicted"]) > 0
    # steps_per_execution=5: Keras's loop of steps fails under the strategy
    # (a collective's call-time instance key inside its while loop);
    # `_compat` writes the steps out, at most UNROLLED_STEPS_MAX (2 in the
    # workers) a traced function, called one after another. Compared with
    # one step a call in one process.
    # With metrics: the logs (loss, mae, mse) as one process logs them, and
    # each step's logs in one all-reduce beside the dense gradients' one
    # (Keras's own reduction: one a log, 4 a step), plus the iterator's
    # agreement on whether a batch is left, once a step.
    one = mwms_run.fit(mwms_run.build("adagrad", metrics=["mae", "mse"]), epochs=2,
                       evict_during_fit=False)
    assert {"log_loss", "log_mae", "log_mse"} <= set(one)
    for task in (0, 1):
        got = np.load(tmp_path / f"w{task}_steps_per_execution.npz")
        assert_same(got, one, f"worker {task}, steps_per_execution=5")
        assert int(got["evicted"]) == int(one["evicted"])
        np.testing.assert_array_equal(got["steps_a_call"], [2, 2, 1])
        np.testing.assert_array_equal(got["all_reduces"], [2 * 2 + 2, 2 * 2 + 2, 2 + 1])

    # A hand-written loop: each worker calls `train_on_batch` on its part of
    # every global batch: one process's fit with the global batches; each
    # step's loss, `test_on_batch` (averaged over the workers) and
    # `predict_on_batch` as one process gives.
    model = mwms_run.build("adagrad")
    model.get_layer("dense").set_weights(mwms_run.dense_init())
    ids, y = mwms_run.data()
    batches = [slice(step * mwms_run.BATCH, (step + 1) * mwms_run.BATCH)
               for step in range(mwms_run.STEPS)]
    losses = [model.train_on_batch(ids[b], y[b]) for b in batches]
    one = mwms_run.model_arrays(model)
    first = batches[0]
    evaluation = model.test_on_batch(ids[first], y[first])
    predictions = model.predict_on_batch(ids[first])
    for task in (0, 1):
        got = np.load(tmp_path / f"w{task}_on_batch.npz")
        assert_same(got, one, f"worker {task}, train_on_batch")
        np.testing.assert_allclose(got["train_on_batch"], losses, rtol=1e-5,
                                   err_msg=f"worker {task}: train_on_batch losses")
        np.testing.assert_allclose(got["test_on_batch"], evaluation, rtol=1e-5)
        # (Keras concatenates the replicas' predictions: every worker gets
        # the global batch's, in worker order.)
        np.testing.assert_allclose(got["predict_on_batch"], predictions, rtol=1e-5, atol=1e-6)


def test_two_worker_export_for_serving_serves_the_one_process_predictions(two_workers):
    """Every worker exported (collective); each SavedModel, loaded with stock
    TensorFlow, predicts what the one-process model does."""
    import tensorflow as tf

    mwms_run = runner()
    one = mwms_run.build("adagrad")
    mwms_run.fit(one)
    ids = mwms_run.data(seed=9)[0]  # unseen ids too: served from the initializer
    want = one.predict(ids, verbose=0)
    for task in (0, 1):
        served = tf.saved_model.load(str(two_workers / f"serving_w{task}"))
        np.testing.assert_allclose(served.serve(tf.constant(ids)).numpy(), want, rtol=1e-5,
                                   atol=1e-5, err_msg=f"worker {task}")


def test_lookup_outside_the_replica_function_is_refused_by_name(two_workers):
    message = str(np.load(two_workers / "w1_refused.npz")["message"])
    assert "'emb/embeddings' is sharded over the 2 workers" in message
    assert "strategy.run" in message


def test_two_worker_checkpoint_restores_into_three_workers_and_one_process(two_workers,
                                                                          tmp_path):
    """Reshard on restore: a tf.train.Checkpoint and a .keras file written by
    2 workers restore into 3 workers and into one process; `fit` on the 3
    workers then goes on as in one process."""
    import keras
    import tensorflow as tf

    trained = np.load(two_workers / "w0_adagrad.npz")
    run_cluster(tmp_path, 3, "restore", str(two_workers))
    sizes = []
    for task in range(3):
        got = np.load(tmp_path / f"w{task}_restore.npz")
        assert int(got["num_shards"]) == 3
        sizes.append(int(got["ckpt_local_size"]))
        for source in ("ckpt", "keras"):
            for key in ("keys", "values", "freqs", "slot_accumulator", "keys_filtered"):
                np.testing.assert_array_equal(got[f"{source}_{key}"], trained[key],
                                              err_msg=f"worker {task}: {source} {key}")
        np.testing.assert_allclose(got["keras_predict"], trained["predict"][:len(
            got["keras_predict"])], rtol=1e-5, atol=1e-5)
    assert sum(sizes) == len(trained["keys"]) and min(sizes) > 0

    mwms_run = runner()
    model = mwms_run.build("adagrad")
    status = tf.train.Checkpoint(model=model).read(str(two_workers / "ckpt_w0" / "ckpt"))
    status.assert_existing_objects_matched().expect_partial()
    loaded = keras.saving.load_model(two_workers / "w0.keras")
    for restored in (model, loaded):
        got = mwms_run.table_arrays(restored.get_layer("emb").table)
        for key in ("keys", "values", "freqs", "slot_accumulator", "keys_filtered"):
            np.testing.assert_array_equal(got[key], trained[key], err_msg=key)
    np.testing.assert_allclose(loaded.predict(mwms_run.data()[0], verbose=0),
                               trained["predict"], rtol=1e-5, atol=1e-5)
    # 3 workers fit the restored model on new data as one process does.
    one = mwms_run.fit(loaded, seed=6, reset_dense=False, infer=False, evict_during_fit=False)
    assert np.abs(one["kernel"] - trained["kernel"]).max() > 1e-4
    # export() did not evict (as one table's does not); evict() then did,
    # at the table's last update step, the same keys on 3 workers.
    assert one["evicted"] > 0
    assert len(one["group0_keys"]) == len(one["group0_keys_after_evict"]) + one["evicted"]
    for task in range(3):
        got = np.load(tmp_path / f"w{task}_restore.npz")
        assert_same({k[len("fit_"):]: got[k] for k in got.files if k.startswith("fit_")},
                    one, f"worker {task} of 3", keys=one)
