"""An initializer matrix too large to allocate ([default_value_dim,
embedding_dim] past 2**31 - 1 floats) is a ValueError before anything is
allocated, the same under both backends (under JAX the allocation aborted
the process: XLA's `Check failed: buffer_.IsConcrete()`). Each case runs
in a child process, so an abort fails the test instead of killing pytest."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

_BUILD = r"""
import sys
import keras_rec_emb as kre
option = kre.EmbeddingVariableOption(
    init_option=kre.InitializerOption(default_value_dim=int(sys.argv[2])))
layer = kre.layers.EmbeddingVariable(int(sys.argv[1]), ev_option=option, name="ev")
try:
    layer.build((None, 1))
except ValueError as e:
    print("ValueError:", e)
else:
    print("built", layer.built)
"""


def _build(backend, embedding_dim, default_value_dim):
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _BUILD, str(embedding_dim),
                          str(default_value_dim)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("embedding_dim, default_value_dim", [(2**31, 4096), (2**31, 1),
                                                              (2**19, 2**12)])
def test_a_matrix_past_2_31_floats_is_a_value_error_under_both_backends(embedding_dim,
                                                                         default_value_dim):
    got = {backend: _build(backend, embedding_dim, default_value_dim)
           for backend in ("jax", "tensorflow")}
    assert got["jax"] == got["tensorflow"]
    assert got["jax"].startswith(
        f"ValueError: EmbeddingVariable 'ev': its initializer matrix [default_value_dim, "
        f"embedding_dim] = [{default_value_dim}, {embedding_dim}] would hold "
        f"{default_value_dim * embedding_dim} floats")
    assert got["jax"].endswith(f"Received: default_value_dim={default_value_dim}, "
                               f"embedding_dim={embedding_dim}")


def test_a_matrix_within_the_limit_builds():
    assert _build("jax", 4, 4096) == "built True"
