"""Under the "mixed_float16" policy, `compile` with an optimizer of
`keras_rec_emb.optimizers` just works: it is wrapped in our
`LossScaleOptimizer` (Keras's own wrapper cannot update a table), in every
Keras model form, and `fit`, `.keras` save and reload keep every value."""

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb import _keras_fixes
from keras_rec_emb.layers import EmbeddingVariable
from tests._model_forms import FORMS, ChainModel, assert_state_equal, model_in_form, state

OPTIMIZERS = {
    "SGD": lambda: kre.optimizers.SGD(0.05),
    "Adagrad": lambda: kre.optimizers.Adagrad(0.1),
    "Adam": lambda: kre.optimizers.Adam(0.01),
    "Ftrl": lambda: kre.optimizers.Ftrl(0.1),
    "AdamAsync": lambda: kre.optimizers.AdamAsync(0.01),
    "AdagradDecay": lambda: kre.optimizers.AdagradDecay(0.1),
    "AdamW": lambda: kre.optimizers.AdamW(0.01),
}

rng = np.random.default_rng(11)
X = 2**60 + rng.integers(0, 40, size=(64, 3))
Y = rng.random((64, 1)).astype(np.float32)


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _layers():
    return [EmbeddingVariable(4, combiner="sum", name="ev"),
            keras.layers.Dense(3, activation="relu", name="hidden"),
            keras.layers.Dense(1, dtype="float32", name="head")]


def make(form, optimizer, **compile_kwargs):
    model = model_in_form(form, _layers(), (3,), "int64")
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def _table(model):
    data = model.get_layer("ev").export() if not isinstance(model, ChainModel) \
        else model.chain[0].export()
    order = np.argsort(data["keys"])
    return data["values"][order]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compile_wraps_our_optimizers_in_our_loss_scale_optimizer(mixed_float16, name):
    inner = OPTIMIZERS[name]()
    model = make("functional", inner)
    assert type(model.optimizer) is kre.optimizers.LossScaleOptimizer
    assert model.optimizer.inner_optimizer is inner
    assert model.optimizer.name == "loss_scale_optimizer"
    assert model.optimizer.initial_scale == 2.0**15
    model.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 4
    assert model.get_layer("ev").table_size() == len(np.unique(X))

    # The same training with our wrapper passed by hand: the same values.
    keras.utils.set_random_seed(1234)
    by_hand = make("functional", kre.optimizers.LossScaleOptimizer(OPTIMIZERS[name]()))
    keras.utils.set_random_seed(1234)
    auto = make("functional", OPTIMIZERS[name]())
    for m in (by_hand, auto):
        m.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert_state_equal(state(by_hand), state(auto))
    assert np.abs(_table(auto)).max() > 0


def test_auto_wrapped_training_matches_float32_training(mixed_float16, matrix_initializer):
    """The loss scale is undone: table rows move as float32 training moves
    them (to float16 precision), not 32768 times more."""
    def train(policy, lr=0.05):
        keras.mixed_precision.set_global_policy(policy)
        init = matrix_initializer(np.linspace(-0.5, 0.5, 8 * 4).reshape(8, 4))
        ids = keras.Input((3,), dtype="int64")
        ev = EmbeddingVariable(4, combiner="sum", initializer=init, name="ev")
        out = keras.layers.Dense(1, dtype="float32", kernel_initializer="ones")(ev(ids))
        model = keras.Model(ids, out)
        model.compile(optimizer=kre.optimizers.SGD(lr), loss="mse")
        model.fit(X, Y, batch_size=64, epochs=3, shuffle=False, verbose=0)
        return _table(model), model

    mixed, model = train("mixed_float16")
    assert type(model.optimizer) is kre.optimizers.LossScaleOptimizer
    assert float(model.optimizer.dynamic_scale) == 2.0**15
    reference, _ = train("float32")
    before, _ = train("float32", lr=0.0)
    np.testing.assert_allclose(mixed, reference, atol=5e-3)
    assert np.abs(reference - before).max() > 0.02


