"""Runs tests/jax under Keras's JAX backend in a child pytest (this
process runs TensorFlow), and checks that the JAX binding's library links
neither TensorFlow nor Python."""

import os
import pathlib
import subprocess
import sys

import keras_rec_emb

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = pathlib.Path(keras_rec_emb.__file__).parent / "_kre_jax.so"


def test_library_is_built():
    assert LIBRARY.exists(), f"{LIBRARY} is missing: `make jax-ops` builds it"


def test_library_links_neither_tensorflow_nor_python():
    needed = subprocess.run(["ldd", str(LIBRARY)], capture_output=True, text=True, check=True)
    libraries = [line.split()[0] for line in needed.stdout.splitlines() if line.strip()]
    assert libraries and not [lib for lib in libraries
                              if "tensorflow" in lib or "python" in lib or "jax" in lib]
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(LIBRARY)],
                               capture_output=True, text=True, check=True).stdout
    symbols = [line.split()[-1] for line in undefined.splitlines() if line.strip()]
    assert symbols  # libc, libstdc++
    assert [s for s in symbols if "tensorflow" in s or "absl" in s or s.startswith("Py")] == []
    exported = subprocess.run(["nm", "-D", "--defined-only", str(LIBRARY)],
                              capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert {"KreTableCreate", "KreTableLookup", "KreTableApply", "KreTableExport"} <= names


def test_tests_under_the_jax_backend_pass():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "tests/jax"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-4000:]
