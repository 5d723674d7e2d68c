"""Training steps/s of one CTR model: EmbeddingVariable tables vs Hashing+Embedding.

The same DLRM-style model (13 dense features and --features categorical ids,
each embedded in dim --dim, concatenated and fed to an MLP of 256-128-1
units with a sigmoid, binary cross-entropy) is built several ways and
trained side by side in one process on the same data:

* ``ev_adagrad``: one ``keras_rec_emb.layers.EmbeddingVariable`` per feature
  (its id is its key), ``keras_rec_emb.optimizers.Adagrad``.
* ``ev_adagrad_decay``: the same with ``keras_rec_emb.optimizers.AdagradDecay``.
* ``group_adagrad``: one ``keras_rec_emb.layers.GroupEmbedding`` over the
  same per-feature EmbeddingVariable tables (one fused lookup op, one fused
  backward op), ``keras_rec_emb.optimizers.Adagrad``.
* ``hashing_adagrad`` (the reference): per feature ``keras.layers.Hashing(
  --bins)`` then ``keras.layers.Embedding(--bins, dim)``, stock
  ``keras.optimizers.Adagrad`` (the stock Keras way for open-vocabulary ids).

Data: synthetic Criteo-like rows: 13 log-normal dense features and
--features categorical ids drawn Zipf(--zipf-a) and scattered over a space
of 10**9, a label from a hidden logistic model. --batches distinct batches of
--batch rows are built once and fed by ``tf.data`` (``cache().repeat()``,
the same dataset object for every model).

Timing: each model is compiled and first trained over every batch once
(warm-up: tracing, and every id inserted in the tables, so the tables do
not grow while timed). Then the models take turns, --reps rounds, each
running ``model.fit(dataset, steps_per_epoch=--steps, epochs=1)``; a
callback times each fit from the end of its first step to the end of its
last (steady state, without the fit's set-up), and a model's steps/s is one
over the median time per step of its fits. Ratios: every model's steps/s
over ``hashing_adagrad``'s (target from the issue: ``ev_adagrad`` >= 1.0x).

Run from the repository root:

    .venv/bin/python benchmarks/training.py            # batch 4096, 26 features
    .venv/bin/python benchmarks/training.py --quick    # a ~30 s run

Writes benchmarks/training.json (config, machine, times, ratios) or --json.
"""

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

from _common import parser
from _machine import machine_info, write_json_report

from keras_rec_emb.data.synthetic import NUM_DENSE
TARGET_EV_VS_HASHING = 1.0
MODELS = ("ev_adagrad", "ev_adagrad_decay", "group_adagrad", "hashing_adagrad")
REFERENCE = "hashing_adagrad"
LEARNING_RATE = 0.05
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "training.json")
QUICK = {"batch": 1024, "features": 8, "steps": 20, "reps": 3, "batches": 4,
         "bins": 20_000}


def parse_args(argv=None):
    p = parser(
        __doc__, batch=(4096, "rows per step"), features=(26, "categorical features"),
        dim=(16, "embedding width"), bins=(100_000, "Hashing bins per feature (reference model)"),
        steps=(50, "steps per timed fit"), reps=(5, "timed fits per model"),
        batches=(16, "distinct batches"), zipf_a=(1.2, "Zipf exponent of the ids"),
        models=(",".join(MODELS), f"comma-separated subset of {','.join(MODELS)}"), seed=0,
        json=(DEFAULT_JSON, "where to write results"))
    p.add_argument("--quick", action="store_true",
                   help="small sizes for a fast check: " +
                   " ".join(f"--{k} {v}" for k, v in QUICK.items()) +
                   " (explicit options win)")
    args = p.parse_args(argv)
    if args.quick:
        defaults = p.parse_args([])
        for key, value in QUICK.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown --models {unknown}; choose from {list(MODELS)}")
    if REFERENCE not in args.models:
        p.error(f"--models must include the reference {REFERENCE!r}")
    for key in ("batch", "features", "dim", "bins", "steps", "reps", "batches"):
        if getattr(args, key) <= 0:
            p.error(f"--{key} must be a positive integer, got {getattr(args, key)}")
    return args


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# -- Data ----------------------------------------------------------------------

def synthetic_rows(rows, features, zipf_a, seed):
    """Criteo-like inputs (the dense features as one [rows, 13] matrix) and
    a label learnable from them (`keras_rec_emb.data.synthetic_ctr`)."""
    columns = kre.data.synthetic_ctr(rows, features, seed=seed, zipf_a=zipf_a)
    x = {"dense": np.stack([columns.pop(f"I{j + 1}") for j in range(NUM_DENSE)], axis=1)}
    y = columns.pop("label")
    return {**x, **columns}, y


def make_dataset(x, y, batch):
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .batch(batch, drop_remainder=True).cache().repeat()
            .prefetch(tf.data.AUTOTUNE))


# -- Models ----------------------------------------------------------------------

def _inputs(features):
    inputs = {"dense": keras.Input((NUM_DENSE,), name="dense")}
    for j in range(features):
        inputs[f"C{j + 1}"] = keras.Input((), dtype="int64", name=f"C{j + 1}")
    return inputs


def _head(inputs, embedded):
    h = keras.layers.Concatenate()([inputs["dense"], *embedded])
    for i, units in enumerate((256, 128)):
        h = keras.layers.Dense(units, activation="relu", name=f"mlp_{i}")(h)
    return keras.layers.Dense(1, activation="sigmoid", name="click")(h)


