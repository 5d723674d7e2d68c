"""The separate layers' forward time, against one GroupEmbedding (issue 38).

The peer workload's 1-5-id batch (`benchmarks/peers/workload.py`: 26
features, dim 16, batch 4096, ids padded with -1) through 26
`EmbeddingVariable(combiner="sum", prune_invalid_ids=True)` layers, which
one `GroupEmbedding` over the same tables also reads (trained together
first: one `fit` epoch of the group over the workload's batches). Each
form is a `tf.function` of the inference lookup (`training=False`) on
pre-built tensors, one thread; the forms are timed in turn, round after
round:

* ``group``: the GroupEmbedding on the stacked `[batch, F, L]` ids;
* ``unstack+concat``: the 26 layers on `tf.unstack(ids, axis=1)`, their
  outputs `tf.concat`-ed (the peer benchmark's separate form);
* ``split+concat``: the 26 layers on ids split beforehand, outputs
  concatenated;
* ``split, list``: the 26 layers on ids split beforehand, their outputs
  returned as a list (no concat).

In a `tf.function` each of the 26 calls looks its ids up at the call, one
op each, as it does eagerly (only the layers of one Functional model call
share one op, `keras_rec_emb/backend/tensorflow/model_fusion.py`): this measures what
the separate form costs where the fused form is a `GroupEmbedding`.

Prints each form's median ms and its ratio to ``group`` (group ms / form
ms, median (min-max) of the per-round ratios; 1 is as fast as the group),
and the JSON.

    .venv/bin/python benchmarks/separate_layers.py
    .venv/bin/python benchmarks/separate_layers.py --rounds 9 --calls 50 --json out.json
"""

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import workload  # noqa: E402
from _machine import machine_info, median_range, write_json_report  # noqa: E402

import keras_rec_emb as kre  # noqa: E402

FORMS = ("group", "unstack+concat", "split+concat", "split, list")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50, help="calls per form and round")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "kre-peers-data"))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    workload.generate(a.data_dir, workload.FULL)
    ids, labels, meta = workload.load(a.data_dir, "multi")
    F, dim, batch = meta["features"], meta["dim"], meta["batch"]
    tables = [kre.layers.EmbeddingVariable(dim, combiner="sum", prune_invalid_ids=True,
                                           name=f"t{j}") for j in range(F)]
    group = kre.layers.GroupEmbedding(
        {f"f{j}": kre.layers.FeatureSpec(tables[j], combiner="sum") for j in range(F)},
        output_mode="concat")
    inputs = keras.Input(shape=ids.shape[1:], dtype="int64", batch_size=batch)
    trainer = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(group(inputs)))
    trainer.compile(optimizer=kre.optimizers.Adagrad(meta["learning_rate"]),
                    loss="binary_crossentropy")
    trainer.fit(ids, labels[:, None], batch_size=batch, epochs=1, shuffle=False, verbose=0)

    stacked = tf.constant(ids[:batch])
    split = tf.unstack(stacked, axis=1)
    fns = {
        "group": (tf.function(lambda x: group(x, training=False)), stacked),
        "unstack+concat": (tf.function(lambda x: tf.concat(
            [t(c, training=False) for t, c in zip(tables, tf.unstack(x, axis=1))], 1)), stacked),
        "split+concat": (tf.function(lambda cs: tf.concat(
            [t(c, training=False) for t, c in zip(tables, cs)], 1)), split),
        "split, list": (tf.function(lambda cs: [t(c, training=False)
                                               for t, c in zip(tables, cs)]), split),
    }
    want = fns["group"][0](stacked).numpy()
    for name, (fn, x) in fns.items():  # the same rows every way
        out = fn(x)
        got = np.concatenate([o.numpy() for o in out], 1) if isinstance(out, list) else out
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
    ms = {name: [] for name in FORMS}
    for _ in range(a.rounds):
        for name in FORMS:
            fn, x = fns[name]
            start = time.perf_counter()
            for _ in range(a.calls):
                fn(x)
            ms[name].append((time.perf_counter() - start) / a.calls * 1e3)
    results = {name: {"ms": statistics.median(ms[name]),
                      "vs_group": median_range([g / m for g, m in zip(ms["group"], ms[name])])}
               for name in FORMS}
    print(f"forward lookup, {F} features x 1-5 ids, dim {dim}, batch {batch}, 1 thread; "
          f"median of {a.rounds} rounds of {a.calls} calls; ratio = group ms / form ms")
    print("| form | ms | vs group |\n|---|---|---|")
    for name, r in results.items():
        q = r["vs_group"]
        print(f"| {name} | {r['ms']:.2f} | {q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}) |")
    report = {"benchmark": "separate_layers", "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python", "benchmarks/separate_layers.py", *(argv or
                                                                              sys.argv[1:])]),
              "load_average": list(os.getloadavg()), "machine": machine_info(),
              "workload": {k: meta[k] for k in ("features", "dim", "batch", "max_ids")},
              "rounds": a.rounds, "calls": a.calls, "results": results}
    if a.json:
        write_json_report(a.json, report)
    else:
        import json
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
