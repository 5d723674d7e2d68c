"""The first `fit` (and `evaluate`) after `compile` on a Kafka dataset, read
from the real tansu broker of conftest.py, and `predict` of a model not built
yet, read every record under both backends: the batch Keras's JAX trainer
reads to build the model and its loss and metrics (`Trainer._symbolic_build`,
the start of `predict`) is the epoch's first, not one the stream moves past.
Checked against the same model fed the same records as NumPy arrays."""

import json

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.data import DataFrame, KafkaDataset, decode_json

pytestmark = pytest.mark.backends("tensorflow", "jax")

RECORDS, BATCH = 14, 4  # batches of 4, 4, 4, 2


def _records(broker):
    rng = np.random.default_rng(5)
    users = rng.permutation(40)[:RECORDS].astype(np.int64)
    labels = rng.normal(size=RECORDS).astype(np.float32)
    topic = broker.create_topic()
    broker.produce(topic, [json.dumps({"user": int(u), "label": float(y)}).encode()
                           for u, y in zip(users, labels)])
    return topic, users, labels


def _stream(broker, topic):
    decode = decode_json([DataFrame.Field("user", "int64"), DataFrame.Field("label", "float32")])
    ds = KafkaDataset([f"{topic}:0:0:{RECORDS}"], servers=broker.address, eof=True,
                      batch_size=BATCH)
    return ds, ds.map(decode).map(lambda d: (d["user"], d["label"]))


def _model():
    ids = keras.Input(shape=(), dtype="int64")
    table = kre.layers.EmbeddingVariable(
        3, initializer=keras.initializers.RandomUniform(seed=2), name="users")
    head = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=3))
    model = keras.Model(ids, head(table(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.2), loss="mse", metrics=["mae"])
    return model, table


class _Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def _table(layer):
    data = layer.export()
    order = np.argsort(data["keys"])
    return data["keys"][order], np.asarray(data["values"])[order]


def test_first_fit_and_evaluate_after_compile_read_every_record(broker):
    topic, users, labels = _records(broker)
    model, table = _model()
    want_model, want_table = _model()
    steps = _Steps()
    ds, stream = _stream(broker, topic)
    history = model.fit(stream, epochs=1, shuffle=False, verbose=0, callbacks=[steps])
    want = want_model.fit(users, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert steps.steps == 4
    assert ds.offsets() == {(topic, 0): RECORDS}
    keys, values = _table(table)
    want_keys, want_values = _table(want_table)
    np.testing.assert_array_equal(keys, np.sort(users))
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_allclose(values, want_values, rtol=1e-6, atol=1e-7)
    for got, expected in zip(model.get_weights(), want_model.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)

    # A new compile: the loss and metrics are unbuilt again, and evaluate
    # builds them from the stream's first batch.
    for m in (model, want_model):
        m.compile(optimizer=kre.optimizers.Adagrad(0.2), loss="mse", metrics=["mae"])
    ds, stream = _stream(broker, topic)
    got = model.evaluate(stream, verbose=0, return_dict=True)
    expected = want_model.evaluate(users, labels, batch_size=BATCH, verbose=0, return_dict=True)
    assert ds.offsets() == {(topic, 0): RECORDS}
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, err_msg=name)
    predictions = model.predict(users, batch_size=BATCH, verbose=0)[:, 0]
    np.testing.assert_allclose(got["loss"], np.mean((predictions - labels) ** 2), rtol=1e-5)


class IdsModel(keras.Model):
    """Built by its first call: `predict` builds it from a batch first."""

    def __init__(self):
        super().__init__()
        self.table = kre.layers.EmbeddingVariable(
            3, initializer=keras.initializers.RandomUniform(seed=2))
        self.head = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(
            seed=3))

    def call(self, ids):
        return self.head(self.table(ids))


def test_predict_of_an_unbuilt_model_reads_every_record(broker):
    topic, users, _ = _records(broker)
    ds, stream = _stream(broker, topic)
    model, want_model = IdsModel(), IdsModel()
    assert not model.built
    got = model.predict(stream.map(lambda x, y: x), verbose=0)
    want = want_model.predict(users, batch_size=BATCH, verbose=0)
    assert ds.offsets() == {(topic, 0): RECORDS}
    assert got.shape == want.shape == (RECORDS, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert model.table.table_size() == 0  # inference inserts nothing