def build_model(name, opts):
    inputs = _inputs(opts.features)
    cats = [k for k in inputs if k != "dense"]
    if name in ("ev_adagrad", "ev_adagrad_decay"):
        embedded = [kre.layers.EmbeddingVariable(opts.dim, name=f"ev_{k}")(inputs[k])
                    for k in cats]
    elif name == "group_adagrad":
        group = kre.layers.GroupEmbedding(
            {k: kre.layers.FeatureSpec(kre.layers.EmbeddingVariable(
                opts.dim, name=f"ev_{k}")) for k in cats}, output_mode="concat")
        embedded = [group({k: inputs[k] for k in cats})]
    else:
        embedded = [keras.layers.Embedding(opts.bins, opts.dim, name=f"emb_{k}")(
            keras.layers.Hashing(opts.bins, name=f"hash_{k}")(inputs[k])) for k in cats]
    model = keras.Model(inputs, _head(inputs, embedded), name=name)
    optimizer = {
        "ev_adagrad": lambda: kre.optimizers.Adagrad(LEARNING_RATE),
        "ev_adagrad_decay": lambda: kre.optimizers.AdagradDecay(
            LEARNING_RATE, accumulator_decay_step=1000),
        "group_adagrad": lambda: kre.optimizers.Adagrad(LEARNING_RATE),
        "hashing_adagrad": lambda: keras.optimizers.Adagrad(LEARNING_RATE),
    }[name]()
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    return model


# -- Timing ------------------------------------------------------------------------

class StepClock(keras.callbacks.Callback):
    """Wall time from the end of a fit's first step to the end of its last:
    steady-state steps, without the fit's set-up (iterator, callbacks)."""

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if batch == 0:
            self.start = now
        self.end = now


def timed_fit(model, dataset, steps):
    """Seconds per step over steps 2..`steps` of one fit, and its loss."""
    clock = StepClock()
    history = model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0,
                        callbacks=[clock])
    loss = history.history["loss"][-1]
    if not np.isfinite(loss):
        raise FloatingPointError(f"{model.name}: loss is {loss}")
    return (clock.end - clock.start) / max(steps - 1, 1), float(loss)


def main(argv=None):
    opts = parse_args(argv)
    keras.utils.set_random_seed(opts.seed)
    t0 = time.perf_counter()
    x, y = synthetic_rows(opts.batch * opts.batches, opts.features, opts.zipf_a, opts.seed)
    dataset = make_dataset(x, y, opts.batch)
    distinct = float(np.mean([np.unique(x[f"C{j + 1}"]).size for j in range(opts.features)]))
    log(f"data: {opts.batches} batches of {opts.batch} rows, {opts.features} features, "
        f"{distinct:,.0f} distinct ids per feature on average ({time.perf_counter() - t0:.1f}s)")

    models, losses = {}, {}
    for name in opts.models:
        t0 = time.perf_counter()
        models[name] = build_model(name, opts)
        # Warm-up: trace, build the optimizer, insert every id of every batch.
        timed_fit(models[name], dataset, opts.batches)
        _, losses[name] = timed_fit(models[name], dataset, 2)
        log(f"{name}: built and warmed up in {time.perf_counter() - t0:.1f}s")

    times = {name: [] for name in models}  # seconds per step, one per fit
    for r in range(opts.reps):
        for name, model in models.items():
            per_step, losses[name] = timed_fit(model, dataset, opts.steps)
            times[name].append(per_step)
        log(f"round {r + 1}/{opts.reps}: " + ", ".join(
            f"{n} {1 / times[n][-1]:.1f}" for n in models) + " steps/s")

    median = {name: statistics.median(ts) for name, ts in times.items()}
    steps_per_s = {name: 1 / m for name, m in median.items()}
    ratios = {f"{name}_over_{REFERENCE}": steps_per_s[name] / steps_per_s[REFERENCE]
              for name in models if name != REFERENCE}
    table_rows = {}
    for name, model in models.items():
        evs = [layer for layer in model._flatten_layers()
               if isinstance(layer, kre.layers.EmbeddingVariable)]
        table_rows[name] = int(sum(layer.table_size() for layer in evs)) if evs else None

    print(f"\nTraining steps/s: batch {opts.batch}, {opts.features} features x dim "
          f"{opts.dim}, Hashing bins {opts.bins:,}, median of {opts.reps} fits of "
          f"{opts.steps} steps")
    print(f"{'model':<18}{'steps/s':>10}{'rows/s':>12}{'x ' + REFERENCE:>22}{'loss':>8}")
    for name in models:
        print(f"{name:<18}{steps_per_s[name]:>10.1f}{steps_per_s[name] * opts.batch:>12,.0f}"
              f"{steps_per_s[name] / steps_per_s[REFERENCE]:>21.2f}x{losses[name]:>8.3f}")
    meets = None
    if "ev_adagrad" in models:
        ratio = ratios[f"ev_adagrad_over_{REFERENCE}"]
        meets = ratio >= TARGET_EV_VS_HASHING
        print(f"\nev_adagrad / {REFERENCE} = {ratio:.2f}x (target >= "
              f"{TARGET_EV_VS_HASHING}x: {'met' if meets else 'NOT met'})")

    report = {
        "benchmark": "training",
        "config": {k: v for k, v in vars(opts).items() if k != "json"},
        "machine": machine_info(),
        "data": {"rows": opts.batch * opts.batches,
                 "mean_distinct_ids_per_feature": distinct},
        "targets": {f"ev_adagrad_over_{REFERENCE}": TARGET_EV_VS_HASHING},
        "median_s_per_step": median,
        "times_s_per_step": times,
        "steps_per_s": steps_per_s,
        "final_loss": losses,
        "table_rows": table_rows,
        "ratios": ratios,
        "meets_target": meets,
    }
    write_json_report(opts.json, report)


if __name__ == "__main__":
    main()
