"""End-to-end `model.fit` epochs: GroupEmbedding vs separate EmbeddingVariable layers.

The demo's model (`keras_rec_emb.cli.build_model`: 13 dense features,
--features categorical ids with a CounterFilter(2) and GlobalStepEvict
table each, MLP 64-32-1, AdagradDecay) is built three ways over the same
synthetic Criteo-like Parquet file (`keras_rec_emb.cli.synthetic_ctr`),
read by `ParquetDataset`, each model with its own tables:

* ``group``: one ``GroupEmbedding(output_mode="concat")`` (the demo);
* ``group_dict``: one ``GroupEmbedding(output_mode="dict")``, its outputs
  concatenated by Keras;
* ``separate``: one ``EmbeddingVariable`` layer per feature.

Each model trains --epochs epochs of --rows rows; the models alternate epoch
by epoch (so all see the same machine state) and each epoch's wall and CPU
time is measured by `model.fit` itself (a callback from epoch begin to end).
Epoch 1 includes tracing and every table's growth and is left out of the
medians. Reported: per-epoch seconds per model, and per steady epoch the
ratio separate/group (> 1: the group is faster), as median, min and max.
Then --step-rounds rounds time one training step per model (the compiled
step `fit` runs, `model.train_function`, on an iterator over the same
dataset repeated; the models in turn step by step, so a burst of load from
other processes hits all alike): the median step's wall and CPU
milliseconds and the median over blocks of 10 rounds of separate/group.

    .venv/bin/python benchmarks/fit_epoch.py --threads 1     # 300k rows, 4 epochs, 200 step rounds
    .venv/bin/python benchmarks/fit_epoch.py --rows 100000   # quicker

Writes benchmarks/fit_epoch.json or --json.
"""

import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras

import keras_rec_emb as kre
from keras_rec_emb import cli

from _common import parser
from _machine import machine_info, median_range, write_json_report

MODES = ("group", "group_dict", "separate")


def parse_args(argv=None):
    return parser(
        __doc__, rows=300_000, features=26, dim=16, batch_size=4096, epochs=4,
        threads=(0, "TensorFlow intra-op threads, the same for every model (0: TF's default)"),
        step_rounds=(200, "rounds of one timed train_on_batch step per model (0: none)"),
        modes=(",".join(MODES),
               f"comma-separated subset of {MODES} (separate is needed for ratios)"),
        json=os.path.join(os.path.dirname(__file__), "fit_epoch.json")).parse_args(argv)


