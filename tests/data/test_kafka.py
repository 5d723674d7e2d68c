"""Kafka datasets against a real tansu broker started by conftest.py."""

import csv
import io
import json
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_rec_emb.data import DataFrame
from keras_rec_emb.data import KafkaDataset
from keras_rec_emb.data import KafkaGroupIODataset
from keras_rec_emb.data import decode_csv
from keras_rec_emb.data import decode_example
from keras_rec_emb.data import decode_json
from _broker import free_port

GROUP_CONFIG = ["auto.offset.reset=earliest", "max.poll.interval.ms=10000",
                "session.timeout.ms=6000", "heartbeat.interval.ms=500"]


def messages(prefix, count, start=0):
    return [f"{prefix}{i}".encode() for i in range(start, start + count)]


def values(dataset):
    """Every message value, flattening batches."""
    out = []
    for element in dataset:
        out.extend(np.reshape(element.numpy(), [-1]).tolist())
    return out


def test_partitions_offsets_and_length(broker):
    topic = broker.create_topic(partitions=2)
    broker.produce(topic, messages("a", 10), partition=0)
    broker.produce(topic, messages("b", 6), partition=1)
    dataset = KafkaDataset([f"{topic}:0:3:4", f"{topic}:1"],
                           servers=broker.address, eof=True, timeout=500)
    assert dataset.element_spec == tf.TensorSpec([], tf.string)
    got = values(dataset)
    assert [v for v in got if v.startswith(b"a")] == messages("a", 4, start=3)
    assert [v for v in got if v.startswith(b"b")] == messages("b", 6)
    assert dataset.offsets() == {(topic, 0): 7, (topic, 1): 6}
    # From the beginning (-2), 5 messages; a finite range ends without eof.
    assert values(KafkaDataset([f"{topic}:1:-2:5"], servers=broker.address,
                               timeout=500)) == messages("b", 5)


def test_eof_with_batched_producer(broker):
    """tansu's watermark is wrong for batched records; EOF still works."""
    topic = broker.create_topic()
    broker.produce(topic, messages("m", 500), batched=True)
    dataset = KafkaDataset([f"{topic}:0:0:-1"], servers=broker.address,
                           eof=True, timeout=500, batch_size=64)
    batches = [b.numpy().tolist() for b in dataset]
    assert [len(b) for b in batches] == [64] * 7 + [52]
    assert sum(batches, []) == messages("m", 500)
    assert dataset.offsets() == {(topic, 0): 500}


def test_message_keys(broker):
    topic = broker.create_topic()
    keys = [f"k{i}".encode() for i in range(5)]
    broker.produce(topic, messages("v", 5), keys=keys)
    scalar = KafkaDataset([topic], servers=broker.address, eof=True,
                          timeout=500, message_key=True)
    assert [(k.numpy(), v.numpy()) for k, v in scalar] == list(
        zip(keys, messages("v", 5)))
    batched = KafkaDataset([topic], servers=broker.address, eof=True,
                           timeout=500, message_key=True, batch_size=3)
    assert batched.element_spec == (tf.TensorSpec([None], tf.string),) * 2
    pairs = [(k.numpy().tolist(), v.numpy().tolist()) for k, v in batched]
    assert pairs == [(keys[:3], messages("v", 3)),
                     (keys[3:], messages("v", 2, start=3))]


def test_checkpoint_resumes_exactly_after_last_message(broker, tmp_path):
    topic = broker.create_topic(partitions=2)
    broker.produce(topic, messages("p0-", 30), partition=0)
    broker.produce(topic, messages("p1-", 20), partition=1)
    specs = [f"{topic}:0", f"{topic}:1"]

    def dataset():
        return KafkaDataset(specs, servers=broker.address, eof=True,
                            timeout=500, batch_size=7)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    first = dataset()
    iterator = iter(first)
    before = sum((next(iterator).numpy().tolist() for _ in range(3)), [])
    path = tf.train.Checkpoint(model=model, data=first.position).write(
        str(tmp_path / "ckpt"))
    saved = first.offsets()
    assert sum(saved.values()) == 21

    second = dataset()
    tf.train.Checkpoint(model=model, data=second.position).read(path)
    assert second.offsets() == saved
    after = values(second)
    everything = messages("p0-", 30) + messages("p1-", 20)
    assert sorted(before + after) == sorted(everything)
    assert len(before + after) == len(everything)  # nothing read twice


