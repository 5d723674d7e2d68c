"""
Title: Distributed training: tables sharded over replicas, workers and parameter servers
Author: keras_rec_emb authors
Description: The same small DLRM trained in one process, on 2 logical devices
with MirroredStrategy (tables sharded over the replicas), on 2 worker
processes with MultiWorkerMirroredStrategy (tables sharded over the workers),
and on a localhost cluster of 2 parameter servers and 2 workers, each worker
reading its own part of the Parquet data.
"""

"""
## Two ways to spread tables

* **Synchronous (MirroredStrategy).** Build the model inside
  `tf.distribute.MirroredStrategy().scope()`: each `EmbeddingVariable` table
  is split by key hash into one shard per replica. A replica's lookup reads
  each id's row from the shard that owns it, the gradient of each shard is
  all-gathered from every replica and applied once, by the shard's owner,
  with the fused optimizer kernel. Dense layers stay data-parallel as Keras
  does. Training N replicas with global batch B gives the same numbers as
  one process with batch B.
* **Synchronous over processes (MultiWorkerMirroredStrategy).** One
  replica per worker process; each table is split by key hash into one shard
  per worker, which only that process holds. A lookup de-duplicates the
  replica's ids and sends each to its owner only, in one collective
  all-to-all; the owners answer with their rows in a second one. The
  gradient returns the same way (the gradient of an all-to-all is the
  all-to-all back), so each owner applies the global batch's gradient to
  its shard with the fused kernel. Each worker sends about its own distinct
  remote ids and their rows, whatever the number of workers.
* **Asynchronous (parameter servers).** The whole model lives on
  parameter-server tasks: `tf.distribute.Server` processes started with
  `keras-rec-emb ps`. Workers connect with `keras_rec_emb.distribute.connect`
  and build their model inside `keras_rec_emb.distribute.parameter_servers(devices)`:
  each table is sharded by key hash over the PS tasks, and the dense
  weights and the optimizer's slots and step counter are variables on the
  PS tasks (spread over them by size), found by name, so every worker
  trains the same model. Workers read and push updates without waiting for
  each other (DeepRec's default mode for CPU clusters, as TensorFlow 1's
  `replica_device_setter`): a step may read weights other workers changed
  since its previous read (stale reads), no update waits. Worker 0, the
  chief, initializes the variables and saves.

Either way a saved model or checkpoint holds each table in the ordinary
format, so it restores into any number of shards, or into one process.

When `KRE_GUIDE_SMALL=1` is set this guide runs on less data (CI does).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

# The guide starts copies of itself as cluster workers (see the last part).
ROLE = os.environ.get("KRE_GUIDE_ROLE", "main")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

if ROLE == "main":
    # Logical devices must be configured before TensorFlow starts.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
ROWS = 2_048 if SMALL else 65_536
BATCH = 256
FEATURES = ("user", "item", "category")

"""
## Data: one Parquet file in row groups

