"""What stays TensorFlow-only under the JAX backend says so when imported."""

import importlib
import sys

import pytest


def test_distributed_tables_refuse_the_jax_backend_by_name():
    sys.modules.pop("keras_rec_emb.distribute", None)
    with pytest.raises(ImportError, match=r"TensorFlow backend only.*active backend is 'jax'"):
        importlib.import_module("keras_rec_emb.distribute")
    assert "keras_rec_emb.distribute" not in sys.modules
