"""keras_rec_emb's optimizers under Keras's JAX backend: the optimizer given
to `model.compile` trains the tables (in the lookup's backward) and the
dense weights, each to NumPy's numbers."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_rec_emb import optimizers
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.options import EmbeddingVariableOption, InitializerOption

DIM, FEATURES, BATCH, STEPS = 3, 2, 4, 3



def _with_meta(default_value_dim):
    # Frequencies and versions are kept only when asked for (as under
    # TensorFlow): they show here which step updated each key, and how often.
    return EmbeddingVariableOption(init_option=InitializerOption(default_value_dim=default_value_dim),
                                   track_meta=True)

def numpy_rule(name, c):
    """Keras's element-wise update of `name` with config `c`, in float64:
    step(state, key, param, grad, t, lr) -> new param (t: the step, 0-based)."""

    def slot(state, key, name, init, like):
        return state.setdefault((key, name), np.full(np.shape(like), init, np.float64))

    def step(state, key, p, g, t, lr):
        if name == "SGD" and not c.get("momentum"):
            return p - lr * g
        if name == "SGD":
            m = c["momentum"] * slot(state, key, "m", 0.0, p) - lr * g
            state[(key, "m")] = m
            return p + c["momentum"] * m - lr * g if c.get("nesterov") else p + m
        if name == "Adagrad":
            acc = slot(state, key, "acc", c.get("initial_accumulator_value", 0.1), p) + g * g
            state[(key, "acc")] = acc
            return p - lr * g / np.sqrt(acc + 1e-7)
        if name == "AdamAsync":
            b1, b2 = c.get("beta_1", 0.9), c.get("beta_2", 0.999)
            p1, p2 = slot(state, key, "p1", b1, 0.0), slot(state, key, "p2", b2, 0.0)
            alpha = lr * np.sqrt(1 - p2) / (1 - p1)
            m = b1 * slot(state, key, "m", 0.0, p) + (1 - b1) * g
            v = b2 * slot(state, key, "v", 0.0, p) + (1 - b2) * g * g
            state[(key, "m")], state[(key, "v")] = m, v
            state[(key, "p1")], state[(key, "p2")] = p1 * b1, p2 * b2
            return p - alpha * m / (np.sqrt(v) + 1e-8)
        if name == "AdagradDecay":
            init = c["initial_accumulator_value"]
            acc, last = slot(state, key, "acc", init, p), slot(state, key, "last", 0.0, 0.0)
            if (t + 1) // c["accumulator_decay_step"] > last:
                acc = np.maximum(acc * c["accumulator_decay_rate"], init)
                state[(key, "last")] = last + 1
            acc = acc + g * g
            state[(key, "acc")] = acc
            return p - lr * g / np.sqrt(acc + 1e-7)
        if name == "AdamW":  # decoupled decay first, then Adam
            p = p - p * c["weight_decay"] * lr
            # epsilon defaults to 1e-8 as DeepRec's (not Keras's AdamW's 1e-7).
            return numpy_rule("Adam", {"epsilon": 1e-8, **c})(state, key, p, g, t, lr)
        if name == "Adam":
            b1, b2 = c.get("beta_1", 0.9), c.get("beta_2", 0.999)
            m = slot(state, key, "m", 0.0, p) + (g - slot(state, key, "m", 0.0, p)) * (1 - b1)
            v = slot(state, key, "v", 0.0, p) + (g * g - slot(state, key, "v", 0.0, p)) * (1 - b2)
            state[(key, "m")], state[(key, "v")] = m, v
            alpha = lr * np.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))
            return p - alpha * m / (np.sqrt(v) + c.get("epsilon", 1e-7))
        assert name == "Ftrl"
        power = c.get("learning_rate_power", -0.5)
        l1, l2 = c["l1_regularization_strength"], c["l2_regularization_strength"]
        l2 = l2 + c["beta"] / (2 * lr)
        acc = slot(state, key, "acc", c.get("initial_accumulator_value", 0.1), p)
        lin = slot(state, key, "lin", 0.0, p)
        new_acc = acc + g * g
        lin = lin + g + 2 * c["l2_shrinkage_regularization_strength"] * p - (
            new_acc ** -power - acc ** -power) / lr * p
        quadratic = new_acc ** -power / lr + 2 * l2
        state[(key, "acc")], state[(key, "lin")] = new_acc, lin
        return (np.clip(lin, -l1, l1) - lin) / quadratic

    return step


def numpy_fit(defaults, kernel, bias, ids, labels, step, lr_at):
    """MSE training batch by batch by hand, the table and the Dense layer
    by one rule; a table row is updated once per step from its summed
    gradient."""
    table, state = {}, {}
    kernel, bias = kernel.astype(np.float64), bias.astype(np.float64)
    for t in range(len(ids) // BATCH):
        k, y = ids[t * BATCH:(t + 1) * BATCH], labels[t * BATCH:(t + 1) * BATCH]
        for key in k.ravel():
            table.setdefault(int(key), defaults[key % len(defaults)].astype(np.float64))
        rows = np.stack([table[int(key)] for key in k.ravel()]).reshape(len(k), -1)
        d = 2.0 * (rows @ kernel + bias - y) / len(k)
        d_rows = (d @ kernel.T).reshape(-1, DIM)
        lr = lr_at(t)
        kernel = step(state, "kernel", kernel, rows.T @ d, t, lr)
        bias = step(state, "bias", bias, d.sum(0), t, lr)
        flat = k.ravel()
        for key in np.unique(flat):
            table[int(key)] = step(state, int(key), table[int(key)], d_rows[flat == key].sum(0),
                                   t, lr)
    return table, kernel, bias


def fit(optimizer):
    layer = EmbeddingVariable(DIM, ev_option=_with_meta(5),
                              initializer=keras.initializers.RandomUniform(seed=1))
    inputs = keras.Input(shape=(FEATURES,), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=3),
                               bias_initializer="ones")
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=optimizer, loss="mse")
    kernel, bias = (w.copy() for w in dense.get_weights())
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 9, size=(STEPS * BATCH, FEATURES)).astype(np.int32)
    labels = rng.normal(size=(STEPS * BATCH, 1)).astype(np.float32)
    model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    fit.model = model  # the last one, for the saving test
    return layer, dense, (layer.default_values, kernel, bias, ids, labels)


CASES = [
    ("SGD", {"learning_rate": 0.05}),
    ("SGD", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}),
    ("Adagrad", {"learning_rate": 0.05, "initial_accumulator_value": 0.2}),
    ("Adam", {"learning_rate": 0.01, "beta_1": 0.8}),
    ("AdamAsync", {"learning_rate": 0.01, "beta_1": 0.8}),
    ("AdagradDecay", {"learning_rate": 0.05, "initial_accumulator_value": 0.2,
                      "accumulator_decay_step": 2, "accumulator_decay_rate": 0.5}),
    ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1}),
    ("Ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01,
              "l2_regularization_strength": 0.02, "beta": 0.1,
              "l2_shrinkage_regularization_strength": 0.01}),
]


@pytest.mark.parametrize("name, config", CASES, ids=[f"{n}-{len(c)}" for n, c in CASES])
def test_compiled_optimizer_trains_tables_and_dense_weights_to_numpys_numbers(name, config):
    layer, dense, start = fit(getattr(optimizers, name)(**config))
    table, kernel, bias = numpy_fit(*start, numpy_rule(name, config),
                                    lambda t: config["learning_rate"])
    e = layer.export()
    order = np.argsort(e["keys"])
    np.testing.assert_array_equal(e["keys"][order], sorted(table))
    np.testing.assert_allclose(e["values"][order], [table[int(k)] for k in e["keys"][order]],
                               rtol=2e-5, atol=1e-6)
    got_kernel, got_bias = dense.get_weights()
    np.testing.assert_allclose(got_kernel, kernel, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got_bias, bias, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(e["versions"].max(), STEPS - 1)


def test_adamw_defaults_to_keras_weight_decay():
    """`AdamW()` decays by 0.004 as keras.optimizers.AdamW does (keras-rs's
    examples rely on it); a large learning rate makes the decay visible."""
    default, keras_default = optimizers.AdamW(), keras.optimizers.AdamW()
    assert default.weight_decay == keras_default.weight_decay == 0.004
    assert float(default.learning_rate) == float(keras_default.learning_rate)
    layer, dense, start = fit(optimizers.AdamW(learning_rate=0.5))
    e = layer.export()
    got = dict(zip(e["keys"].tolist(), e["values"]))
    errors = {}
    for wd in (0.004, 0.0):
        table, kernel, _ = numpy_fit(*start, numpy_rule("AdamW", {"weight_decay": wd}),
                                     lambda t: 0.5)
        assert got.keys() == table.keys()
        errors[wd] = max(np.abs(dense.get_weights()[0] - kernel).max(),
                         max(np.abs(got[k] - table[k]).max() for k in got))
    # float32 at learning rate 0.5 drifts by ~1e-5; without the decay it is 1e-3 off.
    assert errors[0.004] < 1e-4 and errors[0.0] > 1e-3, errors


def test_a_learning_rate_schedule_follows_the_step():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    layer, dense, start = fit(optimizers.Adagrad(schedule))
    table, kernel, bias = numpy_fit(*start, numpy_rule("Adagrad", {}),
                                    lambda t: 0.2 * 0.5 ** t)
    e = layer.export()
    np.testing.assert_allclose(e["values"], [table[int(k)] for k in e["keys"]], rtol=2e-5,
                               atol=1e-6)
    np.testing.assert_allclose(dense.get_weights()[0], kernel, rtol=2e-5, atol=1e-6)


def test_table_slots_are_the_optimizers():
    layer, _, _ = fit(optimizers.Adam(0.01, amsgrad=True))
    assert layer._kre_slot_specs == [("momentum", DIM), ("velocity", DIM),
                                     ("velocity_hat", DIM)]
    slots = layer.export()["slots"]
    assert list(slots) == ["momentum", "velocity", "velocity_hat"]
    assert all(rows.shape == (layer.table_size(), DIM) for rows in slots.values())


@pytest.mark.parametrize("setting", [{"clipnorm": 1.0}, {"clipvalue": 0.5},
                                     {"global_clipnorm": 1.0}, {"use_ema": True},
                                     {"gradient_accumulation_steps": 2},
                                     {"loss_scale_factor": 8.0}])
def test_settings_the_table_update_cannot_honour_are_refused(setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"does not support `{name}`.*{name}="):
        fit(optimizers.SGD(0.1, **setting))


def test_an_optimizer_without_a_table_rule_is_refused():
    with pytest.raises(ValueError, match="no optimizer for its table"):
        fit(keras.optimizers.RMSprop(0.1))  # a stock one trains the dense weights only
    with pytest.raises(TypeError, match="SGD, Adagrad, Adam, Ftrl, AdamAsync.*RMSprop"):
        EmbeddingVariable(DIM, optimizer=keras.optimizers.RMSprop(0.1))
    with pytest.raises(ValueError, match="`table_rule` must be one of"):
        optimizers.Ftrl(table_rule="group")


@pytest.mark.parametrize("make, message", [
    (lambda: optimizers.AdamAsync(beta_1=1.0),
     r"`beta_1` must be a finite float in \[0, 1\)\. Received: beta_1=1\.0"),
    (lambda: optimizers.AdamAsync(epsilon=-1.0),
     "`epsilon` must be a non-negative finite float. Received: epsilon=-1.0"),
    (lambda: optimizers.AdamAsync(-0.5), "`learning_rate` must be a non-negative finite float"),
    (lambda: optimizers.AdagradDecay(accumulator_decay_step=0),
     "`accumulator_decay_step` must be a positive integer. Received: accumulator_decay_step=0"),
    (lambda: optimizers.AdagradDecay(accumulator_decay_rate=1.5),
     r"`accumulator_decay_rate` must be a float in \(0, 1\]"),
    (lambda: optimizers.AdagradDecay(initial_accumulator_value=0.0),
     "`initial_accumulator_value` must be a float > 0"),
    (lambda: optimizers.AdamW(-0.1), "`weight_decay` must be a non-negative finite float"),
    # Keras's namesakes accept these; the TensorFlow backend's classes do not.
    (lambda: optimizers.SGD(-1.0), "`learning_rate` must be a non-negative finite float. "
     "Received: learning_rate=-1.0"),
    (lambda: optimizers.SGD(0.1, momentum=1.5), r"`momentum` must be a finite float in \[0, 1\]"),
    (lambda: optimizers.Adam(beta_2=1.0), r"`beta_2` must be a finite float in \[0, 1\)"),
    (lambda: optimizers.Adagrad(epsilon=float("nan")), "`epsilon` must be a non-negative"),
    (lambda: optimizers.Ftrl(l1_regularization_strength=-1.0),
     "`l1_regularization_strength` must be a non-negative finite float"),
])
def test_bad_arguments_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_arguments_of_the_wrong_kind_are_type_errors():
    with pytest.raises(TypeError, match="`beta_1` must be a finite float in"):
        optimizers.AdamAsync(beta_1="0.9")
    with pytest.raises(TypeError, match="`learning_rate` must be a non-negative finite float"):
        optimizers.Adagrad(learning_rate=[0.1])
    with pytest.raises(TypeError, match="`scale_weight_decay_by_learning_rate` must be a bool"):
        optimizers.AdamW(0.1, scale_weight_decay_by_learning_rate="no")


def test_argument_checks_import_no_tensorflow():
    # The options and the JAX optimizers check their arguments with these.
    code = ("import sys, keras_rec_emb._checks_core, keras_rec_emb.options; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=dict(os.environ, KERAS_BACKEND="jax"))


@pytest.mark.parametrize("optimizer", [
    optimizers.Ftrl(0.3, l1_regularization_strength=0.1, table_rule="deeprec"),
    optimizers.AdamAsync(0.2, beta_2=0.9, use_nesterov=True),
    optimizers.AdagradDecay(0.2, accumulator_decay_step=7, accumulator_decay_rate=0.3),
    optimizers.AdamW(0.05, 0.2)], ids=lambda o: type(o).__name__)
def test_optimizers_round_trip_through_their_config(optimizer):
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(again) is type(optimizer)
    assert again.get_config() == optimizer.get_config()


def test_docstring_examples_run():
    """Every class's Example is the shared template with its own name (the
    template's training runs here once, for SGD; each optimizer's training
    is checked against NumPy above)."""
    import doctest

    import keras_rec_emb

    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    globs = {"keras": keras, "np": np, "keras_rec_emb": keras_rec_emb}
    found = {}
    from keras_rec_emb.optimizers import deeprec_optimizers, keras_optimizers, loss_scale

    for module in (keras_optimizers, deeprec_optimizers, loss_scale):
        for test in finder.find(module, globs=dict(globs)):
            if test.examples and test.name.rsplit(".", 1)[0] == module.__name__:
                found[test.name.rsplit(".", 1)[1]] = test
    names = set(keras_rec_emb.optimizers.__all__)
    assert names <= set(found), names - set(found)
    for name in names:
        source = "".join(e.source for e in found[name].examples)
        assert f"keras_rec_emb.optimizers.{name}(" in source and "model.fit(" in source, name
    assert runner.run(found["SGD"], out=lambda text: None).failed == 0
