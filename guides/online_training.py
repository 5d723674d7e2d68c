"""
Title: Online training from Kafka: incremental checkpoints, crash recovery, serving updates
Author: keras_rec_emb contributors
Date created: 2026/11/22
Last modified: 2026/11/22
Description: Train from a Kafka topic for weeks: save small increments often,
survive a killed trainer, push fresh rows to a live server.
Accelerator: None
"""

"""
## Introduction

An online trainer reads an endless event stream and must (1) save often,
without writing every row of every table each time, (2) come back after a
crash without losing what it had learned or skipping events, and (3) push
fresh rows to serving every few minutes. DeepRec calls these Incremental
Checkpoint and incremental model update. In `keras_rec_emb`:

- `keras_rec_emb.callbacks.CheckpointCallback` writes a full checkpoint, then
  incremental links holding only the rows changed since the previous link
  (plus keys evicted, all dense and optimizer variables, and the Kafka
  position). `restore(model)` replays the chain.
- `keras_rec_emb.callbacks.TableStats` logs table size, admitted/filtered,
  new and evicted keys, bytes and lookup hit rate while training.
- `keras_rec_emb.apply_to_saved_model` applies a link to a SavedModel that a
  server has loaded, without reloading it.

This guide starts a local Kafka-compatible broker (tansu, as in the data
guide), trains from it in a separate process, kills that process with
SIGKILL mid-stream, resumes in this process from the checkpoints, checks
against an uninterrupted run that not one row was lost, plots the table
statistics and keeps a served model up to date from the increments. Set
`KRE_GUIDE_SMALL=1` for a quick run.
"""

"""
## Setup
"""

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import confluent_kafka
import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.data import KafkaDataset
from keras_rec_emb.data import decode_csv

from _broker import start_local_broker  # guides/_broker.py: tansu on 127.0.0.1

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
BATCH = 64 if SMALL else 256
STEPS = 40 if SMALL else 400             # training steps over the whole topic
EVENTS = BATCH * STEPS
INCREMENTAL_EVERY = 5 if SMALL else 25   # steps between incremental links
FULL_EVERY = 20 if SMALL else 200        # steps between full checkpoints
CRASH_AT = 28 if SMALL else 262          # the trainer is killed after this step
NUM_USERS, NUM_ITEMS = 3_000, 5_000
ITEM_OFFSET = 1_000_000                  # users and items share one table

"""
## The model

One `EmbeddingVariable` for user and item ids with a `CounterFilter` (an id
gets a row only once seen 2 times; until then it reads a default row and is
only counted) and `GlobalStepEvict` (an id not updated during the last
`steps_to_live` steps is dropped when `EvictionCallback` runs). Initializers
are seeded so that every process builds the same model.
"""