Workers of a cluster read disjoint parts of the data: `ParquetDataset`'s
`partition_count` / `partition_index` give worker `i` of `n` the row groups
`g` with `g % n == i` (the role DeepRec's WorkQueue plays).
"""


def write_data(path):
    rng = np.random.default_rng(0)
    cols = {f: rng.zipf(1.3, ROWS).astype(np.int64) for f in FEATURES}
    cols["dense"] = rng.normal(size=ROWS).astype(np.float32)
    cols["label"] = (rng.uniform(size=ROWS) < 0.3).astype(np.float32)
    pq.write_table(pa.table(cols), path, row_group_size=BATCH)


def dataset(path, partition_count=1, partition_index=0, batch=BATCH):
    ds = kre.data.ParquetDataset(path, batch_size=batch, partition_count=partition_count,
                                 partition_index=partition_index)
    return ds.map(lambda d: ({f: d[f] for f in FEATURES + ("dense",)}, d["label"]))


def build_dlrm():
    inputs = {f: keras.Input((), dtype="int64", name=f) for f in FEATURES}
    inputs["dense"] = keras.Input((), dtype="float32", name="dense")
    embs = [kre.layers.EmbeddingVariable(8, name=f"{f}_emb",
                                         initializer=keras.initializers.RandomUniform(
                                             -0.05, 0.05, seed=1))(inputs[f])
            for f in FEATURES]
    bottom = keras.layers.Dense(8, activation="relu", name="bottom")(
        keras.ops.expand_dims(inputs["dense"], -1))
    x = keras.layers.Concatenate()(embs + [bottom])
    x = keras.layers.Dense(16, activation="relu", name="top")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", name="out")(x))
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    return model


# Every trained model predicts these examples.
ids = {f: np.arange(1, 9, dtype=np.int64) for f in FEATURES}
ids["dense"] = np.linspace(-1, 1, 8).astype(np.float32)


def same_dense_init(model):
    """Every run starts from the same dense weights."""
    rng = np.random.default_rng(7)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layer.set_weights([rng.normal(scale=0.1, size=w.shape).astype(np.float32)
                               for w in layer.get_weights()])


"""
## Parameter-server workers

A worker connects (within `timeout` each PS task must answer as the
TensorFlow server of its task; if not, the error names the task and its
address, so a wrong or silent port fails at once instead of hanging) and
builds the model inside `parameter_servers(devices)`. Worker 0 is the
chief: it gives every variable the PS tasks do not hold yet its initial
value and, when its scope ends, lets the others start (they wait for that
inside their own scope), so whatever the chief does inside its scope, such
as restoring a checkpoint, comes first. Workers may start in any order,
together too. This function runs in the worker processes that the last part
starts.

The chief saves the shared model like any model: `model.save`,
`export_for_serving`, `keras.callbacks.ModelCheckpoint`,
`BackupAndRestore` or our `CheckpointCallback` read the variables and
tables from the PS tasks. Each table shard and each variable is read in one
piece (a shard's export holds all its locks), but while other workers
train, the shards and variables are read one after another, so a save
taken mid-training mixes values from a few steps apart, as TensorFlow 1's
`Saver` in asynchronous training does. Save once the others are done (as
here) for a model that equals the servers' state.
"""


def run_worker():
    ps = os.environ["KRE_GUIDE_PS"].split(",")
    task = int(os.environ["KRE_GUIDE_TASK"])
    out = os.environ["KRE_GUIDE_OUT"]
    devices = kre.distribute.connect(ps, os.environ["KRE_GUIDE_WORKER"], task, timeout=300)
    checkpoints = kre.callbacks.CheckpointCallback(os.path.join(out, "ps_chain"),
                                                   full_every_steps=4, incremental_every_steps=1)
    with kre.distribute.parameter_servers(devices):
        model = build_dlrm()
        if os.environ.get("KRE_GUIDE_RESTORE"):  # the chief, after a PS restart
            checkpoints.restore(model)
    if os.environ.get("KRE_GUIDE_RESTORE"):
        print("PREDICTED " + json.dumps(model.predict(ids, verbose=0).ravel().tolist()))
        return
    callbacks = [checkpoints] if task == 0 else []
    model.fit(dataset(os.environ["KRE_GUIDE_DATA"], 2, task), epochs=1, verbose=0,
              callbacks=callbacks)
    if task == 0:  # the chief saves once the other worker is done
        while not os.path.exists(os.path.join(out, "worker1.done")):
            time.sleep(0.1)
        model.save(os.path.join(out, "ps_model.keras"))
        kre.export_for_serving(model, os.path.join(out, "ps_served"))
        checkpoints.checkpointer.save_full()
        sizes = {f: model.get_layer(f"{f}_emb").table_size() for f in FEATURES}
        print("TABLES " + json.dumps(sizes), flush=True)
        print("PREDICTED " + json.dumps(model.predict(ids, verbose=0).ravel().tolist()))


"""
## MultiWorkerMirroredStrategy workers

Each worker process reads `TF_CONFIG` (the cluster's addresses and its own
task), builds the model inside the strategy's scope and trains on its own
row groups: worker `i` of 2 reads row groups `g` with `g % 2 == i`, so a step
of the two workers covers row groups `2k` and `2k + 1`, the batch of one
process reading with twice the batch size.

`model.fit` runs as written for one process. The only thing to say is how
the input splits: `strategy.distribute_datasets_from_function` hands Keras
each worker's own dataset as it is (each of its batches is that worker's
part of a global step), where a plain dataset would be split element by
element. (Keras 3.15's own `fit` / `evaluate` fail under any multi-worker
strategy, keras-team/keras#20585; importing keras_rec_emb corrects that,
see docs/distributed.md.) Every worker saves (the
chief's copy is the one to keep): saving gathers every table's shards, so
every worker must take part.
"""


def run_multi_worker():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = build_dlrm()
    same_dense_init(model)
    # Worker i of n reads row groups g with g % n == i.
    train = strategy.distribute_datasets_from_function(
        lambda context: dataset(os.environ["KRE_GUIDE_DATA"], context.num_input_pipelines,
                                context.input_pipeline_id))
    model.fit(train, epochs=1, verbose=0)
    # Every worker takes part in a table's export, size() and saving.
    sizes = {f: model.get_layer(f"{f}_emb").table.size() for f in FEATURES}
    model.save(os.path.join(os.environ["KRE_GUIDE_OUT"], f"worker{task}.keras"))
    if task == 0:
        print("TABLES " + json.dumps(sizes), flush=True)


if ROLE == "worker":
    run_worker()
    sys.exit(0)
if ROLE == "multi_worker":
    run_multi_worker()
    sys.exit(0)

workdir = tempfile.mkdtemp()
data_path = os.path.join(workdir, "train.parquet")
write_data(data_path)

"""
## 1. One process
"""

plain = build_dlrm()
same_dense_init(plain)
plain.fit(dataset(data_path), epochs=1, verbose=0)
plain_pred = plain.predict(ids, verbose=0)
print("one process: user table has", plain.get_layer("user_emb").table_size(), "ids")

"""
## 2. Two replicas, tables sharded over them

Same data, same global batch: the same numbers as one process.
"""

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    mirrored = build_dlrm()
same_dense_init(mirrored)
mirrored.fit(dataset(data_path), epochs=1, verbose=0)
table = mirrored.get_layer("user_emb").table
print("shards:", [(s.device.split("/")[-1], s.size()) for s in table.shards])
np.testing.assert_allclose(mirrored.predict(ids, verbose=0), plain_pred, rtol=1e-4,
                           atol=1e-5)
print("2 replicas match one process")

# Saved under the strategy, loaded in one process: the shards are gathered.
mirrored.save(os.path.join(workdir, "mirrored.keras"))
reloaded = keras.saving.load_model(os.path.join(workdir, "mirrored.keras"))
assert reloaded.get_layer("user_emb").table_size() == table.size()

"""
## 3. Two worker processes: MultiWorkerMirroredStrategy

Two copies of this guide run `run_multi_worker` with `TF_CONFIG` naming
both (free ports on 127.0.0.1). The saved model loads into one process
(the shards were gathered) and predicts as one process trained with the
global batch does.
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


reference = build_dlrm()  # one process, the global batch of the 2 workers
same_dense_init(reference)
reference.fit(dataset(data_path, batch=2 * BATCH), epochs=1, verbose=0)

addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
procs = []
try:
    for task in range(2):
        env = dict(os.environ, KRE_GUIDE_ROLE="multi_worker", KRE_GUIDE_DATA=data_path,
                   KRE_GUIDE_OUT=workdir, TF_CONFIG=json.dumps({
                       "cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": task}}))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    out, _ = procs[0].communicate(timeout=600)
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"a MultiWorkerMirroredStrategy worker exited with "
                               f"{proc.returncode}")
