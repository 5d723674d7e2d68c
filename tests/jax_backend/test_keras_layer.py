"""EmbeddingVariable under Keras's JAX backend: `model.fit` trains the table
(in the lookup's backward) and the dense weights to NumPy's numbers."""

import keras
import numpy as np
import pytest

from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.options import EmbeddingVariableOption, InitializerOption

DIM, FEATURES, BATCH = 3, 2, 4



def _with_meta(default_value_dim):
    # Frequencies and versions are kept only when asked for (as under
    # TensorFlow): they show here which step updated each key, and how often.
    return EmbeddingVariableOption(init_option=InitializerOption(default_value_dim=default_value_dim),
                                   track_meta=True)

def data(n=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 9, size=(n, FEATURES)).astype(np.int32)
    return ids, rng.normal(size=(n, 1)).astype(np.float32)


def model_of(layer):
    inputs = keras.Input(shape=(FEATURES,), dtype="int32")
    rows = layer(inputs)
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=3),
                             bias_initializer="ones")(keras.layers.Flatten()(rows))
    return keras.Model(inputs, out)


def numpy_fit(defaults, kernel, bias, ids, labels, table_step, dense_lr):
    """One epoch of MSE training, batch by batch, by hand; `table_step`
    updates a row from its summed gradient."""
    table, state = {}, {}
    for start in range(0, len(ids), BATCH):
        k, y = ids[start:start + BATCH], labels[start:start + BATCH]
        for key in k.ravel():
            table.setdefault(int(key), defaults[key % len(defaults)].copy())
        rows = np.stack([table[int(key)] for key in k.ravel()]).reshape(len(k), -1)
        pred = rows @ kernel + bias
        d = 2.0 * (pred - y) / len(k)
        d_rows = (d @ kernel.T).reshape(-1, DIM)
        kernel = kernel - dense_lr * rows.T @ d
        bias = bias - dense_lr * d.sum(0)
        flat = k.ravel()
        for key in np.unique(flat):
            table[int(key)] = table_step(state, int(key), table[int(key)],
                                         d_rows[flat == key].sum(0))
    return table, kernel, bias


def check_table(layer, table):
    e = layer.export()
    order = np.argsort(e["keys"])
    keys = e["keys"][order]
    np.testing.assert_array_equal(keys, sorted(table))
    np.testing.assert_allclose(e["values"][order], [table[int(k)] for k in keys], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_fit_trains_table_and_dense_weights_to_numpys_numbers(rule):
    lr = 0.05
    if rule == "sgd":
        table_opt = keras.optimizers.SGD(learning_rate=lr)

        def step(state, key, row, g):
            return row - np.float32(lr) * g
    else:
        table_opt = keras.optimizers.Adagrad(learning_rate=lr, initial_accumulator_value=0.1,
                                             epsilon=1e-7)

        def step(state, key, row, g):
            acc = state.get(key, np.full(DIM, 0.1, np.float32)) + g * g
            state[key] = acc
            return row - np.float32(lr) * g / np.sqrt(acc + np.float32(1e-7))

    layer = EmbeddingVariable(DIM, optimizer=table_opt, ev_option=_with_meta(5),
                              initializer=keras.initializers.RandomUniform(seed=1))
    model = model_of(layer)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), loss="mse")
    kernel, bias = (w.copy() for w in model.layers[-1].get_weights())
    ids, labels = data()
    model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    table, kernel, bias = numpy_fit(layer.default_values, kernel, bias, ids, labels, step, lr)
    check_table(layer, table)
    got_kernel, got_bias = model.layers[-1].get_weights()
    np.testing.assert_allclose(got_kernel, kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_bias, bias, rtol=1e-5, atol=1e-6)
    assert int(layer.iterations.value) == len(ids) // BATCH
    np.testing.assert_array_equal(layer.export()["versions"].max(), len(ids) // BATCH - 1)


def test_predict_and_evaluate_do_not_insert():
    layer = EmbeddingVariable(DIM, optimizer=keras.optimizers.SGD(0.1), default_value_dim=5)
    model = model_of(layer)
    model.compile(optimizer="sgd", loss="mse")
    ids, labels = data(8)
    model.predict(ids, verbose=0)
    model.evaluate(ids, labels, verbose=0)
    assert layer.table_size() == 0
    model.fit(ids, labels, batch_size=BATCH, verbose=0)
    assert layer.table_size() == len(np.unique(ids))


def test_a_learning_rate_schedule_follows_the_layers_steps():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.5, 0.0])
    layer = EmbeddingVariable(DIM, optimizer=keras.optimizers.SGD(schedule), default_value_dim=1,
                              initializer="zeros")
    inputs = keras.Input(shape=(1,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Flatten()(layer(inputs)))
    model.compile(optimizer="sgd", loss=lambda y, p: keras.ops.sum(p, axis=-1))
    ids = np.array([[7]] * 4, np.int32)
    model.fit(ids, np.zeros((4, DIM), np.float32), batch_size=2, verbose=0)
    # d loss / d row = 1 per sample (mean over 2): step 0 at 0.5, step 1 at 0.
    np.testing.assert_allclose(layer.export()["values"], [[-0.5] * DIM])
    assert int(layer.iterations.value) == 2


@pytest.mark.parametrize("optimizer, error, message", [
    (keras.optimizers.Adamax(), TypeError, "SGD, Adagrad, Adam, Ftrl, AdamAsync"),
    (keras.optimizers.AdamW(), TypeError, "Keras's SGD, Adagrad, Adam or Ftrl"),
    (keras.optimizers.SGD(clipnorm=1.0), ValueError, r"cannot set \['clipnorm'\]"),
])
def test_unsupported_optimizers_are_refused(optimizer, error, message):
    with pytest.raises(error, match=message):
        EmbeddingVariable(DIM, optimizer=optimizer)


def test_bad_arguments():
    with pytest.raises(ValueError, match="`embedding_dim` must be a positive integer"):
        EmbeddingVariable(0, optimizer=keras.optimizers.SGD())
    with pytest.raises(ValueError, match="`key_dtype` must be one of"):
        EmbeddingVariable(2, optimizer=keras.optimizers.SGD(), key_dtype="float32")
