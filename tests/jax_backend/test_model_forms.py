"""The same tiny model written the ways users write it (functional,
subclassed with and without passing `training` on, Sequential with and
without keras.Input) under Keras's JAX backend: `fit` trains the table to
NumPy's numbers, `predict` and `evaluate` insert nothing, save and load
keep every row and slot, and each table is made once."""

import keras
import numpy as np
import pytest
from test_keras_layer import BATCH, DIM, FEATURES, check_table, data, numpy_fit

import keras_rec_emb as kre
from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.options import EmbeddingVariableOption, InitializerOption

LR, ACC0, EPS = 0.05, 0.1, 1e-7



def _with_meta(default_value_dim):
    # Frequencies and versions are kept only when asked for (as under
    # TensorFlow): they show here which step updated each key, and how often.
    return EmbeddingVariableOption(init_option=InitializerOption(default_value_dim=default_value_dim),
                                   track_meta=True)

def embedding(own_optimizer):
    optimizer = (keras.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS)
                 if own_optimizer else None)
    return EmbeddingVariable(DIM, optimizer=optimizer, ev_option=_with_meta(5),
                             initializer=keras.initializers.RandomUniform(seed=1), name="ev")


def dense():
    return keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=3),
                              bias_initializer="ones", name="dense")


@keras.saving.register_keras_serializable(package="test_model_forms")
class Subclassed(keras.Model):
    """Its `call` takes no `training`: its layers get None in `fit`."""

    def __init__(self, own_optimizer=True, **kwargs):
        super().__init__(**kwargs)
        self.own_optimizer = own_optimizer
        self.ev = embedding(own_optimizer)
        self.flatten = keras.layers.Flatten()
        self.dense = dense()

    def call(self, ids):
        return self.dense(self.flatten(self.ev(ids)))

    def get_config(self):
        return {**super().get_config(), "own_optimizer": self.own_optimizer}


@keras.saving.register_keras_serializable(package="test_model_forms")
class SubclassedPassingTraining(Subclassed):
    def call(self, ids, training=None):
        return self.dense(self.flatten(self.ev(ids, training=training)))


def make(form, own_optimizer):
    if form == "functional":
        inputs = keras.Input(shape=(FEATURES,), dtype="int32")
        return keras.Model(inputs, dense()(keras.layers.Flatten()(embedding(own_optimizer)(
            inputs))))
    if form == "subclassed":
        return Subclassed(own_optimizer)
    if form == "subclassed_passing_training":
        return SubclassedPassingTraining(own_optimizer)
    layers = [embedding(own_optimizer), keras.layers.Flatten(), dense()]
    if form == "sequential":
        return keras.Sequential([keras.Input(shape=(FEATURES,), dtype="int32"), *layers])
    return keras.Sequential(layers)  # sequential_without_input


def layer_of(model):
    (layer,) = [layer for layer in model.layers if isinstance(layer, EmbeddingVariable)]
    return layer


def adagrad_step(state, key, row, g):
    acc = state.get(key, np.full(DIM, ACC0, np.float32)) + g * g
    state[key] = acc
    return row - np.float32(LR) * g / np.sqrt(acc + np.float32(EPS))


def parts(layer):
    e = ffi.export_parts(layer.handle, layer.key_dtype, layer.embedding_dim,
                         layer._kre_slot_specs)
    order = np.argsort(e["keys"])
    return {"keys": e["keys"][order], "values": e["values"][order], "freqs": e["freqs"][order],
            "versions": e["versions"][order],
            **{f"slot:{n}": v[order] for n, v in e["slots"].items()}}


@pytest.fixture
def tables_made(monkeypatch):
    """A function giving the number of tables created since the test began
    (counted where they are made: earlier tests' tables are freed by the
    garbage collector at no fixed point, so the live count would drift)."""
    made = []
    create = ffi.create

    def counting_create(*args, **kwargs):
        made.append(1)
        return create(*args, **kwargs)

    monkeypatch.setattr(ffi, "create", counting_create)
    return lambda: len(made)


@pytest.mark.parametrize("form, own_optimizer", [
    ("functional", True), ("subclassed", True), ("subclassed_passing_training", True),
    ("sequential", True), ("sequential_without_input", True), ("subclassed", False)])