finally:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # by its pid
        proc.wait(timeout=30)
sizes = json.loads([x for x in out.splitlines() if x.startswith("TABLES ")][0][7:])
print("2 workers' tables:", sizes)
assert sizes["user"] == plain.get_layer("user_emb").table_size()
gathered = keras.saving.load_model(os.path.join(workdir, "worker0.keras"))
np.testing.assert_allclose(gathered.predict(ids, verbose=0),
                           reference.predict(ids, verbose=0), rtol=1e-4, atol=1e-5)
print("2 workers match one process with their global batch")

"""
## 4. A localhost cluster: 2 parameter servers, 2 workers, a chief that saves

`keras-rec-emb ps --ps HOST:PORT,HOST:PORT --task I` runs parameter-server
task I (here `python -m keras_rec_emb.distribute.ps`, the same entry point).
Both workers start at once; the chief (worker 0) trains with a
`CheckpointCallback`, waits for worker 1, then saves a `.keras` file and a
SavedModel for serving. Every process started here is stopped by its pid at
the end.
"""


ps_addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
procs = []


def start_ps():
    for task in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "keras_rec_emb.distribute.ps",
             "--ps", ",".join(ps_addresses), "--task", str(task)],
            stdout=subprocess.DEVNULL))
    return procs[-2:]


