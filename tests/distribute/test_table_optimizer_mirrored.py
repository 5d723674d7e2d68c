"""A table's own optimizer (`EmbeddingVariable(optimizer=...)`) under
MirroredStrategy: every shard of the table gets its slots and the same
update as one process with the same global batch."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_table_optimizer_under_mirrored_strategy_matches_one_process():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mirrored_table_optimizer.py"),
                           "2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["slots"] == ["slot_momentum", "slot_velocity"]  # Adam's, not Adagrad's
    for key in ("values", "kernel", "slot_momentum", "slot_velocity"):
        assert got[key] < 1e-5, (key, got)
