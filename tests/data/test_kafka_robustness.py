"""Kafka iterations that used to hang or leak consumers, against real tansu
brokers; every wait is bounded."""

import gc
import os
import threading
import time

import numpy as np
import pytest

from keras_rec_emb.data import KafkaDataset
from keras_rec_emb.data import KafkaGroupIODataset
from keras_rec_emb.data import kafka as kafka_module
from _broker import Broker


def messages(count, start=0):
    return [f"m{i}".encode() for i in range(start, start + count)]


def drain(dataset, limit_s=60):
    """Iterates `dataset` in a thread; returns (values, exception) or fails
    if it neither ends nor raises within `limit_s`."""
    result = {"values": [], "error": None}

    def run():
        try:
            for element in dataset:
                result["values"].extend(element.numpy().reshape([-1]).tolist())
        except Exception as e:
            result["error"] = e

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(limit_s)
    assert not reader.is_alive(), "the iteration neither ended nor raised"
    return result["values"], result["error"]


def test_default_broker_timeout_is_documented():
    assert kafka_module.DEFAULT_BROKER_TIMEOUT_MS == 60000
    assert "Defaults to `60000`" in KafkaDataset.__doc__
    with pytest.raises(ValueError, match="broker_timeout=-2"):
        KafkaDataset(["t"], servers="127.0.0.1:1", broker_timeout=-2)


def test_eof_on_a_partition_that_does_not_exist_raises(broker):
    topic = broker.create_topic(partitions=2)
    broker.produce(topic, messages(3))
    ds = KafkaDataset([f"{topic}:0", f"{topic}:7"], servers=broker.address, eof=True,
                      timeout=500, batch_size=10)
    _, error = drain(ds)
    assert error is not None
    assert "partition(s) [7]" in str(error) and broker.address in str(error)


@pytest.mark.parametrize("eof", [True, False])
def test_a_topic_that_does_not_exist_raises(broker, eof):
    ds = KafkaDataset(["no-such-topic-x1"], servers=broker.address, eof=eof, timeout=500)
    _, error = drain(ds)
    assert error is not None
    assert "'no-such-topic-x1' does not exist" in str(error)
    assert broker.address in str(error)


@pytest.mark.parametrize("eof", [True, False])
def test_broker_dying_mid_read_raises_naming_the_broker(tmp_path, eof):
    own = Broker(tmp_path / "broker.log")
    try:
        topic = own.create_topic()
        own.produce(topic, messages(5))
        ds = KafkaDataset([topic], servers=own.address, eof=eof, timeout=200,
                          batch_size=2, broker_timeout=1000)
        iterator = iter(ds)
        assert next(iterator).numpy().tolist() == messages(2)
        own.stop()
        result = {}

        def rest():
            try:
                for element in iterator:
                    result.setdefault("values", []).extend(element.numpy().tolist())
            except Exception as e:
                result["error"] = e

        reader = threading.Thread(target=rest, daemon=True)
        reader.start()
        reader.join(90)
        assert not reader.is_alive(), "no error after the broker died"
        assert "error" in result
        assert own.address in str(result["error"]) and "broker_timeout" in str(result["error"])
    finally:
        if own._process.poll() is None:
            own.stop()


def test_group_dataset_with_dead_broker_and_no_stream_timeout_raises(tmp_path):
    own = Broker(tmp_path / "broker.log")
    topic = own.create_topic()
    ds = KafkaGroupIODataset([topic], "g", servers=own.address, stream_timeout=-1,
                             message_poll_timeout=200, broker_timeout=1000)
    own.stop()
    _, error = drain(ds, limit_s=90)
    assert error is not None and own.address in str(error)


def _threads():
    """librdkafka threads (named rdk:...) alive in this process."""
    return sum(name.startswith("rdk:") for name in _names())


def _names():
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out.append(f.read().strip())
        except OSError:
            pass
    return sorted(out)


def _settle(baseline, limit_s=30):
    deadline = time.monotonic() + limit_s
    while _threads() > baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    return _threads()


def test_abandoned_iterations_close_their_consumers(tmp_path):
    """Iterations dropped after a few elements, and one left blocked in a
    thread when its broker died, close their consumers: the librdkafka
    threads go and nothing keeps polling (and logging) forever."""
    own = Broker(tmp_path / "broker.log")
    try:
        topic = own.create_topic()
        own.produce(topic, messages(20))
        ds = KafkaDataset([topic], servers=own.address, timeout=200, broker_timeout=1000)
        for _ in ds.take(1):  # warm up TF's own thread pools
            pass
        gc.collect()
        baseline = _settle(0)
        for _ in range(3):
            iterator = iter(ds)
            next(iterator)
            del iterator
            gc.collect()
        assert _settle(baseline) <= baseline
        # A reader blocked in next() on an exhausted stream, then abandoned.
        iterator = iter(ds)
        blocked = threading.Thread(target=list, args=(iterator,), daemon=True)
        blocked.start()
        time.sleep(1.0)
        assert blocked.is_alive()  # waiting for messages that never come
        assert _threads() > baseline  # its consumer's threads
        own.stop()
        blocked.join(60)
        assert not blocked.is_alive(), "the blocked iteration never gave up"
        del iterator
        gc.collect()
        assert _settle(baseline) <= baseline, "a consumer still runs"
    finally:
        if own._process.poll() is None:
            own.stop()


@pytest.mark.parametrize("batch_size, message_key", [(None, False), (2, True)])
def test_deleting_an_iterator_whose_prefetch_waits_for_messages_returns(
        broker, batch_size, message_key):
    """A prefetch thread waiting in the consume loop (the
    broker is up, no new message comes, no eof) used to keep `del iterator`
    blocked until a message or an error arrived; now it ends within one poll."""
    topic = broker.create_topic()
    broker.produce(topic, messages(4))
    ds = KafkaDataset([topic], servers=broker.address, timeout=200, eof=False,
                      batch_size=batch_size, message_key=message_key,
                      broker_timeout=600000)
    iterator = iter(ds.prefetch(1))
    got = []
    for _ in range(4 if batch_size is None else 2):
        element = next(iterator)
        values = element[1] if message_key else element
        got.extend(np.asarray(values.numpy()).reshape([-1]).tolist())
    assert got == messages(4)  # empty-poll placeholders never reach the user
    time.sleep(1.0)  # the prefetch thread now waits for a fifth message
    holder = [iterator]
    del iterator

    def release():
        holder.clear()
        gc.collect()

    deleter = threading.Thread(target=release, daemon=True)
    deleter.start()
    deleter.join(30)
    assert not deleter.is_alive(), "deleting the iterator blocked"
    assert ds.offsets() == {(topic, 0): 4}  # placeholders do not advance it
