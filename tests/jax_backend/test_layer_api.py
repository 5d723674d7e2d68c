"""keras_rec_emb.layers.EmbeddingVariable under Keras's JAX backend: the
TensorFlow layer's registered name, arguments and config."""

import keras
import numpy as np
import pytest

import keras_rec_emb
from keras_rec_emb import layers
from keras_rec_emb import optimizers
from keras_rec_emb.layers import embedding_variable


def test_the_public_names_are_the_jax_classes_under_the_tensorflow_names():
    assert layers.EmbeddingVariable is embedding_variable.EmbeddingVariable
    assert layers.EmbeddingVariable.__module__ == "keras_rec_emb.layers.embedding_variable"
    assert (keras.saving.get_registered_name(layers.EmbeddingVariable)
            == "keras_rec_emb>EmbeddingVariable")
    for name in keras_rec_emb.optimizers.__all__:
        cls = getattr(keras_rec_emb.optimizers, name)
        assert cls.__module__.startswith("keras_rec_emb.optimizers."), cls.__module__
        assert keras.saving.get_registered_name(cls) == f"keras_rec_emb>{name}"


def test_get_config_covers_every_argument():
    layer = layers.EmbeddingVariable(
        5, initializer=keras.initializers.Constant(0.25), key_dtype="int32", combiner="sqrtn",
        prune_invalid_ids=True, optimizer=optimizers.AdamAsync(0.3, beta_1=0.5),
        default_value_dim=7, num_shards=4, name="emb", trainable=False)
    again = layers.EmbeddingVariable.from_config(layer.get_config())
    for name in ("embedding_dim", "key_dtype", "combiner", "prune_invalid_ids",
                 "default_value_dim", "num_shards", "name", "trainable"):
        assert getattr(again, name) == getattr(layer, name), name
    assert keras.initializers.serialize(again.initializer) == keras.initializers.serialize(
        layer.initializer)
    assert type(again.optimizer) is optimizers.AdamAsync
    assert again.optimizer.get_config() == layer.optimizer.get_config()
    assert again.get_config() == layer.get_config()


def _option(**fields):
    config = {"init_option": {"class_name": "InitializerOption", "config": {
        "initializer": None, "default_value_dim": 9}}, "num_shards": 2}
    config.update(fields)
    return {"class_name": "EmbeddingVariableOption", "config": config}


def test_the_tensorflow_layers_ev_option_applies_where_the_jax_layer_supports_it():
    layer = layers.EmbeddingVariable(3, ev_option=_option())
    assert (layer.default_value_dim, layer.num_shards) == (9, 2)


@pytest.mark.parametrize("saved_dim", [2, 5])
def test_rows_of_another_width_pad_or_truncate_as_under_tensorflow(tmp_path, saved_dim):
    keys = np.array([3, 10, 17], np.int64)
    values = np.arange(3 * saved_dim, dtype=np.float32).reshape(3, saved_dim)
    saved = layers.EmbeddingVariable(saved_dim, name="ev", default_value_dim=7,
                                     optimizer=keras.optimizers.Adagrad(0.1))
    saved.build()
    saved.import_({"keys": keys, "values": values,
                   "slots": {"accumulator": values + 100.0}})
    path = str(tmp_path / "ev.weights.h5")
    keras.Sequential([keras.Input((1,), dtype="int64"), saved]).save_weights(path)

    def reloaded(mode):
        layer = layers.EmbeddingVariable(3, name="ev", default_value_dim=7,
                                         restore_dim_mismatch=mode,
                                         optimizer=keras.optimizers.Adagrad(0.1))
        keras.Sequential([keras.Input((1,), dtype="int64"), layer]).load_weights(path)
        return layer

    with pytest.raises(ValueError, match=f"rows of dim {saved_dim} but the table has dim 3"):
        reloaded("error")
    layer = reloaded("pad_or_truncate")
    got = layer.export()
    order = np.argsort(got["keys"])
    assert got["keys"][order].tolist() == keys.tolist()
    if saved_dim > 3:
        want, acc = values[:, :3], values[:, :3] + 100.0
    else:  # new columns of key k from initializer row k mod 7; slots from their init
        want = np.concatenate([values, layer.default_values[keys % 7, saved_dim:]], axis=1)
        acc = np.concatenate([values + 100.0, np.full((3, 3 - saved_dim), 0.1)], axis=1)
    np.testing.assert_allclose(got["values"][order], want, rtol=1e-6)
    np.testing.assert_allclose(got["slots"]["accumulator"][order], acc, rtol=1e-6)


def test_an_ev_option_of_another_type_is_refused_with_a_type_error():
    with pytest.raises(TypeError, match="`ev_option` must be None, a keras_rec_emb."
                                        "EmbeddingVariableOption or its config .* "
                                        "ev_option=<object"):
        layers.EmbeddingVariable(3, ev_option=object())


def test_the_docstring_example_runs():
    import doctest

    test = doctest.DocTestFinder().find(
        layers.EmbeddingVariable, globs={"keras": keras, "np": np,
                                         "keras_rec_emb": keras_rec_emb})[0]
    assert test.examples
    assert doctest.DocTestRunner().run(test, out=lambda text: None).failed == 0
