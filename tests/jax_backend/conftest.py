"""tests/jax_backend runs under Keras's JAX backend, in a child pytest that
test_jax_backend.py starts with KERAS_BACKEND=jax (the suite's own process
runs TensorFlow). By hand: `KERAS_BACKEND=jax .venv/bin/python -m pytest -q tests/jax_backend`.
"""

import os

# Files that run in the suite's (TensorFlow) process and start JAX children.
_TENSORFLOW_SIDE = ("test_jax_backend.py", "test_jax_suite_half.py", "test_cross_backend_saving.py",
                    "test_cross_backend_training.py", "test_cross_backend_hash_layers.py",
                    "test_cross_backend_export.py")

if os.environ.get("KERAS_BACKEND") == "jax":
    # The child: everything but the files that start children.
    collect_ignore = list(_TENSORFLOW_SIDE)
else:
    # The suite's (TensorFlow) process: only the files that start children.
    collect_ignore_glob = [name for name in os.listdir(os.path.dirname(__file__))
                           if name.startswith("test_") and name not in _TENSORFLOW_SIDE]


if os.environ.get("KERAS_BACKEND") == "jax":
    import random

    import numpy as np
    import pytest

    @pytest.fixture
    def jax_32_bit_mode():
        """JAX's 32-bit mode (int32 ids) for the test: importing
        keras_rec_emb turns the 64-bit mode on unless JAX_ENABLE_X64 says
        otherwise, so the int32 layout is tested under this fixture."""
        import jax

        with jax.enable_x64(False):
            yield

    @pytest.fixture(autouse=True)
    def _seed():
        # Overrides tests/conftest.py's: keras.utils.set_random_seed imports
        # TensorFlow whenever it is installed, which the JAX backend must not need.
        random.seed(1234)
        np.random.seed(1234)
        yield
