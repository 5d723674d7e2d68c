"""The same training code run under both backends and its results compared,
for tests/jax_backend/test_jax_backend.py and test_cross_backend_training.py
(TensorFlow-side files: this process runs TensorFlow, a child JAX)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

# One layer for both backends (one class): the table's meta tracked, so
# that frequencies and versions are compared too.
LAYER = """
import keras_rec_emb as kre
def make_layer(init, combiner, **options):
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(initializer=init, default_value_dim=DVD), track_meta=True,
        **options)
    return kre.layers.EmbeddingVariable(DIM, key_dtype="int32", ev_option=option,
                                        combiner=combiner, prune_invalid_ids=bool(combiner))
def export(layer):
    return layer.export()
"""


def result_under_jax(code, **env):
    """`code`, which sets `result` (JSON-able), run in a JAX child with
    `env` added to its environment: its `result`."""
    script = "import json, sys\nimport keras\n" + code + "\njson.dump(result, sys.stdout)\n"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         env=dict(os.environ, KERAS_BACKEND="jax", **env), text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def result_here(code):
    """`code`'s `result` run in this (TensorFlow) process: saves a child's start."""
    namespace = {}
    exec(code, namespace)
    return namespace["result"]


def assert_runs_agree(tf_runs, jax_runs, tolerances, exact=("keys", "freqs", "versions"),
                      optional=()):
    """For each run named in `tolerances`: the `exact` parts equal (absent
    from both counts as equal), the same slots; values, Dense kernel and
    bias, slots and the `optional` parts (in both runs or in neither)
    within the run's tolerance."""
    for name, tolerance in tolerances.items():
        tf_run, jax_run = tf_runs[name], jax_runs[name]
        for key in exact:
            assert jax_run.get(key) == tf_run.get(key), (name, key)
        assert sorted(jax_run["slots"]) == sorted(tf_run["slots"]), name
        for key in optional:
            assert (key in jax_run) == (key in tf_run), (name, key)
        for key in ("values", "kernel", "bias", *(f"slot {s}" for s in tf_run["slots"]),
                    *(k for k in optional if k in tf_run)):
            got, want = ((run["slots"][key[5:]] if key.startswith("slot ") else run[key])
                         for run in (jax_run, tf_run))
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=1e-6,
                                       err_msg=f"{name} {key}")
