"""A GroupEmbedding over several tables sharded over MultiWorkerMirrored
worker processes: all its tables' ids and rows travel in one exchange a
step and direction, and 2 workers give what one process gives; so do the
same tables as separate layers of a Functional model (looked up together
by the model call)."""

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


def _env(config=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONFAULTHANDLER="1")
    env.pop("TF_CONFIG", None)
    if config is not None:
        env["TF_CONFIG"] = json.dumps(config)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("form", ["group", "separate"])
def test_group_of_three_tables_on_two_workers_matches_one_process(tmp_path, form):
    script = os.path.join(HERE, "mwms_group_run.py")
    args = [str(tmp_path)] + (["separate"] if form == "separate" else [])
    one = subprocess.run([sys.executable, script, *args], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs = []
    try:
        for task in range(2):
            config = {"cluster": {"worker": addresses},
                      "task": {"type": "worker", "index": task}}
            log = open(tmp_path / f"w{task}.log", "w")
            procs.append(subprocess.Popen([sys.executable, script, *args],
                                          env=_env(config), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
        for task, proc in enumerate(procs):
            rc = proc.wait(timeout=300)
            assert rc == 0, (tmp_path / f"w{task}.log").read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # by its pid
                proc.wait(timeout=30)
    want = np.load(tmp_path / "one.npz")
    assert {"a_slot_momentum", "b_keys_filtered", "c_freqs", "predict"} <= set(want.files)
    assert want["b_keys_filtered"].size > 0  # the filter held some keys back
    for task in range(2):
        got = np.load(tmp_path / f"w{task}.npz")
        assert sorted(got.files) == sorted(want.files)
        for key in want.files:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5,
                                       err_msg=f"worker {task}: {key}")
