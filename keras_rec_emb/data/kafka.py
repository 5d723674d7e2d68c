"""Kafka topics as datasets on confluent-kafka, for either backend, with a
checkpointable position (docs/semantics.md, 'Input pipelines')."""

import functools
import logging
import re
import threading
import time

import numpy as np

from keras_rec_emb import _backend
from keras_rec_emb import _keras_fixes as _fixes
from keras_rec_emb._checks_core import is_int

if _backend.is_jax():
    from keras_rec_emb.backend.jax import data as _impl
else:
    from keras_rec_emb.backend.tensorflow import data as _impl

# confluent-kafka is the optional `kafka` extra: imported on first use (the
# broker check of a dataset's construction), which raises an ImportError
# naming the extra when it is missing.
confluent_kafka = _fixes.LazyKafka()

_LOGGER = logging.getLogger(__name__)
_TOPIC = re.compile(r"[A-Za-z0-9._-]+")
# group.id for KafkaDataset without a group: librdkafka requires one; with
# auto-commit off it is never used on the broker.
_NO_GROUP = "keras-rec-emb"
# Milliseconds an iteration waits without any message before it checks that
# the broker still answers (and raises ConnectionError if not).
DEFAULT_BROKER_TIMEOUT_MS = 60000
_PROBE_LIMIT_MS = 10000


def _check_offsets(offsets):
    """`offsets` as {(topic, partition): offset}, checked now: a bad position
    would otherwise surface only when a dataset starts reading from it."""
    if offsets is None:
        return {}
    allowed = ("a dict {(topic: str, partition: int >= 0): next offset: int >= 0}, or "
               "None")
    if not isinstance(offsets, dict):
        raise TypeError(f"`offsets` must be {allowed}. Received: offsets={offsets!r}")

    for key, offset in offsets.items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)
                and _TOPIC.fullmatch(key[0]) and is_int(key[1]) and key[1] >= 0
                and is_int(offset) and offset >= 0):
            raise ValueError(f"`offsets` must be {allowed}. Received the entry "
                             f"{key!r}: {offset!r} in offsets={offsets!r}")
    return {(t, int(p)): int(o) for (t, p), o in offsets.items()}


class KafkaPosition(_impl.PositionBase):
    """The consumed position of a Kafka dataset, as checkpointable state.

    Maps `(topic, partition)` to the offset of the next message to read. Save
    it with `tf.train.Checkpoint(data=ds.position)` and restore it into a new
    dataset's `position` before iterating (docs/semantics.md, 'Input pipelines').

    Example:

    >>> import tensorflow as tf
    >>> from keras_rec_emb.data import KafkaPosition
    >>> position = KafkaPosition({("clicks", 0): 42})
    >>> path = tf.train.Checkpoint(data=position).write("/tmp/kafka_pos")
    >>> restored = KafkaPosition()
    >>> _ = tf.train.Checkpoint(data=restored).read(path)
    >>> restored.offsets()
    {('clicks', 0): 42}
    """

    def __init__(self, offsets=None):
        self._offsets = _check_offsets(offsets)
        self._lock = threading.Lock()

    def offsets(self):
        """A copy of `{(topic, partition): next_offset}`."""
        with self._lock:
            return dict(self._offsets)

    def _advance(self, offsets):
        with self._lock:
            self._offsets.update(offsets)

    def _set_offsets(self, offsets):
        """Replaces every offset (a restore)."""
        with self._lock:
            self._offsets = dict(offsets)


def _config(entries, argument, strip_prefix=None):
    """`["key=value", ...]` (list or 1-D tf.string tensor) as a dict."""
    if entries is None:
        return {}
    entries = _impl.strings(entries)
    if isinstance(entries, str) or not isinstance(entries, (list, tuple)):
        raise TypeError(f"`{argument}` must be a list of 'key=value' strings. "
                        f"Received: {argument}={entries!r}")
    config = {}
    for entry in entries:
        key, sep, value = entry.partition("=") if isinstance(
            entry, str) else ("", "", "")
        if not sep or not key:
            raise ValueError(
                f"`{argument}` entries must look like 'key=value'. "
                f"Received: {entry!r} in {argument}={entries!r}")
        if strip_prefix and key.startswith(strip_prefix):
            key = key[len(strip_prefix):]
        config[key] = value
    return config


