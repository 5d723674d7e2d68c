"""tests/jax_backend runs under Keras's JAX backend, in the JAX worker of
tests/_backends.py (see tests/conftest.py), but for the files of
`_backends.TENSORFLOW_SIDE`, which run in the main (TensorFlow) process."""

import os

import pytest

from tests._backends import TENSORFLOW_SIDE

if os.environ.get("KERAS_BACKEND") == "jax":
    collect_ignore = list(TENSORFLOW_SIDE)

    @pytest.fixture
    def jax_32_bit_mode():
        """JAX's 32-bit mode (int32 ids) for the test: importing
        keras_rec_emb turns the 64-bit mode on unless JAX_ENABLE_X64 says
        otherwise, so the int32 layout is tested under this fixture."""
        import jax

        with jax.enable_x64(False):
            yield