def test_unreachable_broker_names_the_address():
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"servers='{address}'.*500 ms"):
        KafkaDataset(["t"], servers=address, timeout=500)
    with pytest.raises(ValueError, match=f"servers='{address}'"):
        KafkaGroupIODataset(["t"], "g", address, message_poll_timeout=500)


@pytest.mark.parametrize("spec", ["", "t:x", "t:0:0:-1:9", "t:-1", "t:0:-3",
                                  "t:0:0:-2", "bad topic:0", ":0"])
def test_malformed_topic_spec(spec, broker):
    with pytest.raises(ValueError, match=f"`topics` entries.*{spec!r}"):
        KafkaDataset([spec], servers=broker.address)


def test_bad_kafka_arguments(broker):
    with pytest.raises(ValueError, match="`config_global` entries.*'oops'"):
        KafkaDataset(["t"], servers=broker.address, config_global=["oops"])
    with pytest.raises(ValueError, match="`timeout`.*timeout=-5"):
        KafkaDataset(["t"], servers=broker.address, timeout=-5)
    with pytest.raises(ValueError, match="names a partition twice"):
        KafkaDataset(["t:0", "t:0:5"], servers=broker.address)
    with pytest.raises(ValueError, match="batch_size=0"):
        KafkaGroupIODataset(["t"], "g", broker.address, batch_size=0)
    with pytest.raises(ValueError, match="stream_timeout=-2"):
        KafkaGroupIODataset(["t"], "g", broker.address, stream_timeout=-2)


def test_decoders_on_message_batches(broker):
    topic = broker.create_topic()
    rows = [(i, i * 0.5, f"tag{i}") for i in range(10)]
    lines = []
    for row in rows:
        buffer = io.StringIO()
        csv.writer(buffer).writerow(row)
        lines.append(buffer.getvalue().strip().encode())
    broker.produce(topic, lines)
    dataset = KafkaDataset([topic], servers=broker.address, eof=True,
                           timeout=500, batch_size=4).map(
        decode_csv([0, 0.0, ""], names=["id", "score", "tag"]))
    got = {k: [] for k in ("id", "score", "tag")}
    for batch in dataset:
        for k in got:
            got[k] += batch[k].numpy().tolist()
    assert got == {"id": [r[0] for r in rows],
                   "score": [np.float32(r[1]) for r in rows],
                   "tag": [r[2].encode() for r in rows]}

    json_topic = broker.create_topic()
    records = [{"user": i, "items": list(range(i % 3)), "name": f"n\"{i}",
                "ok": i % 2 == 0} for i in range(6)]
    broker.produce(json_topic, [json.dumps(r).encode() for r in records])
    decode = decode_json([DataFrame.Field("user", tf.int64),
                          DataFrame.Field("items", tf.int32, ragged_rank=1),
                          DataFrame.Field("name", tf.string),
                          DataFrame.Field("ok", tf.bool)])
    batch = next(iter(KafkaDataset([json_topic], servers=broker.address,
                                   eof=True, timeout=500,
                                   batch_size=6).map(decode)))
    assert batch["user"].numpy().tolist() == [r["user"] for r in records]
    assert batch["items"].to_list() == [r["items"] for r in records]
    assert batch["name"].numpy().tolist() == [r["name"].encode()
                                              for r in records]
    assert batch["ok"].numpy().tolist() == [r["ok"] for r in records]

    example_topic = broker.create_topic()
    examples = [tf.train.Example(features=tf.train.Features(feature={
        "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
        "ids": tf.train.Feature(int64_list=tf.train.Int64List(
            value=list(range(i))))})).SerializeToString() for i in range(4)]
    broker.produce(example_topic, examples)
    decode = decode_example({"id": tf.io.FixedLenFeature([], tf.int64),
                             "ids": tf.io.RaggedFeature(tf.int64)})
    batch = next(iter(KafkaDataset([example_topic], servers=broker.address,
                                   eof=True, timeout=500,
                                   batch_size=4).map(decode)))
    assert batch["id"].numpy().tolist() == [0, 1, 2, 3]
    assert batch["ids"].to_list() == [list(range(i)) for i in range(4)]