def _servers(servers):
    if isinstance(servers, (list, tuple)) and all(
            isinstance(s, str) for s in servers) and servers:
        return ",".join(servers)
    if not isinstance(servers, str) or not servers:
        raise TypeError("`servers` must be 'host:port[,host:port...]' or a "
                        f"list of them. Received: servers={servers!r}")
    return servers


def _timeout(name, value, allow_infinite=False):
    low = -1 if allow_infinite else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = "-1 (no limit) or " if allow_infinite else ""
        raise ValueError(f"`{name}` must be {allowed}a non-negative number of "
                         f"milliseconds. Received: {name}={value!r}")
    return value


def _check_reachable(config, servers, timeout_ms):
    """Raises ValueError naming `servers` unless a broker answers in time."""
    consumer = confluent_kafka.Consumer({**config, "log_level": 0})
    try:
        consumer.list_topics(timeout=timeout_ms / 1000)
    except confluent_kafka.KafkaException as e:
        raise ValueError(
            f"Cannot reach a Kafka broker at servers={servers!r} within "
            f"{timeout_ms} ms: {e.args[0].str()}. Check the address and "
            "that the broker is running.") from None
    finally:
        consumer.close()


class _Pass:
    """One iteration over a Kafka dataset: a consumer and a message buffer.

    Subclasses connect the consumer (`_start`) and filter what it returns
    (`_accept`, `_ended`); `close()` stops the consume loop even from another
    thread, and the loop closes the consumer when it exits.
    """

    def __init__(self, config, position, batch_size, message_key,
                 poll_timeout_ms, broker_timeout_ms=DEFAULT_BROKER_TIMEOUT_MS):
        self._servers = config["bootstrap.servers"]
        self._broker_timeout = broker_timeout_ms
        self._closing = threading.Event()
        self._gen = None
        self._gen_lock = threading.Lock()
        self._config = config
        self._store = (config["enable.auto.offset.store"].lower() == "false"
                       and config["enable.auto.commit"].lower() != "false")
        self._position = position
        self._batch_size = batch_size
        self._message_key = message_key
        self._poll_timeout = poll_timeout_ms / 1000
        self._pending = []
        self._consumer = None

    def __iter__(self):
        return self

    def __next__(self):
        with self._gen_lock:
            if self._gen is None:
                self._gen = self.elements()
        return next(self._gen)

    def close(self):
        """Ends the iteration and closes its consumer (also when another
        thread is waiting for messages in it: it stops after its poll)."""
        self._closing.set()
        with self._gen_lock:
            gen = self._gen
        if gen is not None:
            try:
                gen.close()
            except ValueError:  # running in another thread: it sees _closing
                pass

    def __del__(self):
        self._closing.set()

    def _check_broker(self, idle_since):
        """Raises ConnectionError naming the servers when nothing arrived
        for `broker_timeout` ms and the broker does not answer."""
        if self._broker_timeout < 0:
            return idle_since
        now = time.monotonic()
        if (now - idle_since) * 1000 < self._broker_timeout:
            return idle_since
        limit = min(self._broker_timeout, _PROBE_LIMIT_MS) / 1000
        try:
            self._consumer.list_topics(timeout=max(limit, 0.001))
        except confluent_kafka.KafkaException as e:
            raise ConnectionError(
                f"The Kafka broker at servers={self._servers!r} has not answered "
                f"for {self._broker_timeout} ms (broker_timeout): "
                f"{e.args[0].str()}. Check that the broker is running, or pass "
                "broker_timeout=-1 to wait for it indefinitely.") from None
        return time.monotonic()

    def elements(self):
        """Yields the NumPy components of each element, updating `position`."""
        self._consumer = confluent_kafka.Consumer(self._config)
        try:
            self._start()
            size = self._batch_size or 1
            idle_since = time.monotonic()
            while True:
                while (len(self._pending) < size and not self._ended()
                       and not self._closing.is_set()):
                    # Take what is already fetched; else wait for one.
                    messages = (self._consumer.consume(
                        size - len(self._pending), 0) or
                                self._consumer.consume(1, self._poll_timeout))
                    accepted = [m for m in messages if self._accept(m)]
                    self._pending.extend(accepted)
                    self._polled(bool(messages))
                    if accepted or any(m.error() is None or m.error().code() ==
                                       _fixes.KAFKA_PARTITION_EOF for m in messages):
                        idle_since = time.monotonic()
                    else:
                        idle_since = self._check_broker(idle_since)
                    if not messages and not self._closing.is_set():
                        # A placeholder after every empty poll, so that an
                        # abandoned iterator is released within one poll
                        # timeout, not when a message or an error arrives.
                        yield self._idle()
                if not self._pending or self._closing.is_set():
                    return
                batch, self._pending = (self._pending[:size],
                                        self._pending[size:])
                self._hand_out(batch)
                yield self._components(batch)
        finally:
            self._consumer.close()

    def _hand_out(self, batch):
        offsets = {(m.topic(), m.partition()): m.offset() + 1 for m in batch}
        self._position._advance(offsets)
        if self._store:
            self._consumer.store_offsets(offsets=[
                confluent_kafka.TopicPartition(t, p, o)
                for (t, p), o in offsets.items()
            ])

    def _components(self, batch):
        columns = [[m.value() or b"" for m in batch]]
        if self._message_key:
            columns.insert(0, [m.key() or b"" for m in batch])
        if self._batch_size is None:
            return [np.True_] + [np.array(c[0], dtype=object) for c in columns]
        return [np.True_] + [np.array(c, dtype=object) for c in columns]

    def _idle(self):
        """The placeholder element yielded after an empty poll (filtered
        out by the dataset): a False flag and empty components."""
        n = 2 if self._message_key else 1
        if self._batch_size is None:
            return [np.False_] + [np.array(b"", dtype=object)] * n
        return [np.False_] + [np.array([], dtype=object)] * n

    def _raise_unless_benign(self, message):
        error = message.error()
        if error.fatal() or not (error.retriable() or error.code() in (
                _fixes.KAFKA_TRANSPORT, _fixes.KAFKA_PARTITION_EOF)):
            raise RuntimeError(
                f"Kafka error on {message.topic()}:{message.partition()}: "
                f"{error.str()}")
        _LOGGER.info("Kafka: %s", error.str())

    def _start(self):
        raise NotImplementedError

    def _accept(self, message):
        raise NotImplementedError

    def _ended(self):
        raise NotImplementedError

    def _polled(self, got_messages):
        """Called after each consume call, with whether it returned anything."""


