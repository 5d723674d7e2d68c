"""Incremental checkpoints of a model trained from a real Kafka topic (tansu
broker of conftest.py): every link holds the Kafka position, and a resume
from the restored chain continues there (at-least-once, nothing lost)."""

import glob
import json
import os

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.data import KafkaDataset

BATCH = 8
MESSAGES = 80  # 10 batches


def _model():
    keras.utils.set_random_seed(0)
    ids = keras.Input((1,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(4, combiner="sum", name="ids")
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model, ev


def _dataset(broker, topic):
    # A bounded spec (length MESSAGES) with eof: every pass ends, so the test
    # cannot hang on the stream.
    ds = KafkaDataset([f"{topic}:0:0:{MESSAGES}"], servers=broker.address, eof=True,
                      timeout=500, batch_size=BATCH, broker_timeout=20000)
    # Message i carries id i: a trained id says which message was trained.
    train = ds.map(lambda v: (tf.reshape(tf.strings.to_number(v, tf.int64), [-1, 1]),
                              tf.ones([tf.size(v), 1])))
    return ds, train


def _meta(path):
    with np.load(path, allow_pickle=False) as z:
        return json.loads(z["__meta__"].tobytes().decode())


def _keys(ev):
    return set(np.asarray(ev.table.export()["keys"]).tolist())


def test_links_hold_the_kafka_position_and_resume_continues_there(broker, tmp_path):
    topic = broker.create_topic()
    broker.produce(topic, [str(i).encode() for i in range(MESSAGES)])
    directory = str(tmp_path / "chain")

    # First trainer: 8 steps; links after steps 1 (full), 3, 5 (full), 7.
    # Step 8 is trained but never saved: the "crash" loses it.
    model, ev = _model()
    ds, train = _dataset(broker, topic)
    cb = kre.callbacks.CheckpointCallback(
        directory, full_every_steps=4, incremental_every_steps=2, keep=2,
        save_on_train_end=False, kafka_position=ds)
    model.fit(train, steps_per_epoch=8, epochs=1, verbose=0, callbacks=[cb])
    assert ds.offsets() == {(topic, 0): 8 * BATCH}
    kinds = [os.path.basename(p).split("-")[-1] for p in cb.saves]
    assert kinds == ["full.npz", "incremental.npz", "full.npz", "incremental.npz"]
    for path, step in zip(cb.saves, (1, 3, 5, 7)):
        meta = _meta(path)
        assert meta["step"] == step
        # The position of exactly the messages trained by that step.
        assert meta["kafka"] == [[topic, 0, step * BATCH]], (path, meta["kafka"])
    trained_first = _keys(ev)
    assert trained_first == set(range(8 * BATCH))

    # Resume in a fresh model and dataset from the directory.
    model2, ev2 = _model()
    ds2, train2 = _dataset(broker, topic)
    cb2 = kre.callbacks.CheckpointCallback(
        directory, full_every_steps=4, incremental_every_steps=2, keep=2,
        kafka_position=ds2)
    info = cb2.restore(model2)
    assert [os.path.basename(p) for p in info["links"]] == [
        os.path.basename(p) for p in cb.saves[2:]]
    assert info["step"] == 7 and info["kafka"] == [[topic, 0, 7 * BATCH]]
    assert ds2.offsets() == {(topic, 0): 7 * BATCH}
    # The restored tables hold every message up to the saved position (none
    # lost) and none after it (the state of the last link).
    assert _keys(ev2) == set(range(7 * BATCH))
    assert int(model2.optimizer.iterations.numpy()) == 7

    read_again = []
    watch = train2.map(lambda x, y: (tf.numpy_function(
        lambda a: read_again.extend(a.reshape(-1).tolist()) or a, [x], tf.int64), y))
    watch = watch.map(lambda x, y: (tf.ensure_shape(x, [None, 1]), y))
    # (steps_per_epoch: when a dataset of unknown length runs out, stock
    # Keras still counts one more optimizer iteration.)
    model2.fit(watch, steps_per_epoch=3, epochs=1, verbose=0, callbacks=[cb2])
    # The resumed stream starts at the saved offset: it re-reads only what the
    # first trainer read after its last link (step 8), then the rest.
    assert read_again == list(range(7 * BATCH, MESSAGES))
    reread = set(read_again) & trained_first
    assert reread == set(range(7 * BATCH, 8 * BATCH))
    assert ds2.offsets() == {(topic, 0): MESSAGES}
    assert _keys(ev2) == set(range(MESSAGES))
    assert int(model2.optimizer.iterations.numpy()) == MESSAGES // BATCH

    # The resumed trainer continued the same chain, position in every link.
    new = [p for p in cb2.saves]
    assert new, "the resumed run saved nothing"
    assert _meta(new[0])["parent"] == os.path.basename(cb.saves[-1])
    assert _meta(new[-1])["kafka"] == [[topic, 0, MESSAGES]]
    for path in new:
        meta = _meta(path)
        assert meta["kafka"] == [[topic, 0, meta["step"] * BATCH]]

    # A third restore from the whole directory reaches the end of the topic.
    model3, ev3 = _model()
    ds3, _ = _dataset(broker, topic)
    info3 = kre.IncrementalCheckpointer(model3, directory, kafka_position=ds3).restore()
    assert info3["kafka"] == [[topic, 0, MESSAGES]]
    assert ds3.offsets() == {(topic, 0): MESSAGES}
    assert _keys(ev3) == set(range(MESSAGES))
    for a, b in zip(model2.trainable_variables, model3.trainable_variables):
        if not getattr(a, "table", None):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    assert sorted(glob.glob(os.path.join(directory, ".tmp-*"))) == []