def build(mode, opts, steps):
    """The demo's model; for ``group_dict`` and ``separate`` its layers are
    reused around a dict-mode group or one table layer per feature (each
    model builds its own tables)."""
    model = cli.build_model(opts.features, opts.dim, steps_to_live=max(1, steps // 2))
    if mode == "group":
        return model
    group = model.get_layer("embeddings")
    inputs = {t.name: t for t in model.inputs}
    cat_in = {name: inputs[name] for name in group.features}
    if mode == "group_dict":
        dict_group = kre.layers.GroupEmbedding(
            {name: kre.layers.FeatureSpec(group.tables[spec.table])
             for name, spec in group.features.items()}, output_mode="dict")
        by_name = dict_group(cat_in)
        embedded = [by_name[name] for name in group.features]
    else:
        embedded = [group.tables[spec.table](cat_in[name])
                    for name, spec in group.features.items()]
    dense_in = [keras.ops.expand_dims(v, -1) for k, v in inputs.items() if k.startswith("I")]
    bottom = model.get_layer("bottom")(model.get_layer("dense")(dense_in))
    h = keras.layers.Concatenate(name="features")([bottom, *embedded])
    for i in range(2):
        h = model.get_layer(f"top_{i}")(h)
    out = model.get_layer("click")(h)
    other = keras.Model(inputs, out)
    other.compile(optimizer=kre.optimizers.AdagradDecay(
        0.05, accumulator_decay_step=1000, accumulator_decay_rate=0.9),
        loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")])
    return other


class EpochClock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start
        # CPU seconds of all the process's threads: less sensitive than wall
        # time to other processes loading the machine.
        self.cpu_seconds = time.process_time() - self.cpu_start


def summarize(times, cpu):
    """Per group mode, the per-epoch ratios separate/group over the steady
    epochs (wall and CPU), as median, min and max."""
    out = {}
    for mode in times:
        if mode == "separate" or "separate" not in times:
            continue
        entry = {}
        for what, data in (("wall", times), ("cpu", cpu)):
            ratios = [s / g for s, g in zip(data["separate"][1:], data[mode][1:])]
            if ratios:
                entry[what] = median_range(ratios)
        out[mode] = entry
    return out


def time_steps(models, dataset, rounds):
    """Per model, the wall and CPU seconds of `rounds` single training steps
    (fit's compiled step on an iterator), the models taking turns."""
    wall = {m: [] for m in models}
    cpu = {m: [] for m in models}
    iterators = {m: iter(dataset().repeat()) for m in models}
    for _ in range(rounds):
        for mode, model in models.items():
            t0, c0 = time.perf_counter(), time.process_time()
            model.train_function(iterators[mode])
            wall[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
    return wall, cpu


def step_summary(wall, cpu):
    """Median step ms per model and, per group mode, the median, min and
    max over rounds of separate/group (wall and CPU)."""
    out = {"median_ms": {m: 1e3 * statistics.median(t) for m, t in wall.items()},
           "median_cpu_ms": {m: 1e3 * statistics.median(t) for m, t in cpu.items()}}
    if "separate" in wall:
        for mode in wall:
            if mode == "separate":
                continue
            entry = {}
            for what, data in (("wall", wall), ("cpu", cpu)):
                # Ratios of medians over blocks of 10 rounds: one round's
                # ratio is too noisy on a shared machine.
                n = len(data[mode])
                blocks = [(statistics.median(data["separate"][i:i + 10]),
                           statistics.median(data[mode][i:i + 10])) for i in range(0, n, 10)]
                ratios = [a / b for a, b in blocks]
                entry[what] = median_range(ratios)
            out[f"separate_over_{mode}"] = entry
    return out


def main(argv=None):
    opts = parse_args(argv)
    modes = [m.strip() for m in opts.modes.split(",")]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes must be a subset of {MODES}; got {opts.modes!r}")
    if opts.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(opts.threads)
    keras.utils.set_random_seed(0)
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "train.parquet")
    cli.write_parquet(path, cli.synthetic_ctr(opts.rows, opts.features))
    steps = -(-opts.rows // opts.batch_size)

    def dataset():
        return kre.data.ParquetDataset(path, batch_size=opts.batch_size).map(
            lambda b: ({k: v for k, v in b.items() if k != "label"}, b["label"]))

    models = {mode: build(mode, opts, steps) for mode in modes}
    times = {mode: [] for mode in modes}
    cpu = {mode: [] for mode in modes}
    for epoch in range(opts.epochs):
        for mode in modes:
            clock = EpochClock()
            models[mode].fit(dataset(), epochs=1, verbose=0, callbacks=[clock])
            times[mode].append(clock.seconds)
            cpu[mode].append(clock.cpu_seconds)
            print(f"epoch {epoch + 1} {mode:10s} {clock.seconds:7.2f} s "
                  f"({clock.cpu_seconds:.2f} s CPU)", flush=True)
    steps_report = None
    if opts.step_rounds:
        wall, step_cpu = time_steps(models, dataset, opts.step_rounds)
        steps_report = step_summary(wall, step_cpu)
        for mode in modes:
            print(f"step {mode:13s}: median {steps_report['median_ms'][mode]:.1f} ms "
                  f"({steps_report['median_cpu_ms'][mode]:.1f} ms CPU)")
        for mode in modes:
            r = steps_report.get(f"separate_over_{mode}")
            if r:
                print(f"step separate/{mode}: wall {r['wall']['median']:.2f}x "
                      f"[{r['wall']['min']:.2f}-{r['wall']['max']:.2f}], CPU "
                      f"{r['cpu']['median']:.2f}x [{r['cpu']['min']:.2f}-{r['cpu']['max']:.2f}]")
    steady = {m: statistics.median(t[1:]) if len(t) > 1 else t[0] for m, t in times.items()}
    steady_cpu = {m: statistics.median(t[1:]) if len(t) > 1 else t[0] for m, t in cpu.items()}
    ratios = summarize(times, cpu)
    print("epoch 1 (tracing + growth): " + ", ".join(
        f"{m} {times[m][0]:.2f} s" for m in modes))
    for mode, r in ratios.items():
        if "wall" in r:
            print(f"steady epoch {mode:13s}: {steady[mode]:.2f} s ({steady_cpu[mode]:.2f} s CPU), "
                  f"separate {steady['separate']:.2f} s ({steady_cpu['separate']:.2f} s CPU); "
                  f"separate/{mode} wall {r['wall']['median']:.2f}x "
                  f"[{r['wall']['min']:.2f}-{r['wall']['max']:.2f}], "
                  f"CPU {r['cpu']['median']:.2f}x [{r['cpu']['min']:.2f}-{r['cpu']['max']:.2f}]")
    print(json.dumps({f"epoch_separate_over_{m}": {k: round(v["median"], 3)
                                                   for k, v in r.items()}
                      for m, r in ratios.items()} | {
        f"step_{k}": {w: round(v["median"], 3) for w, v in r.items()}
        for k, r in (steps_report or {}).items() if k.startswith("separate_over")}))
    write_json_report(opts.json, {
        "config": vars(opts), "machine": machine_info(), "seconds": times, "cpu_seconds": cpu,
        "steady_seconds": steady, "steady_cpu_seconds": steady_cpu,
        "separate_over_group": ratios, "steps": steps_report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
