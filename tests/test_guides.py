"""Every guide runs top to bottom in small mode (KRE_GUIDE_SMALL=1); the
quickstart and the DLRM guide run under KERAS_BACKEND=jax too, unchanged,
and print what they print under TensorFlow."""

import glob
import math
import os
import re
import subprocess
import sys

import pytest

# guides/_*.py are helpers the guides import (e.g. _broker.py), not guides.
GUIDES = sorted(p for p in glob.glob(os.path.join(os.path.dirname(__file__), "..", "guides",
                                                  "*.py"))
                if not os.path.basename(p).startswith("_"))

# The guides that run under Keras's JAX backend too (the others use what is
# TensorFlow-only: tf.data pipelines of keras_rec_emb.data, tf.distribute,
# MultiHashEmbedding, ...; see docs/backends.md). Each with the
# lines of its output that must be the same under both backends: the tables'
# sizes follow from the data alone.
JAX_GUIDES = {
    "quickstart.py": ("users in table:", "items in table:"),
    "group_embedding_dlrm.py": ("tables:",),
}
# Output of the TensorFlow runs of this module (pytest-xdist's loadfile
# keeps a file's tests in one process, in order), so the JAX runs compare
# without running the guide again.
_TENSORFLOW_OUTPUT = {}


def _run(path, tmp_path, **env):
    env = dict(os.environ, KRE_GUIDE_SMALL="1", TF_CPP_MIN_LOG_LEVEL="2", **env)
    result = subprocess.run([sys.executable, os.path.abspath(path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_there_are_guides():
    assert len(GUIDES) >= 1
    assert set(JAX_GUIDES) <= {os.path.basename(p) for p in GUIDES}


@pytest.mark.parametrize("path", GUIDES, ids=os.path.basename)
def test_guide_runs(path, tmp_path):
    _TENSORFLOW_OUTPUT[os.path.basename(path)] = _run(path, tmp_path,
                                                      KERAS_BACKEND="tensorflow")


def _lines(output, prefixes):
    return [line for line in output.splitlines() if line.startswith(prefixes)]


def _last_training_loss(output):
    """The `loss` of the last epoch Keras printed (verbose=2), or None."""
    losses = re.findall(r" - loss: ([0-9.]+)", output)
    return float(losses[-1]) if losses else None


@pytest.mark.parametrize("name", sorted(JAX_GUIDES))
def test_guide_runs_unchanged_under_jax(name, tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "guides", name)
    if name not in _TENSORFLOW_OUTPUT:  # run alone (-k): run the TensorFlow side here
        (tmp_path / "tf").mkdir()
        _TENSORFLOW_OUTPUT[name] = _run(path, tmp_path / "tf", KERAS_BACKEND="tensorflow")
    # Unchanged: the environment says only the backend (the guides' ids go
    # beyond int32, which keras_rec_emb's import makes JAX hold).
    jax_output = _run(path, tmp_path, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    tf_output = _TENSORFLOW_OUTPUT[name]
    want = _lines(tf_output, JAX_GUIDES[name])
    assert len(want) == len(JAX_GUIDES[name]), tf_output[-3000:]
    assert _lines(jax_output, JAX_GUIDES[name]) == want, jax_output[-3000:]
    # Both backends learn: the last epoch's loss is below a constant
    # prediction's (log 2 for balanced-ish clicks) and not NaN.
    for output in (tf_output, jax_output):
        loss = _last_training_loss(output)
        if loss is not None:
            assert 0 < loss < math.log(2), output[-3000:]
