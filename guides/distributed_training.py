"""
Title: Distributed training: tables sharded over replicas and parameter servers
Author: keras_rec_emb authors
Description: The same small DLRM trained in one process, on 2 logical devices
with MirroredStrategy (tables sharded over the replicas), and on a localhost
cluster of 2 parameter servers and 2 workers, each worker reading its own
part of the Parquet data.
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
* **Asynchronous (parameter servers).** Tables live on parameter-server
  tasks: `tf.distribute.Server` processes started with `keras-rec-emb ps`.
  Workers connect with `keras_rec_emb.distribute.connect` and build their
  model inside `keras_rec_emb.distribute.parameter_servers(devices)`; each
  table is sharded by key hash over the PS tasks, TensorFlow's gRPC runtime
  carries ids and rows, and workers push sparse updates without waiting for
  each other (DeepRec's default mode for CPU clusters). Dense weights stay
  on each worker in this version.

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

# The guide starts copies of itself as cluster workers (see the last part).
ROLE = os.environ.get("KRE_GUIDE_ROLE", "main")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

if ROLE == "main":
    # Logical devices must be configured before TensorFlow starts.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

import keras_rec_emb as kre  # noqa: E402

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


def dataset(path, partition_count=1, partition_index=0):
    ds = kre.data.ParquetDataset(path, batch_size=BATCH, partition_count=partition_count,
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


def same_dense_init(model):
    """Every run starts from the same dense weights."""
    rng = np.random.default_rng(7)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layer.set_weights([rng.normal(scale=0.1, size=w.shape).astype(np.float32)
                               for w in layer.get_weights()])


"""
## Parameter-server workers

A worker connects (the error names an address that does not answer within
`timeout`), builds the model inside `parameter_servers(devices)` and trains
on its own partition. This function runs in the worker processes that the
last part starts.
"""


def run_worker():
    ps = os.environ["KRE_GUIDE_PS"].split(",")
    task = int(os.environ["KRE_GUIDE_TASK"])
    devices = kre.distribute.connect(ps, os.environ["KRE_GUIDE_WORKER"], task, timeout=120)
    with kre.distribute.parameter_servers(devices):
        model = build_dlrm()
    if task < 2:
        model.fit(dataset(os.environ["KRE_GUIDE_DATA"], 2, task), epochs=1, verbose=0)
    else:  # the last one only reads: the tables' sizes after both workers
        sizes = {f: model.get_layer(f"{f}_emb").table_size() for f in FEATURES}
        print("TABLES " + json.dumps(sizes), flush=True)


if ROLE == "worker":
    run_worker()
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
ids = {f: np.arange(1, 9, dtype=np.int64) for f in FEATURES}
ids["dense"] = np.linspace(-1, 1, 8).astype(np.float32)
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
## 3. A localhost cluster: 2 parameter servers, 2 workers

`keras-rec-emb ps --ps HOST:PORT,HOST:PORT --task I` runs parameter-server
task I (here `python -m keras_rec_emb.distribute.ps`, the same entry point).
Every process started here is stopped by its pid at the end.
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ps_addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
procs = []
try:
    for task in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "keras_rec_emb.distribute.ps",
             "--ps", ",".join(ps_addresses), "--task", str(task)],
            stdout=subprocess.DEVNULL))

    def worker(task):
        env = dict(os.environ, KRE_GUIDE_ROLE="worker", KRE_GUIDE_PS=",".join(ps_addresses),
                   KRE_GUIDE_TASK=str(task), KRE_GUIDE_WORKER=f"127.0.0.1:{free_port()}",
                   KRE_GUIDE_DATA=data_path)
        return subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env,
                                stdout=subprocess.PIPE, text=True)

    workers = [worker(0), worker(1)]
    procs += workers
    for w in workers:
        assert w.wait(timeout=600) == 0
    reader = worker(2)
    procs.append(reader)
    out, _ = reader.communicate(timeout=600)
    sizes = json.loads([x for x in out.splitlines() if x.startswith("TABLES ")][0][7:])
    print("cluster tables:", sizes)
    # Both workers' ids reached the shared tables: as many as one process saw.
    assert sizes["user"] == plain.get_layer("user_emb").table_size()
finally:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
