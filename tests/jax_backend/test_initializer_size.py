"""An initializer matrix too large to allocate ([default_value_dim,
embedding_dim] past 2**31 - 1 floats) is a ValueError before anything is
allocated, the same under both backends (under JAX the allocation aborted
the process: XLA's `Check failed: buffer_.IsConcrete()`). The cases run
in child processes (one per backend), so an abort fails the tests instead
of killing pytest."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

_BUILD = r"""
import sys
import keras_rec_emb as kre
for case in sys.argv[1:]:
    embedding_dim, default_value_dim = map(int, case.split("x"))
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=default_value_dim))
    layer = kre.layers.EmbeddingVariable(embedding_dim, ev_option=option, name="ev")
    try:
        layer.build((None, 1))
    except ValueError as e:
        print("ValueError:", e)
    else:
        print("built", layer.built)
"""

CASES = [(2**31, 4096), (2**31, 1), (2**19, 2**12)]


def _build(backend, cases):
    """What building each (embedding_dim, default_value_dim) of `cases`
    printed, in one child process of `backend`."""
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _BUILD, *(f"{e}x{d}" for e, d in cases)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    return run.stdout.strip().splitlines()[-len(cases):]


@pytest.fixture(scope="module")
def built():
    return {backend: dict(zip(CASES + [(4, 4096)], _build(backend, CASES + [(4, 4096)])))
            for backend in ("jax", "tensorflow")}


@pytest.mark.parametrize("embedding_dim, default_value_dim", CASES)
def test_a_matrix_past_2_31_floats_is_a_value_error_under_both_backends(embedding_dim,
                                                                         default_value_dim,
                                                                         built):
    case = (embedding_dim, default_value_dim)
    assert built["jax"][case] == built["tensorflow"][case]
    assert built["jax"][case].startswith(
        f"ValueError: EmbeddingVariable 'ev': its initializer matrix [default_value_dim, "
        f"embedding_dim] = [{default_value_dim}, {embedding_dim}] would hold "
        f"{default_value_dim * embedding_dim} floats")
    assert built["jax"][case].endswith(f"Received: default_value_dim={default_value_dim}, "
                                       f"embedding_dim={embedding_dim}")


def test_a_matrix_within_the_limit_builds(built):
    assert built["jax"][(4, 4096)] == built["tensorflow"][(4, 4096)] == "built True"
