"""A worker of a synchronous (MultiWorkerMirroredStrategy) cluster killed
with SIGKILL in the middle of `fit`: its peer ends with an error naming the
lost task in bounded time, and the cluster restarted with
`keras.callbacks.BackupAndRestore` ends with the tables (rows, slots,
frequencies, counts of filtered keys) and dense weights of an uninterrupted
run: nothing lost, nothing applied twice."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _net import free_ports  # noqa: E402

pytestmark = pytest.mark.multiprocess

# The workers' lost_worker_timeout, and the margin of a busy 2-core machine
# over it (a process start, the error's way up through Keras).
LOST_TIMEOUT_S, MARGIN_S = 5, 25


def start(folder, mode):
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs = []
    for task in range(2):
        config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": task}}
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
                   PYTHONFAULTHANDLER="1", TF_CONFIG=json.dumps(config),
                   LOST_TIMEOUT=str(LOST_TIMEOUT_S))
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        log = open(folder / f"w{task}_{mode}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "mwms_lost_worker.py"), str(folder), mode],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    return procs


def stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def log(folder, task, mode):
    return (folder / f"w{task}_{mode}.log").read_text()[-3000:]


def test_killed_worker_ends_its_peer_and_backup_and_restore_resumes_exactly(tmp_path):
    """Worker 1 is killed at the start of epoch KILL_EPOCH; worker 0 fails
    naming it within lost_worker_timeout plus a margin; both restart with
    their BackupAndRestore folders and finish: the same tables and dense
    weights as one process trained without interruption."""
    procs = start(tmp_path, "run")
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "w1_at_kill").exists():
            assert time.monotonic() < deadline, log(tmp_path, 1, "run")
            assert procs[0].poll() is None and procs[1].poll() is None, (
                log(tmp_path, 0, "run") + log(tmp_path, 1, "run"))
            time.sleep(0.2)
        time.sleep(1.0)  # worker 0 is waiting in the next step's collectives
        killed = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(timeout=30)
        rc = procs[0].wait(timeout=LOST_TIMEOUT_S + MARGIN_S + 60)
        ended = time.monotonic() - killed
    finally:
        stop(procs)
    assert rc != 0, log(tmp_path, 0, "run")
    assert ended <= LOST_TIMEOUT_S + MARGIN_S, f"worker 0 ended {ended:.0f}s after the kill"
    error = (tmp_path / "w0_run_error.txt").read_text()
    assert error.startswith("UnavailableError") and "/job:worker/replica:0/task:1" in error, error

    procs = start(tmp_path, "resume")
    try:
        for task, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, log(tmp_path, task, "resume")
    finally:
        stop(procs)

    sys.path.insert(0, HERE)
    import mwms_lost_worker as run
    ids, y = run.data()
    model = run.build()
    model.fit(ids, y, batch_size=run.BATCH, epochs=run.EPOCHS, shuffle=False, verbose=0)
    want = run.arrays(model)
    assert len(want["keys"]) > 10 and len(want["keys_filtered"]) > 0
    for task in (0, 1):
        got = np.load(tmp_path / f"w{task}_resume.npz")
        assert int(got["iterations"]) == int(want["iterations"]) == run.EPOCHS * run.STEPS
        for key in want:
            if got[key].dtype.kind == "f":
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                           err_msg=f"worker {task}: {key}")
            else:
                np.testing.assert_array_equal(got[key], want[key],
                                              err_msg=f"worker {task}: {key}")


@pytest.mark.parametrize("value, error", [
    (0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (1e9, ValueError),
    ("10", TypeError), (True, TypeError), (None, TypeError)])
def test_bad_lost_worker_timeout_is_refused_by_name(value, error):
    import keras_rec_emb as kre

    with pytest.raises(error, match="lost_worker_timeout"):
        kre.distribute.multi_worker_strategy(lost_worker_timeout=value)