def worker(task, **extra):
    env = dict(os.environ, KRE_GUIDE_ROLE="worker", KRE_GUIDE_PS=",".join(ps_addresses),
               KRE_GUIDE_TASK=str(task), KRE_GUIDE_WORKER=f"127.0.0.1:{free_port()}",
               KRE_GUIDE_DATA=data_path, KRE_GUIDE_OUT=workdir, **extra)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env,
                            stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


def finished(proc, servers):
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        # Say which process failed: a parameter server that exited (its
        # code; a negative one is the signal) or the worker itself.
        raise RuntimeError(f"worker exited with {proc.returncode}; parameter servers: "
                           f"{[p.poll() for p in servers]} (None: still running)")
    return out


try:
    servers = start_ps()
    chief, other = worker(0), worker(1)
    finished(other, servers)
    open(os.path.join(workdir, "worker1.done"), "w").close()
    out = finished(chief, servers)
    sizes = json.loads([x for x in out.splitlines() if x.startswith("TABLES ")][0][7:])
    cluster_pred = np.array(json.loads(
        [x for x in out.splitlines() if x.startswith("PREDICTED ")][0][10:]))
    print("cluster tables:", sizes)
    # Both workers' ids reached the shared tables: as many as one process saw.
    assert sizes["user"] == plain.get_layer("user_emb").table_size()

    """
    The chief's `.keras` file loads into one process (the shards gathered,
    the dense weights read from the PS tasks) and predicts what the cluster
    predicted; so does the SavedModel, served with stock TensorFlow ops.
    """

    saved = keras.saving.load_model(os.path.join(workdir, "ps_model.keras"))
    np.testing.assert_allclose(saved.predict(ids, verbose=0).ravel(), cluster_pred,
                               rtol=1e-5, atol=1e-6)
    served = tf.saved_model.load(os.path.join(workdir, "ps_served"))
    np.testing.assert_allclose(
        served.serve({k: tf.constant(v) for k, v in ids.items()}).numpy().ravel(),
        cluster_pred, rtol=1e-5, atol=1e-6)
    print("the chief's saved and served models match the cluster")

    """
    A PS task lost fails every worker with TensorFlow's `UnavailableError`
    naming the task, in seconds. Recovery is a restart: the PS tasks come
    back empty, the chief restores its last checkpoint inside its
    `parameter_servers` scope (before any other worker may start) and the
    cluster holds the saved tables and dense weights again.
    """

    for proc in servers:
        proc.kill()  # by its pid
        proc.wait(timeout=30)
    servers = start_ps()
    out = finished(worker(0, KRE_GUIDE_RESTORE="1"), servers)
    restored = np.array(json.loads(
        [x for x in out.splitlines() if x.startswith("PREDICTED ")][0][10:]))
    np.testing.assert_allclose(restored, cluster_pred, rtol=1e-5, atol=1e-6)
    print("restarted PS tasks hold the chief's checkpoint again")
finally:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
