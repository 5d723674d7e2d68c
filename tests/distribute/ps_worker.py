"""A worker or checker process of the parameter-server tests (run by
tests/distribute/test_parameter_servers.py, never collected by pytest).

    ps_worker.py train --ps A,B --worker ADDR --task I --out DIR
    ps_worker.py check --ps A,B --worker ADDR --task I --out DIR
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import keras_rec_emb as kre

DIM, BATCH, STEPS, IDS_PER_ROW, LR = 4, 8, 6, 3, 0.1


ROW_GROUP = 2 * BATCH
NUM_ROWS = 2 * STEPS * BATCH


def all_data():
    """Ids [NUM_ROWS, IDS_PER_ROW] and per-example weights [NUM_ROWS]."""
    rng = np.random.default_rng(100)
    ids = rng.integers(0, 30, size=(NUM_ROWS, IDS_PER_ROW)).astype(np.int64)
    weights = rng.uniform(-1, 1, size=NUM_ROWS).astype(np.float32)
    return ids, weights


def write_parquet(path):
    """The training file: row groups of ROW_GROUP rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids, weights = all_data()
    columns = {f"id{j}": ids[:, j] for j in range(IDS_PER_ROW)}
    columns["weight"] = weights
    pq.write_table(pa.table(columns), path, row_group_size=ROW_GROUP)


def worker_rows(task, num_workers=2):
    """The rows worker `task` reads: row groups g with g % num_workers == task."""
    groups = np.arange(NUM_ROWS) // ROW_GROUP
    return np.flatnonzero(groups % num_workers == task)


def worker_dataset(path, task, num_workers=2):
    """Worker `task`'s own part of the Parquet file (ParquetDataset's
    partition_count/partition_index), as (ids, weights) batches."""
    import tensorflow as tf

    ds = kre.data.ParquetDataset(path, batch_size=BATCH, partition_count=num_workers,
                                 partition_index=task)
    return ds.map(lambda d: (tf.stack([d[f"id{j}"] for j in range(IDS_PER_ROW)], axis=1),
                             d["weight"]))


def linear_loss(y_true, y_pred):
    """Linear in the rows: each lookup's gradient does not depend on the
    table, so the final rows are the initial ones minus the sum of pushes
    in any order."""
    return y_true * y_pred


def build_model():
    ids = keras.Input(shape=(IDS_PER_ROW,), dtype="int64")
    rows = kre.layers.EmbeddingVariable(
        DIM, name="emb",
        initializer=keras.initializers.RandomUniform(-1, 1, seed=7),
        ev_option=kre.EmbeddingVariableOption(
            init_option=kre.InitializerOption(default_value_dim=16), track_meta=True))(ids)
    out = keras.ops.sum(rows, axis=(1, 2))
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.SGD(LR), loss=linear_loss)
    return model


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["train", "check"])
    p.add_argument("--ps", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--task", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    devices = kre.distribute.connect(args.ps.split(","), args.worker, args.task,
                                     timeout=120)
    with kre.distribute.parameter_servers(devices):
        model = build_model()
    if args.role == "train":
        model.fit(worker_dataset(os.path.join(args.out, "train.parquet"), args.task),
                  epochs=1, verbose=0)
        placed = {s.device for s in model.get_layer("emb").table.shards}
        with open(os.path.join(args.out, f"placed_{args.task}.txt"), "w") as f:
            f.write("\n".join(sorted(placed)))
    else:
        table = model.get_layer("emb").table
        data = table.export()
        np.savez(os.path.join(args.out, "table.npz"), keys=data["keys"],
                 values=data["values"], freqs=data["freqs"],
                 default_values=data["default_values"],
                 shard_sizes=np.array([s.size() for s in table.shards]))
        model.save(os.path.join(args.out, "ps_model.keras"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
