"""Every Keras model form: functional, subclassed, `Sequential` with and
without `keras.Input`, for every id layer. Tables built lazily inside the
traced first step of `fit`, `model.build(shape)`, and an exact `.keras`
round trip (tables with slots, frequencies and versions, dense weights,
optimizer slots and iterations, compared value by value) in each form."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import (AdaptiveEmbedding, EmbeddingVariable, FeatureSpec,
                                  GroupEmbedding, MultiHashEmbedding)
from tests._model_forms import (FORMS, ChainModel, assert_state_equal, id_layers,
                                model_in_form, state)

def _ev_mean():
    return [EmbeddingVariable(8, combiner="mean", name="ev",
                              ev_option=kre.EmbeddingVariableOption(track_meta=True)),
            keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]


def _ev_seq():
    return [EmbeddingVariable(4, name="ev"), keras.layers.Flatten(), keras.layers.Dense(1)]


def _group_stacked():
    features = {f"f{j}": FeatureSpec({"embedding_dim": 4, "name": f"t{j}"},
                                     combiner="sum") for j in range(3)}
    return [GroupEmbedding(features, output_mode="concat", name="group"),
            keras.layers.Dense(1)]


def _multi_hash():
    return [MultiHashEmbedding(1000, 4, combiner="sum", name="mh"), keras.layers.Dense(1)]


def _adaptive():
    return [AdaptiveEmbedding(4, 100, promote_threshold=2, combiner="mean", name="ad"),
            keras.layers.Dense(1)]


rng = np.random.default_rng(5)
# Ids beyond 2**24 (float32 would merge neighbours) and beyond 2**53.
BIG = 2**60 + rng.integers(0, 50, size=(96, 3))
LAYERS = {
    "ev_mean": (_ev_mean, BIG),
    "ev_seq": (_ev_seq, BIG),
    "group_stacked": (_group_stacked, np.where(rng.random((96, 3, 2)) < 0.3, -1,
                                               2**40 + rng.integers(0, 30, (96, 3, 2)))),
    "multi_hash": (_multi_hash, rng.integers(0, 1000, size=(96, 2))),
    "adaptive": (_adaptive, rng.integers(0, 20, size=(96, 2))),
}
Y = rng.random((96, 1)).astype(np.float32)


def make(form, layers_fn, x, optimizer=None):
    model = model_in_form(form, layers_fn(), x.shape[1:], "int64")
    model.compile(optimizer=optimizer or kre.optimizers.Adagrad(0.1), loss="mse")
    return model


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("form", FORMS)
def test_fit_builds_lazily_and_keras_round_trip_is_exact(tmp_path, form, layer):
    layers_fn, x = LAYERS[layer]
    model = make(form, layers_fn, x)
    assert not id_layers(model) or not any(t.built for t in id_layers(model)) or \
        form in ("functional", "sequential_input")
    model.fit(x, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    before = state(model)
    assert any(k.startswith("weight:") for k in before)
    assert len([k for k in before if k.startswith("opt:")]) > 2
    assert int(model.optimizer.iterations) == 6
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    assert_state_equal(before, state(loaded))
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    # Both keep training alike (the optimizer state came back too).
    for m in (model, loaded):
        m.fit(x[::-1], Y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_state_equal(state(model), state(loaded))


@pytest.mark.parametrize("form", ["subclassed", "sequential"])
def test_model_build_with_a_shape_then_fit(form):
    layers_fn, x = LAYERS["ev_mean"]
    model = make(form, layers_fn, x)
    model.build((None, 3))
    ev = id_layers(model)[0]
    if form == "sequential":  # (Keras's `Model.build` of a subclassed model
        # builds nothing, whatever its layers: they build in `fit`.)
        assert ev.built and ev.table_size() == 0
    model.fit(x, Y, batch_size=32, epochs=1, verbose=0)
    assert ev.table_size() == len(np.unique(x))


def test_sequential_without_input_keeps_every_bit_of_int64_ids():
    """Keras's own Sequential would make a float32 Input: ids 2**60 + k for
    k < 50 would all become the same float. Each id must get its own row."""
    x = (2**60 + np.arange(64)).reshape(64, 1)
    model = keras.Sequential([EmbeddingVariable(4, combiner="sum", name="ev"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=kre.optimizers.SGD(0.1), loss="mse")
    model.fit(x, Y[:64], batch_size=64, epochs=1, verbose=0)
    assert model.layers[0].ids_input_dtype == "int64"
    assert model.inputs[0].dtype == "int64"
    np.testing.assert_array_equal(np.sort(model.layers[0].export()["keys"]), x[:, 0])


def test_group_embedding_dict_inputs_in_a_subclassed_model(tmp_path):
    features = {"a": FeatureSpec({"embedding_dim": 4, "name": "ta"}),
                "b": FeatureSpec({"embedding_dim": 4, "name": "tb"}, combiner="mean")}
    model = ChainModel([GroupEmbedding(features, output_mode="concat", name="group"),
                        keras.layers.Dense(1)])
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    x = {"a": rng.integers(0, 10**12, (64, 1)), "b": rng.integers(0, 10**12, (64, 3))}
    model.fit(x, Y[:64], batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "g.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert_state_equal(state(model), state(loaded))
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))


def test_float_ids_are_still_refused_outside_a_symbolic_build():
    ev = EmbeddingVariable(4)
    with pytest.raises(TypeError, match="expects integer ids"):
        ev(np.array([[1.0, 2.0]], np.float32))

    @tf.function
    def traced(x):
        return ev(x)

    with pytest.raises(TypeError, match="expects integer ids"):
        traced(tf.constant([[1.0, 2.0]]))


@pytest.mark.parametrize("layer", ["ev_mean", "group_stacked"])
@pytest.mark.parametrize("form", FORMS)
def test_several_steps_an_execution_train_as_one_step_a_call(form, layer):
    """`compile(steps_per_execution=2)` over epochs of 3 steps (the last
    execution of each runs one step): the same tables, slots, dense
    weights and evaluation as one step a call."""
    layers_fn, x = LAYERS[layer]
    states, evaluations = [], []
    for steps in (1, 2):
        keras.utils.set_random_seed(3)
        model = make(form, layers_fn, x)
        model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse",
                      steps_per_execution=steps)
        model.fit(x, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations) == 6
        states.append(state(model))
        evaluations.append(model.evaluate(x, Y, batch_size=32, verbose=0))
    assert_state_equal(*states)
    assert evaluations[0] == evaluations[1]
