"""A JAX `EmbeddingVariable` with its own optimizer (`optimizer=`): a
learning rate assigned after the training step was traced
(`layer.optimizer.learning_rate = x`, `.assign(x)`, a callback between
epochs) reaches the table, to NumPy's Adagrad numbers."""

import keras
import numpy as np

import keras_rec_emb as kre

DIM, DVD, BATCH, L = 2, 5, 4, 3


def numpy_adagrad(defaults, batches, labels, rates, init=0.1, eps=1e-7):
    """loss = mean((sum of the summed rows - y)**2) per batch; the table by
    Adagrad at `rates[t]` (equal keys summed)."""
    table, acc = {}, {}
    for ids, y, lr in zip(batches, labels, rates):
        for key in ids.ravel():
            table.setdefault(int(key), defaults[key % DVD].astype(np.float64))
            acc.setdefault(int(key), np.full(DIM, init))
        pred = np.array([sum(table[int(k)] for k in row).sum() for row in ids])
        d = 2.0 * (pred - y[:, 0]) / len(ids)
        grads = {}
        for row, dr in zip(ids, d):
            for key in row:
                grads[int(key)] = grads.get(int(key), 0.0) + dr * np.ones(DIM)
        for key, g in grads.items():
            acc[key] = acc[key] + g * g
            table[key] = table[key] - lr * g / np.sqrt(acc[key] + eps)
    return table


def _model():
    layer = kre.layers.EmbeddingVariable(
        DIM, combiner="sum", default_value_dim=DVD, optimizer=kre.optimizers.Adagrad(0.1),
        initializer=keras.initializers.RandomUniform(seed=4))
    ids = keras.Input(shape=(L,), dtype="int32")
    model = keras.Model(ids, keras.ops.sum(layer(ids), axis=-1, keepdims=True))
    # The compiled optimizer trains nothing here (the table has its own).
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model, layer


def _data(steps):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 7, size=(steps * BATCH, L)).astype(np.int32)
    labels = rng.normal(size=(steps * BATCH, 1)).astype(np.float32)
    return ids, labels


def _table(layer):
    data = layer.export()
    return {int(k): data["values"][i] for i, k in enumerate(data["keys"])}


def _check(layer, ids, labels, rates):
    batches = [ids[t * BATCH:(t + 1) * BATCH] for t in range(len(rates))]
    ys = [labels[t * BATCH:(t + 1) * BATCH] for t in range(len(rates))]
    want = numpy_adagrad(layer.default_values, batches, ys, rates)
    got = _table(layer)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_rate_assigned_between_fits_reaches_the_table():
    model, layer = _model()
    ids, labels = _data(6)
    kwargs = dict(batch_size=BATCH, shuffle=False, verbose=0)
    model.fit(ids[:8], labels[:8], **kwargs)  # traced at 0.1
    layer.optimizer.learning_rate = 0.02
    model.fit(ids[8:16], labels[8:16], **kwargs)
    layer.optimizer.learning_rate.assign(0.5)
    model.fit(ids[16:], labels[16:], **kwargs)
    _check(layer, ids, labels, [0.1, 0.1, 0.02, 0.02, 0.5, 0.5])
    assert float(layer.optimizer.learning_rate) == 0.5


def test_a_rate_set_by_a_callback_between_epochs_reaches_the_table():
    model, layer = _model()
    ids, labels = _data(4)
    rates = [0.1, 0.03]
    scheduler = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: setattr(layer.optimizer, "learning_rate",
                                                   rates[epoch]))
    model.fit(ids[:8], labels[:8], batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[scheduler])
    batches = np.concatenate([ids[:8], ids[:8]])
    ys = np.concatenate([labels[:8], labels[:8]])
    _check(layer, batches, ys, [0.1, 0.1, 0.03, 0.03])


def test_the_saved_config_has_the_assigned_rate(tmp_path):
    model, layer = _model()
    ids, labels = _data(2)
    model.fit(ids, labels, batch_size=BATCH, shuffle=False, verbose=0)
    layer.optimizer.learning_rate = 0.25
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    table = [x for x in loaded.layers if isinstance(x, kre.layers.EmbeddingVariable)][0]
    np.testing.assert_allclose(float(table.optimizer.learning_rate), 0.25)