class _RangePass(_Pass):
    """Reads explicit partition ranges (KafkaDataset)."""

    def __init__(self, ranges, eof, **kwargs):
        super().__init__(**kwargs)
        self._eof = eof
        start = self._position.offsets()
        self._start_offsets = {}
        self._end = {}  # exclusive end offset, None: unbounded
        self._length = {}
        self._done = set()
        for topic, partition, offset, length in ranges:
            tp = (topic, partition)
            self._start_offsets[tp] = start.get(tp, offset)
            self._length[tp] = length
            self._end[tp] = (offset + length
                             if offset >= 0 and length >= 0 else None)
            if length == 0 or (self._end[tp] is not None and
                               self._start_offsets[tp] >= self._end[tp]):
                self._done.add(tp)

    def _start(self):
        self._check_partitions_exist()
        self._consumer.assign([
            confluent_kafka.TopicPartition(t, p, o)
            for (t, p), o in self._start_offsets.items()
            if (t, p) not in self._done
        ])

    def _accept(self, message):
        tp = (message.topic(), message.partition())
        if message.error():
            self._raise_unless_benign(message)
            if self._eof and message.error().code() == _fixes.KAFKA_PARTITION_EOF:
                self._finish(tp)
            return False
        if tp in self._done:
            return False
        if self._end[tp] is None and self._length[tp] >= 0:
            self._end[tp] = message.offset() + self._length[tp]
        end = self._end[tp]
        if end is not None and message.offset() + 1 >= end:
            self._finish(tp)
        return end is None or message.offset() < end

    def _check_partitions_exist(self):
        """A missing topic or partition would never deliver a message nor an
        end-of-partition event: refuse it, naming it and the broker."""
        limit = max(self._poll_timeout, 1.0)
        for topic in sorted({t for t, _ in self._start_offsets}):
            try:
                meta = self._consumer.list_topics(topic, timeout=limit).topics.get(topic)
            except confluent_kafka.KafkaException as e:
                raise ConnectionError(
                    f"Cannot read the metadata of topic {topic!r} from the Kafka "
                    f"broker at servers={self._servers!r}: {e.args[0].str()}") from None
            if meta is None or meta.error is not None:
                reason = "" if meta is None else f" ({meta.error.str()})"
                raise ValueError(
                    f"Kafka topic {topic!r} does not exist on the broker at "
                    f"servers={self._servers!r}{reason}. Create it first, or check "
                    "the `topics` argument")
            missing = sorted(p for t, p in self._start_offsets
                             if t == topic and p not in meta.partitions)
            if missing:
                raise ValueError(
                    f"Kafka topic {topic!r} on servers={self._servers!r} has "
                    f"partitions {sorted(meta.partitions)}; `topics` names partition(s) "
                    f"{missing} that do not exist")

    def _finish(self, tp):
        self._done.add(tp)
        self._consumer.pause([confluent_kafka.TopicPartition(*tp)])

    def _ended(self):
        return len(self._done) == len(self._start_offsets)


