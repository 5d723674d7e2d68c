"""A worker or checker process of the parameter-server tests (run by
tests/distribute/test_parameter_servers.py, never collected by pytest).

    ps_worker.py train --ps A,B --worker ADDR --task I --out DIR
    ps_worker.py check --ps A,B --worker ADDR --task I --out DIR
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_rec_emb as kre  # noqa: E402

DIM, BATCH, STEPS, IDS_PER_ROW, LR = 4, 8, 6, 3, 0.1


def worker_data(task):
    """Ids [STEPS * BATCH, IDS_PER_ROW] and per-example weights [N] of a
    worker; the two workers' ids overlap on 0..19."""
    rng = np.random.default_rng(100 + task)
    n = STEPS * BATCH
    ids = rng.integers(0, 20 + 10 * task, size=(n, IDS_PER_ROW)).astype(np.int64)
    weights = rng.uniform(-1, 1, size=n).astype(np.float32)
    return ids, weights


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
        ids, weights = worker_data(args.task)
        model.fit(ids, weights, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
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