def test_each_model_form_trains_predicts_and_saves_the_same_table(form, own_optimizer,
                                                                  tmp_path, tables_made):
    """The table trained by its own Adagrad (Dense by SGD), or by the
    compiled kre.optimizers.Adagrad (Dense by it too)."""
    live = tables_made()
    model = make(form, own_optimizer)
    model.compile(optimizer=keras.optimizers.SGD(LR) if own_optimizer
                  else kre.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS),
                  loss="mse")
    ids, labels = data()
    model.predict(ids, batch_size=BATCH, verbose=0)
    model.evaluate(ids, labels, batch_size=BATCH, verbose=0)
    layer = layer_of(model)
    assert layer.table_size() == 0
    kernel, bias = (w.copy() for w in model.get_layer("dense").get_weights())

    model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    steps = len(ids) // BATCH
    got = parts(layer)
    keys, counts = np.unique(ids, return_counts=True)
    np.testing.assert_array_equal(got["keys"], keys)
    np.testing.assert_array_equal(got["freqs"], counts)
    np.testing.assert_array_equal(got["versions"],
                                  [max(i for i in range(steps) if k in ids[i * BATCH:][:BATCH])
                                   for k in keys])
    assert sorted(k for k in got if k.startswith("slot:")) == ["slot:accumulator"]
    if own_optimizer:
        # Table by Adagrad, Dense by stock SGD: NumPy's numbers.
        accumulators = {}

        def step(state, key, row, g):
            row = adagrad_step(state, key, row, g)
            accumulators[key] = state[key]
            return row

        table, kernel, bias = numpy_fit(layer.default_values, kernel, bias, ids, labels, step,
                                        LR)
        check_table(layer, table)
        np.testing.assert_allclose(got["slot:accumulator"], [accumulators[k] for k in keys],
                                   rtol=1e-5)
        got_kernel, got_bias = model.get_layer("dense").get_weights()
        np.testing.assert_allclose(got_kernel, kernel, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_bias, bias, rtol=1e-5, atol=1e-6)
    else:
        # Both by the compiled Adagrad: the functional form's numbers.
        reference = make("functional", False)
        reference.compile(optimizer=kre.optimizers.Adagrad(
            LR, initial_accumulator_value=ACC0, epsilon=EPS), loss="mse")
        reference.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        want = parts(layer_of(reference))
        for name in got:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
        for a, b in zip(model.get_layer("dense").get_weights(),
                        reference.get_layer("dense").get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        live += 1
    assert int(layer.iterations.value) == steps
    assert tables_made() == live + 1

    # predict and evaluate after training insert nothing either.
    unseen = ids + 100
    before = model.predict(unseen, batch_size=BATCH, verbose=0)
    model.evaluate(unseen, labels, batch_size=BATCH, verbose=0)
    assert layer.table_size() == len(keys) and int(layer.iterations.value) == steps

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert tables_made() == live + 2
    again = parts(layer_of(loaded))
    assert sorted(again) == sorted(got)
    for name, value in got.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    np.testing.assert_allclose(loaded.predict(unseen, batch_size=BATCH, verbose=0), before,
                               rtol=1e-6)
    assert tables_made() == live + 2


def test_table_size_export_and_import_as_under_tensorflow():
    """The TensorFlow layer's read and import methods: `table_size()`, and
    `import_` of a dict shaped like TensorFlow's `export()` (slots by name,
    filtered parts, initializer matrix) restores every part."""
    fresh = embedding(True)
    for method, args in (("table_size", ()), ("export", ()), ("import_", ({},))):
        with pytest.raises(ValueError, match=f"'ev' is not built yet.*before {method}"):
            getattr(fresh, method)(*args)
    model = make("functional", True)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    ids, labels = data()
    model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    trained = layer_of(model)
    assert trained.table_size() == len(np.unique(ids))
    want = parts(trained)

    fresh.build((None, FEATURES))
    assert fresh.table_size() == 0
    fresh.import_(ffi.export_parts(trained.handle, trained.key_dtype, DIM,
                                   trained._kre_slot_specs))
    assert fresh.table_size() == len(np.unique(ids))
    got = parts(fresh)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    with pytest.raises(ValueError, match=r"`data` must be a dict with at least 'keys'.*"
                                         r"Received: dict with keys \['values'\]"):
        fresh.import_({"values": np.zeros((1, DIM), np.float32)})
    with pytest.raises(ValueError, match=r"`values` must have shape \[1, 3\]"):
        fresh.import_({"keys": np.array([1]), "values": np.zeros((1, DIM + 1), np.float32)})
    assert fresh.table_size() == len(np.unique(ids))  # a failed import changes nothing


@pytest.mark.parametrize("form", ["functional", "subclassed", "sequential",
                                  "sequential_without_input"])
def test_several_steps_an_execution_train_as_one_step_a_call(form):
    """`compile(steps_per_execution=k)` (Keras's JAX trainer runs k steps in
    one compiled call): 2 and 5 steps an execution over epochs of 3 steps
    give the table (rows, slots, frequencies, versions), dense weights,
    losses and evaluation of one step a call."""
    ids, labels = data()
    runs = {}
    for steps in (1, 2, 5):
        model = make(form, False)
        model.compile(optimizer=kre.optimizers.Adagrad(
            LR, initial_accumulator_value=ACC0, epsilon=EPS), loss="mse",
            steps_per_execution=steps)
        history = model.fit(ids, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        layer = layer_of(model)
        assert int(layer.iterations.value) == 2 * (len(ids) // BATCH)
        runs[steps] = (parts(layer), model.get_layer("dense").get_weights(),
                       history.history["loss"],
                       model.evaluate(ids, labels, batch_size=BATCH, verbose=0))
    table, weights, losses, evaluation = runs[1]
    assert len(table["keys"]) == len(np.unique(ids))
    for steps in (2, 5):
        got_table, got_weights, got_losses, got_evaluation = runs[steps]
        assert sorted(got_table) == sorted(table)
        for name, value in table.items():
            np.testing.assert_allclose(got_table[name], value, rtol=1e-6,
                                       err_msg=f"{steps} steps: {name}")
        for a, b in zip(got_weights, weights):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(got_losses, losses, rtol=1e-6)
        np.testing.assert_allclose(got_evaluation, evaluation, rtol=1e-6)