class _GroupPass(_Pass):
    """Reads the partitions a consumer group assigns (KafkaGroupIODataset)."""

    def __init__(self, topics, stream_timeout, **kwargs):
        super().__init__(**kwargs)
        self._topics = topics
        self._stream_timeout = stream_timeout
        self._assigned = False
        self._idle_ms = 0
        self._stop = False

    def _start(self):
        self._consumer.subscribe(self._topics, on_assign=self._on_assign,
                                 on_revoke=self._on_revoke)

    def _on_assign(self, consumer, partitions):
        start = self._position.offsets()
        for tp in partitions:
            tp.offset = start.get((tp.topic, tp.partition), tp.offset)
        consumer.assign(partitions)
        self._assigned = True
        self._idle_ms = 0

    def _on_revoke(self, consumer, partitions):
        # The next owner starts after what was handed out: drop the rest.
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        self._pending = [m for m in self._pending
                         if (m.topic(), m.partition()) not in revoked]

    def _accept(self, message):
        if message.error():
            self._raise_unless_benign(message)
            return False
        return True

    def _polled(self, got_messages):
        if got_messages or not self._assigned:
            self._idle_ms = 0
            return
        self._idle_ms += self._poll_timeout * 1000
        self._stop = (self._stream_timeout != -1 and
                      self._idle_ms >= self._stream_timeout)

    def _ended(self):
        return self._stop


def _parse_topic(spec):
    parts = spec.split(":") if isinstance(spec, str) else []
    try:
        partition, offset, length = (int(p) for p in (parts[1:] + [
            "0", "0", "-1"][len(parts) - 1:]))
        ok = (1 <= len(parts) <= 4 and _TOPIC.fullmatch(parts[0])
              and partition >= 0 and (offset >= 0 or offset in (-1, -2))
              and length >= -1)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            "`topics` entries must look like 'topic[:partition[:offset"
            "[:length]]]' with partition >= 0, offset >= 0 (or -1: end, -2: "
            f"beginning) and length >= -1 (-1: unbounded). Received: {spec!r}")
    return parts[0], partition, offset, length