def build_model():
    ids = keras.Input((2,), dtype="int64", name="ids")
    ev = kre.layers.EmbeddingVariable(
        8, combiner="mean", name="ids_table",
        initializer=keras.initializers.TruncatedNormal(stddev=0.05, seed=1),
        ev_option=kre.EmbeddingVariableOption(
            filter_option=kre.CounterFilter(filter_freq=2),
            evict_option=kre.GlobalStepEvict(steps_to_live=STEPS // 4)))
    # Named layers: a checkpoint keys dense variables by their Keras path, and
    # Keras numbers unnamed layers per process (a second model built in one
    # process would have `dense_2`, not `dense`).
    hidden = keras.layers.Dense(
        16, activation="relu", name="hidden", kernel_initializer=keras.initializers.GlorotUniform(seed=2))
    out = keras.layers.Dense(
        1, activation="sigmoid", name="click", kernel_initializer=keras.initializers.GlorotUniform(seed=3))
    model = keras.Model(ids, out(hidden(ev(ids))))
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    return model


"""
## The trainer

Events are CSV lines `user,item,label` in partition 0 of topic `clicks`.
`KafkaDataset` reads them in batches; its `position` (the next offset of
every partition handed out) goes to the checkpoint callback, so every link
records where the stream was. Leave `prefetch` out after a Kafka dataset
that you checkpoint: a prefetched batch counts as read before it is trained.

`train` restores whatever the checkpoint directory holds (nothing the first
time), then trains up to `STEPS`. The dataset starts at the restored
position. `pause_at` makes the trainer stop after that step and wait
(for the crash below); `extra_callbacks(checkpoints)` adds callbacks.
"""


def make_stream(servers):
    stream = KafkaDataset([f"clicks:0:0:{EVENTS}"], servers=servers, eof=True,
                          timeout=1000, batch_size=BATCH)
    decode = decode_csv([tf.constant(0, tf.int64)] * 2 + [0.0])
    features = stream.map(decode).map(
        lambda user, item, label: (tf.stack([user, item + ITEM_OFFSET], axis=1), label))
    return stream, features


class PauseAt(keras.callbacks.Callback):
    """Says where it is after step `step`, then hangs until killed."""

    def __init__(self, step, stream):
        super().__init__()
        self.step, self.stream = step, stream

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            offsets = {f"{t}:{p}": o for (t, p), o in self.stream.offsets().items()}
            print("PAUSED", json.dumps({"step": self.step, "offsets": offsets}), flush=True)
            time.sleep(3600)


def train(directory, servers, pause_at=None, extra_callbacks=None):
    model = build_model()
    stream, features = make_stream(servers)
    checkpoints = kre.callbacks.CheckpointCallback(
        directory, full_every_steps=FULL_EVERY, incremental_every_steps=INCREMENTAL_EVERY,
        keep=2, kafka_position=stream)
    restored = checkpoints.restore(model)
    start = restored["step"] if restored else 0
    callbacks = [checkpoints,
                 kre.callbacks.EvictionCallback(every_n_steps=5, on_epoch_end=False),
                 *(extra_callbacks(checkpoints) if extra_callbacks else [])]
    if pause_at is not None:
        callbacks.append(PauseAt(pause_at, stream))
    # steps_per_epoch: stop exactly at STEPS (and see the note at the end).
    model.fit(features, steps_per_epoch=STEPS - start, epochs=1, verbose=0,
              callbacks=callbacks)
    return model, stream, checkpoints, restored


"""
When this file runs as the trainer subprocess (started below), it trains and
exits here.
"""

if os.environ.get("KRE_ONLINE_TRAINER"):
    role = json.loads(os.environ["KRE_ONLINE_TRAINER"])
    train(role["directory"], role["servers"], pause_at=role["pause_at"])
    sys.exit(0)

keras.utils.set_random_seed(0)
workdir = tempfile.mkdtemp()

"""
## A broker and a topic

A local broker (in production, `servers` points at your cluster) and the
events: users and items drawn from skewed distributions, so that many ids
are rare (the filter keeps them out) and some go stale (eviction drops
them).
"""

broker, servers = start_local_broker()

rng = np.random.default_rng(0)
users = rng.zipf(1.3, EVENTS) % NUM_USERS
items = rng.zipf(1.2, EVENTS) % NUM_ITEMS
labels = ((users + items) % 3 == 0).astype(int)
producer = confluent_kafka.Producer({"bootstrap.servers": servers})
for u, i, y in zip(users, items, labels):
    producer.produce("clicks", f"{u},{i},{y}".encode(), partition=0)
    producer.poll(0)
assert producer.flush(30) == 0
del producer
print(f"{EVENTS} events in topic clicks")

"""
## Train, then crash

The trainer runs as a subprocess (this same file, in trainer mode). With
`INCREMENTAL_EVERY` steps between links, it writes a full checkpoint after
step 1, incremental links every few steps and a new full checkpoint every
`FULL_EVERY` steps. After step `CRASH_AT` (which is not a checkpoint step)
we kill it with SIGKILL: no handler, no flush, no `on_train_end`.
"""

ckpt_dir = os.path.join(workdir, "checkpoints")
trainer_log = open(os.path.join(workdir, "trainer.log"), "w")
trainer = subprocess.Popen(
    [sys.executable, os.path.abspath(__file__)],
    env=dict(os.environ, KRE_ONLINE_TRAINER=json.dumps(
        {"directory": ckpt_dir, "servers": servers, "pause_at": CRASH_AT})),
    stdout=subprocess.PIPE, stderr=trainer_log, text=True)
lines = queue.Queue()
threading.Thread(target=lambda: [lines.put(x) for x in trainer.stdout], daemon=True).start()
paused = None
deadline = time.monotonic() + 600
while paused is None:
    try:
        line = lines.get(timeout=1)
    except queue.Empty:
        line = ""
    if line.startswith("PAUSED"):
        paused = json.loads(line.split(" ", 1)[1])
    elif trainer.poll() is not None or time.monotonic() > deadline:
        trainer.kill()
        trainer_log.close()
        raise RuntimeError("the trainer stopped early:\n" +
                           open(trainer_log.name).read()[-3000:])
os.kill(trainer.pid, signal.SIGKILL)
assert trainer.wait() == -signal.SIGKILL
trainer_log.close()
consumed_at_crash = paused["offsets"]["clicks:0"]
print(f"trainer killed after step {paused['step']}, having consumed "
      f"{consumed_at_crash} events")
print("checkpoint links:", sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".npz")))

"""
## Resume

A new trainer (here, this process) restores the newest full checkpoint and
replays its incremental links; the Kafka dataset starts at the position
saved in the last link. Steps trained after that link are lost with the
process, and their events are read again: at-least-once, never more than
what came after the last link. While it trains, `TableStats` reports the
tables every step (into `logs`, so `History` and `CSVLogger` see them too).

We also start serving right away, and every link the resumed trainer
writes is applied to the live server with `apply_to_saved_model`.
"""

stats = kre.callbacks.TableStats(every_n_steps=1)
rows = []
served = {"model": None, "applied": 0}


class Record(keras.callbacks.Callback):
    """Keeps the statistics of each step; serves the links as they appear."""

    def __init__(self, checkpoints):
        super().__init__()
        self.checkpoints = checkpoints

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        rows.append({"step": step, **stats.latest})
        for link in self.checkpoints.saves[served["applied"]:]:
            kre.apply_to_saved_model(served["model"], link)
            served["applied"] += 1


"""
The server starts from the checkpoints too: a copy of the model restored
from the chain, exported and loaded. (Exporting or saving a model runs its
tables' eviction, as DeepRec does when it saves; exporting the copy leaves
the trainer's state as it is.)
"""

server_copy = build_model()
kre.IncrementalCheckpointer(server_copy, ckpt_dir).restore()
served_path = os.path.join(workdir, "served")
server_copy.export(served_path, verbose=False)
served["model"] = tf.saved_model.load(served_path)  # what the server holds

model, stream, checkpoints, restored = train(
    ckpt_dir, servers, extra_callbacks=lambda checkpoints: [stats, Record(checkpoints)])
for link in checkpoints.saves[served["applied"]:]:  # the link written at the end
    kre.apply_to_saved_model(served["model"], link)
    served["applied"] += 1
print(f"restored step {restored['step']} from {len(restored['links'])} links, Kafka "
      f"position {restored['kafka']}")
resumed_from = restored["kafka"][0][2]
assert resumed_from <= consumed_at_crash
print(f"re-read {consumed_at_crash - resumed_from} events that followed the last link "
      f"(at-least-once); the stream now stands at {stream.offsets()}")
assert stream.offsets() == {("clicks", 0): EVENTS}

"""
## Nothing was lost

Compare with a trainer that ran from the start to the end without a crash
(same seeds, same stream): the tables must hold the same rows, with the
same values, frequencies and filter counts, and the dense weights must
match. The lost steps were trained again from the same state, so the crash
left no trace.
"""

reference, _, _, _ = train(os.path.join(workdir, "reference"), servers)


def table(m):
    return m.get_layer("ids_table").table.export()


got, want = table(model), table(reference)
order_got, order_want = np.argsort(got["keys"]), np.argsort(want["keys"])
np.testing.assert_array_equal(got["keys"][order_got], want["keys"][order_want])
np.testing.assert_allclose(got["values"][order_got], want["values"][order_want], atol=1e-5)
np.testing.assert_array_equal(got["freqs"][order_got], want["freqs"][order_want])
np.testing.assert_array_equal(np.sort(got["keys_filtered"]), np.sort(want["keys_filtered"]))
for a, b in zip(model.get_layer(index=-1).weights + model.get_layer(index=-2).weights,
                reference.get_layer(index=-1).weights + reference.get_layer(index=-2).weights):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
print(f"resumed == uninterrupted: {len(got['keys'])} rows, "
      f"{len(got['keys_filtered'])} ids still filtered")

"""
## Table statistics

`TableStats` numbers, per step of the resumed run: the table's size and
filtered ids, ids admitted and evicted per step, its bytes and the lookup
hit rate. (With `log_dir=...` they also go to TensorBoard.)
"""

import csv

csv_path = os.path.join(workdir, "table_stats.csv")
with open(csv_path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
print(f"statistics of {len(rows)} steps in {csv_path}; last step: {rows[-1]}")
last = rows[-1]
assert last["ids_table_size"] == len(got["keys"])
assert last["ids_table_filtered"] == len(got["keys_filtered"])

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

steps_axis = [r["step"] for r in rows]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
for key, label in (("size", "admitted ids"), ("filtered", "filtered ids")):
    axes[0].plot(steps_axis, [r[f"ids_table_{key}"] for r in rows], label=label)
for key, label in (("new", "new per step"), ("evicted", "evicted per step")):
    axes[1].plot(steps_axis, [r[f"ids_table_{key}"] for r in rows], label=label)
axes[2].plot(steps_axis, [r["ids_table_hit_rate"] for r in rows], label="hit rate")
for ax in axes:
    ax.set_xlabel("step")
    ax.legend()
fig.tight_layout()
png_path = os.path.join(workdir, "table_stats.png")
fig.savefig(png_path)
print("plot:", png_path)

"""
## The served model is current

The server loaded the model at the restored state and took every link the
resumed trainer wrote, in place. It predicts what the trained model
predicts, for ids it has seen, ids still filtered and unknown ids.
"""

probe = np.stack([users[-BATCH:], items[-BATCH:] + ITEM_OFFSET], axis=1)
probe = np.concatenate([probe, [[NUM_USERS + 7, ITEM_OFFSET + NUM_ITEMS + 7]]])
x = tf.constant(probe, tf.int64)
np.testing.assert_allclose(served["model"].serve(x).numpy(),
                           model.predict(x, verbose=0), atol=1e-5)
print(f"served model updated from {served['applied']} links; predictions match")

broker.kill()
broker.wait()

"""
## Notes

- A link costs what changed: rows trained, admitted, counted or evicted
  since the previous link, plus the dense variables (`benchmarks/checkpoint.py`
  measures full vs incremental saves).
- A resumed stream re-reads what the crashed trainer read after its last
  link (at-least-once). Save more often to re-read less.
- Give `fit` a `steps_per_epoch` on a stream: when a dataset of unknown
  length runs out, Keras counts one more optimizer iteration than it trained.
"""
