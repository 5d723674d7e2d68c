"""What stays TensorFlow-only under the JAX backend says so when imported."""

import importlib
import sys

import pytest


def test_distributed_tables_refuse_the_jax_backend_by_name():
    sys.modules.pop("keras_rec_emb.distribute", None)
    with pytest.raises(ImportError, match=r"TensorFlow backend only.*active backend is 'jax'"):
        importlib.import_module("keras_rec_emb.distribute")
    assert "keras_rec_emb.distribute" not in sys.modules


@pytest.mark.parametrize("name", ["IncrementalCheckpointer", "callbacks.CheckpointCallback"])
def test_tensorflow_only_names_say_so_under_jax(name):
    import keras_rec_emb

    owner, _, attr = name.rpartition(".")
    module = getattr(keras_rec_emb, owner) if owner else keras_rec_emb
    with pytest.raises(AttributeError, match=rf"{attr} runs on Keras's TensorFlow backend "
                       r"only for now.*active backend is 'jax'. Under JAX: "):
        getattr(module, attr)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name


@pytest.mark.parametrize("name", ["EmbeddingVariableOption", "InitializerOption", "CounterFilter",
                                  "CBFFilter", "GlobalStepEvict", "L2WeightEvict",
                                  "StorageOption"])
def test_the_table_options_are_public_under_jax(name):
    import keras

    import keras_rec_emb
    from keras_rec_emb import options

    assert getattr(keras_rec_emb, name) is getattr(options, name)
    assert name in keras_rec_emb.__all__ and name in dir(keras_rec_emb)
    assert keras.saving.get_registered_name(getattr(options, name)) == f"keras_rec_emb>{name}"
