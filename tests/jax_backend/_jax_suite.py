"""The JAX child suite's runner, for test_jax_backend.py and
test_jax_suite_half.py (the suite's own process runs TensorFlow)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The child suite runs in two children, these files in one (the longest,
# about half the time: test_jax_suite_half.py) and every other file in the
# other (here), so that pytest-xdist's two workers can run one each.
HALF = ("test_multi_hash.py", "test_file_tier.py", "test_adaptive.py", "test_filters_eviction.py",
        "test_group_embedding.py", "test_backend_switch.py")


def run_jax_suite(tmp_path, files=None, ignore=()):
    """The child pytest under the JAX backend over `files` of
    tests/jax_backend (all without), less `ignore`; asserts it passed.

    XLA's compiles are most of the child's time: it compiles with XLA's
    optimizations mostly off (JAX's `jax_disable_most_optimizations`) and
    keeps a compilation cache of its own for its run (identical programs
    compile once). The tests that compare numbers with the TensorFlow
    backend (test_cross_backend_*.py) and the guides run JAX's defaults."""
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
               JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("PYTEST_XDIST_WORKER", None)
    here = "tests/jax_backend"
    targets = [f"{here}/{f}" for f in files] if files else [here]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         *targets, *(f"--ignore={here}/{f}" for f in ignore)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-4000:]
    return result.stdout