@pytest.mark.parametrize("form", FORMS)
def test_fit_save_reload_keeps_every_value(tmp_path, mixed_float16, form):
    model = make(form, kre.optimizers.Adagrad(0.1))
    model.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert type(model.optimizer) is kre.optimizers.LossScaleOptimizer
    before = state(model)
    # Table slots, dense weights, both optimizers' variables (iterations,
    # step counter, loss scale, accumulators).
    assert any(":accumulator" in k or "slot:" in k for k in before)
    assert len([k for k in before if k.startswith("opt:")]) >= 8
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is kre.optimizers.LossScaleOptimizer
    assert type(loaded.optimizer.inner_optimizer) is kre.optimizers.Adagrad
    assert int(loaded.optimizer.iterations) == 4
    assert int(loaded.optimizer.step_counter) == 4
    assert_state_equal(before, state(loaded))
    np.testing.assert_array_equal(model.predict(X, verbose=0), loaded.predict(X, verbose=0))
    # Both keep training alike (the optimizer state came back too).
    for m in (model, loaded):
        m.fit(X[::-1], Y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_state_equal(state(model), state(loaded))


def test_our_wrapper_settings_round_trip(tmp_path, mixed_float16):
    """A wrapper passed by hand is kept as given, with its settings."""
    optimizer = kre.optimizers.LossScaleOptimizer(kre.optimizers.Adam(0.01),
                                                  initial_scale=64.0, dynamic_growth_steps=3)
    model = make("functional", optimizer)
    assert model.optimizer is optimizer
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert float(optimizer.dynamic_scale) == 64.0 * 2  # 4 steps: grew once after 3
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.dynamic_growth_steps == 3
    assert float(loaded.optimizer.dynamic_scale) == 128.0
    assert_state_equal(state(model), state(loaded))


def test_other_optimizers_and_choices_keep_keras_behaviour(mixed_float16):
    # A model without tables and a Keras optimizer: Keras's own wrapper.
    inp = keras.Input((3,))
    dense = keras.Model(inp, keras.layers.Dense(1, dtype="float32")(inp))
    dense.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    assert type(dense.optimizer) is keras.optimizers.LossScaleOptimizer
    # auto_scale_loss=False: no wrapper at all.
    inner = kre.optimizers.Adagrad(0.1)
    model = make("functional", inner, auto_scale_loss=False)
    assert model.optimizer is inner
    # Under float32 nothing is wrapped.
    keras.mixed_precision.set_global_policy("float32")
    inner = kre.optimizers.Adagrad(0.1)
    assert make("functional", inner).optimizer is inner


def test_a_stock_wrapper_passed_by_hand_still_names_the_fix(mixed_float16):
    stock = keras.optimizers.LossScaleOptimizer(kre.optimizers.Adagrad(0.1))
    model = make("functional", stock)
    assert model.optimizer is stock
    with pytest.raises(TypeError, match=r"updated by keras_rec_emb\.optimizers\.Adagrad.*"
                                        r"keras_rec_emb\.optimizers\.LossScaleOptimizer"):
        model.fit(X, Y, verbose=0)


def test_keras_compile_still_wraps_in_its_own_wrapper(mixed_float16):
    """Pins the Keras behaviour that `_keras_fixes.fix_compile_loss_scale`
    corrects: Keras's own `compile` wraps ours in its LossScaleOptimizer,
    which cannot update a table. When this fails, Keras changed: read
    `Trainer.compile` again and drop or adapt the correction."""
    assert keras.__version__ in _keras_fixes.KERAS_COMPILE_FIX_VERSIONS
    assert keras.Model.compile._kre_fix
    keras_compile = _keras_fixes.KERAS_COMPILE_ORIGINALS["compile"]
    layers = _layers()
    inp = keras.Input((3,), dtype="int64")
    out = inp
    for layer in layers:
        out = layer(out)
    model = keras.Model(inp, out)
    keras_compile(model, optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    with pytest.raises(TypeError, match="LossScaleOptimizer"):
        model.fit(X, Y, verbose=0)
