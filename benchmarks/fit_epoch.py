"""End-to-end `model.fit` epochs: one GroupEmbedding vs separate EmbeddingVariable layers.

The demo's model (`keras_rec_emb.cli.build_model`: 13 dense features,
--features categorical ids with a CounterFilter(2) and GlobalStepEvict
table each, MLP 64-32-1, AdagradDecay) is built two ways over the same
synthetic Criteo-like Parquet file (`keras_rec_emb.cli.synthetic_ctr`),
read by `ParquetDataset`:

* ``group``: one ``GroupEmbedding`` over the per-feature tables (the demo).
* ``separate``: one ``EmbeddingVariable`` layer per feature.

Each model trains --epochs epochs of --rows rows; the models alternate epoch
by epoch (so both see the same machine state) and each epoch's wall time is
measured by `model.fit` itself (a callback from epoch begin to end). Epoch 1
includes tracing and every table's growth; later epochs are steady.
Reported: per-epoch seconds per model and the ratio separate/group (> 1:
the group is faster).

    .venv/bin/python benchmarks/fit_epoch.py                 # 300k rows, 3 epochs
    .venv/bin/python benchmarks/fit_epoch.py --rows 100000   # quicker

Writes benchmarks/fit_epoch.json or --json.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402

import keras_rec_emb as kre  # noqa: E402
from keras_rec_emb import cli  # noqa: E402

from _machine import machine_info  # noqa: E402  (run as a script)

MODES = ("group", "separate")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "fit_epoch.json"))
    return p.parse_args(argv)


def build(mode, opts, steps):
    model = cli.build_model(opts.features, opts.dim, steps_to_live=max(1, steps // 2))
    if mode == "group":
        return model
    # The same layers without the group: each table looks its feature up.
    group = model.get_layer("embeddings")
    inputs = dict(zip(model.input_names if hasattr(model, "input_names") else [],
                      model.inputs)) or {t.name: t for t in model.inputs}
    dense_in = {k: v for k, v in inputs.items() if k.startswith("I")}
    embedded = [group.tables[spec.table](inputs[name])
                for name, spec in group.features.items()]
    bottom = model.get_layer("bottom")(model.get_layer("dense")(
        [keras.ops.expand_dims(x, -1) for x in dense_in.values()]))
    h = keras.layers.Concatenate(name="features")([bottom, *embedded])
    for i in range(2):
        h = model.get_layer(f"top_{i}")(h)
    out = model.get_layer("click")(h)
    separate = keras.Model(inputs, out)
    separate.compile(optimizer=kre.optimizers.AdagradDecay(
        0.05, accumulator_decay_step=1000, accumulator_decay_rate=0.9),
        loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")])
    return separate


class EpochClock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start
        # CPU seconds of all the process's threads: less sensitive than wall
        # time to other processes loading the machine.
        self.cpu_seconds = time.process_time() - self.cpu_start


def main(argv=None):
    opts = parse_args(argv)
    keras.utils.set_random_seed(0)
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "train.parquet")
    cli.write_parquet(path, cli.synthetic_ctr(opts.rows, opts.features))
    steps = -(-opts.rows // opts.batch_size)

    def dataset():
        return kre.data.ParquetDataset(path, batch_size=opts.batch_size).map(
            lambda b: ({k: v for k, v in b.items() if k != "label"}, b["label"]))

    models = {mode: build(mode, opts, steps) for mode in MODES}
    times = {mode: [] for mode in MODES}
    cpu = {mode: [] for mode in MODES}
    for epoch in range(opts.epochs):
        for mode in MODES:
            clock = EpochClock()
            models[mode].fit(dataset(), epochs=1, verbose=0, callbacks=[clock])
            times[mode].append(clock.seconds)
            cpu[mode].append(clock.cpu_seconds)
            print(f"epoch {epoch + 1} {mode:9s} {clock.seconds:7.2f} s "
                  f"({clock.cpu_seconds:.2f} s CPU)", flush=True)
    steady = {m: statistics.median(t[1:]) if len(t) > 1 else t[0] for m, t in times.items()}
    ratio = steady["separate"] / steady["group"]
    print(f"epoch 1 (tracing + growth): group {times['group'][0]:.2f} s, "
          f"separate {times['separate'][0]:.2f} s")
    print(f"steady epoch: group {steady['group']:.2f} s, separate {steady['separate']:.2f} s, "
          f"separate/group = {ratio:.2f}x")
    with open(opts.json, "w") as f:
        json.dump({"config": vars(opts), "machine": machine_info(), "seconds": times,
                   "steady_seconds": steady, "cpu_seconds": cpu, "separate_over_group": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