def _strings(value, argument):
    value = _impl.strings(value)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(f"`{argument}` must be a string or a non-empty list "
                        f"of strings. Received: {argument}={value!r}")
    return list(value)


def _batch_size(batch_size):
    if batch_size is not None and (isinstance(batch_size, bool) or
                                   not isinstance(batch_size, int) or
                                   batch_size < 1):
        raise ValueError("`batch_size` must be None or a positive integer. "
                         f"Received: batch_size={batch_size!r}")
    return batch_size


class _KafkaDatasetBase(_impl.Dataset):
    """Kafka messages with a checkpointable `position`; each iteration is a
    `new_pass(...)` (a `_Pass`), built once a broker has answered."""

    def __init__(self, new_pass, servers, config, poll_timeout, message_key, batch_size,
                 broker_timeout):
        servers = _servers(servers)
        broker_timeout = _timeout("broker_timeout", broker_timeout, allow_infinite=True)
        batch_size = _batch_size(batch_size)
        config = {"bootstrap.servers": servers, "enable.auto.offset.store": "false",
                  "logger": _LOGGER, **config}
        _check_reachable(config, servers, poll_timeout)
        self.position = KafkaPosition()

        def make_pass():
            return new_pass(config=config, position=self.position, batch_size=batch_size,
                            message_key=bool(message_key), poll_timeout_ms=poll_timeout,
                            broker_timeout_ms=broker_timeout)

        super().__init__(_impl.kafka_dataset(make_pass, batch_size, bool(message_key)))

    def offsets(self):
        """`{(topic, partition): next_offset}` of what was handed out."""
        return self.position.offsets()


class KafkaDataset(_KafkaDatasetBase):
    """Messages of explicit Kafka topic partitions: a `tf.data.Dataset` of
    `tf.string` under TensorFlow, an iterable of NumPy arrays of bytes under
    JAX (`fit` takes it after a `.map` that decodes, e.g. `decode_json`).

    Each partition is read from its start offset (or its saved `position`)
    for `length` messages; see docs/semantics.md, 'Input pipelines'.

    Args:
        topics: str, list of str or (TensorFlow) 1-D `tf.string` tensor of
            `"topic:partition:offset:length"`. `partition` defaults to 0,
            `offset` (first offset read) to 0, or -1 for the end of the log
            (new messages only) or -2 for its beginning; `length` (number of
            offsets to read, counted from `offset`, or from the first message
            read when `offset` is -1/-2) defaults to -1: unbounded.
        servers: str or list of str. Bootstrap servers, `host:port`.
            Defaults to `"localhost"`.
        group: str. Consumer group that handed-out offsets are committed to.
            Defaults to `""`: none.
        eof: bool. Stop each partition at the end of its log. Defaults to
            `False`.
        timeout: int. Milliseconds one consume call waits for messages, and
            the time the broker has to answer when the dataset is built
            (unreachable: `ValueError` naming `servers`). Defaults to `1000`.
        config_global: list of `"key=value"` librdkafka global properties,
            optional.
        config_topic: list of `"key=value"` librdkafka topic properties,
            optional.
        message_key: bool. Yield `(key, value)` instead of `value`. Defaults
            to `False`.
        batch_size: int, optional. Yield 1-D batches of up to `batch_size`
            messages (full unless the dataset ends) instead of one message
            per element: much faster, and what the `decode_*` functions take.
            Defaults to `None`.
        broker_timeout: int. Milliseconds an iteration waits with no message
            before it checks the broker (`ConnectionError` if it does not
            answer); -1 waits forever. Defaults to `60000`.

    Example:

    >>> from keras_rec_emb.data import KafkaDataset
    >>> ds = KafkaDataset(["clicks:0:0:100"], servers="127.0.0.1:9092",
    ...                   eof=True, batch_size=32)  # doctest: +SKIP
    >>> for values in ds:  # doctest: +SKIP
    ...     print(values.shape)
    """

    def __init__(self, topics, servers="localhost", group="", eof=False, timeout=1000,
                 config_global=None, config_topic=None, message_key=False, batch_size=None,
                 broker_timeout=DEFAULT_BROKER_TIMEOUT_MS):
        ranges = [_parse_topic(s) for s in _strings(topics, "topics")]
        partitions = [(t, p) for t, p, _, _ in ranges]
        if len(set(partitions)) != len(partitions):
            raise ValueError("`topics` names a partition twice. "
                             f"Received: topics={topics!r}")
        if not isinstance(group, str):
            raise TypeError(f"`group` must be a string. Received: group={group!r}")
        config = {
            "group.id": group or _NO_GROUP,
            "enable.auto.commit": "true" if group else "false",
            "enable.partition.eof": "true" if eof else "false",
            **_config(config_global, "config_global"),
            **_config(config_topic, "config_topic"),
        }
        super().__init__(functools.partial(_RangePass, ranges, bool(eof)), servers, config,
                         _timeout("timeout", timeout), message_key, batch_size, broker_timeout)