def test_online_training_on_a_live_topic(broker):
    """model.fit with steps_per_epoch on a stream that is still produced to."""
    topic = broker.create_topic()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 2)).astype(np.float32)
    y = x @ np.array([2.0, -1.0], np.float32) + 0.5
    lines = [f"{a},{b},{c}".encode() for (a, b), c in zip(x, y)]
    broker.produce(topic, lines[:160])
    producer = threading.Thread(target=broker.produce,
                                args=(topic, lines[160:]))
    dataset = KafkaDataset([topic], servers=broker.address, timeout=500,
                           batch_size=32)
    train = dataset.map(decode_csv([0.0, 0.0, 0.0])).map(
        lambda a, b, c: (tf.stack([a, b], axis=1), c))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    producer.start()
    history = model.fit(train, steps_per_epoch=5, epochs=2, verbose=0)
    producer.join()
    assert dataset.offsets() == {(topic, 0): 320}  # 2 epochs x 5 x 32
    assert history.history["loss"][1] < history.history["loss"][0]


def test_consumer_group_splits_partitions(broker):
    topic = broker.create_topic(partitions=4)
    group = f"g-{topic}"
    received = {"a": [], "b": []}

    def consume(name):
        dataset = KafkaGroupIODataset(
            [topic], group, broker.address, stream_timeout=4000,
            message_poll_timeout=250, configuration=GROUP_CONFIG)
        for value in dataset:
            received[name].append(value.numpy().decode())

    threads = [threading.Thread(target=consume, args=(n,)) for n in "ab"]
    for thread in threads:
        thread.start()
    produced = []
    for round_ in range(200):  # until both consumers get a share of a round
        batch = [f"{round_}-{p}" for p in range(4)]
        for p, value in enumerate(batch):
            broker.produce(topic, [value.encode()], partition=p)
        produced += batch
        time.sleep(0.25)
        if all(set(batch) & set(r) for r in received.values()):
            break
    final = [f"final-{p}-{i}" for i in range(5) for p in range(4)]
    for i, value in enumerate(final):
        broker.produce(topic, [value.encode()], partition=i % 4)
    for thread in threads:
        thread.join(120)
    a, b = received["a"], received["b"]
    assert sorted(a + b) == sorted(produced + final)  # none lost, none twice
    partitions_a = {v.split("-")[1] for v in a if v.startswith("final")}
    partitions_b = {v.split("-")[1] for v in b if v.startswith("final")}
    assert partitions_a and partitions_b
    assert not partitions_a & partitions_b


def test_group_resumes_from_committed_offsets_and_checkpoints(broker, tmp_path):
    topic = broker.create_topic(partitions=2)
    broker.produce(topic, messages("x", 10), partition=0)
    broker.produce(topic, messages("y", 10), partition=1)

    def dataset(group):
        return KafkaGroupIODataset([topic], group, broker.address,
                                   stream_timeout=0, message_poll_timeout=1500,
                                   configuration=GROUP_CONFIG, batch_size=5)

    first = dataset(f"g-{topic}")
    iterator = iter(first)
    taken = next(iterator).numpy().tolist() + next(iterator).numpy().tolist()
    path = tf.train.Checkpoint(data=first.position).write(str(tmp_path / "c"))
    rest = sum((b.numpy().tolist() for b in iterator), [])
    assert sorted(taken + rest) == sorted(messages("x", 10) + messages("y", 10))
    # Same group, no checkpoint: everything is committed, nothing to read.
    assert values(dataset(f"g-{topic}")) == []
    # A restored checkpoint overrides the group's offsets (here a new group,
    # which would otherwise start from the beginning).
    restored = dataset(f"other-{topic}")
    tf.train.Checkpoint(data=restored.position).read(path)
    assert sorted(values(restored)) == sorted(rest)


def test_broker_restart_mid_stream(persistent_broker):
    """The consumer reconnects and reads every acknowledged message once."""
    topic = persistent_broker.create_topic()
    persistent_broker.produce(topic, messages("m", 40))
    dataset = KafkaDataset([f"{topic}:0:0:80"], servers=persistent_broker.address,
                           timeout=500, batch_size=10)
    iterator = iter(dataset)
    got = sum((next(iterator).numpy().tolist() for _ in range(2)), [])
    persistent_broker.stop()
    persistent_broker.start()
    persistent_broker.produce(topic, messages("m", 40, start=40))
    reader = threading.Thread(
        target=lambda: got.extend(sum((b.numpy().tolist() for b in iterator),
                                      [])), daemon=True)
    reader.start()
    reader.join(120)
    assert not reader.is_alive(), "consumer did not recover after restart"
    assert got == messages("m", 80)
    assert dataset.offsets() == {(topic, 0): 80}