class KafkaGroupIODataset(_KafkaDatasetBase):
    """Messages of Kafka topics read by a consumer group, as a dataset.

    The group balances the topics' partitions over all its consumers; see
    docs/semantics.md, 'Input pipelines'.

    Args:
        topics: str, list of str or (TensorFlow) 1-D `tf.string` tensor of
            topic names.
        group_id: str. Consumer group.
        servers: str or list of str. Bootstrap servers, `host:port`.
        stream_timeout: int. Milliseconds without new messages (once the
            group has assigned partitions) after which the dataset ends: 0
            ends after the first empty poll, -1 never. Defaults to `0`.
        message_poll_timeout: int. Milliseconds one consume call waits; also
            the time the broker has to answer when the dataset is built
            (unreachable: `ValueError` naming `servers`). Defaults to `10000`.
        configuration: list of `"key=value"` librdkafka properties,
            optional; topic properties may carry the prefix `conf.topic.`.
        message_key, batch_size, broker_timeout: as in `KafkaDataset`.

    Example:

    >>> from keras_rec_emb.data import KafkaGroupIODataset
    >>> ds = KafkaGroupIODataset(
    ...     ["clicks"], group_id="trainer", servers="127.0.0.1:9092",
    ...     configuration=["auto.offset.reset=earliest"],
    ...     batch_size=32)  # doctest: +SKIP
    """

    def __init__(self, topics, group_id, servers, stream_timeout=0, message_poll_timeout=10000,
                 configuration=None, message_key=False, batch_size=None,
                 broker_timeout=DEFAULT_BROKER_TIMEOUT_MS):
        topics = _strings(topics, "topics")
        for topic in topics:
            if not _TOPIC.fullmatch(topic):
                raise ValueError(
                    "`topics` entries must be topic names ([A-Za-z0-9._-]+). "
                    f"Received: {topic!r}")
        if not isinstance(group_id, str) or not group_id:
            raise TypeError("`group_id` must be a non-empty string. "
                            f"Received: group_id={group_id!r}")
        stream_timeout = _timeout("stream_timeout", stream_timeout, allow_infinite=True)
        config = {"group.id": group_id, "enable.auto.commit": "true",
                  **_config(configuration, "configuration", strip_prefix="conf.topic.")}
        super().__init__(functools.partial(_GroupPass, topics, stream_timeout), servers, config,
                         _timeout("message_poll_timeout", message_poll_timeout), message_key,
                         batch_size, broker_timeout)
