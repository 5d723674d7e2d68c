"""Ours on Keras's JAX backend against ours on TensorFlow (issue 42.4).

The peer workload (`benchmarks/peers`: 26 features, dim 16, batch 4096,
Adagrad, 1 and 1-5 ids padded with -1) in each form both backends run: one
GroupEmbedding (`ours_jax_group` vs `ours_group`) and 26 separate
EmbeddingVariable layers with combiner "sum" (`ours_jax` vs
`ours_separate`). `peers/run.py` starts one worker per framework, warms
each up and interleaves the rounds (one worker running at a time, order
reversed every other round); every round measures training steps/s
(`model.fit`) and the forward lookup of the embedding part (inference),
and the ratios are the medians of the per-round ratios: steps/s JAX / TF
and forward ms TF / JAX, so above 1 is JAX faster. Target (issue 57): >= 0.9 for
both at 1 thread.

One thread for both: TensorFlow's intra-op pool 1 and inter-op pool 1
(`worker_keras.py`); XLA's CPU client `--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1` (`worker_jax.py`); the table kernels run on
the calling thread in both.

    .venv/bin/python benchmarks/jax_speed.py            # 7 rounds, 1 thread
    .venv/bin/python benchmarks/jax_speed.py --store    # and benchmarks/results/jax_speed.json

Prints a table of the ratios and the JSON (also in OUT/jax_speed.json).
"""

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))
import run as peers  # noqa: E402

FRAMEWORKS = ("ours_group", "ours_jax_group", "ours_separate", "ours_jax")
TARGET = 0.9
STORED = HERE / "results" / "jax_speed.json"


def ratios(report):
    """[{config, form, metric, median, min, max, met}] of every JAX form."""
    rows = []
    for key, res in report["results"].items():
        for name, r in res["frameworks"].items():
            vs = r.get("vs_tensorflow")
            if not vs:
                continue
            for metric in ("steps_per_s", "lookup_ms"):
                q = vs[metric]
                if q is None:
                    continue
                rows.append({"config": key, "jax": name, "tensorflow": vs["peer"],
                             "metric": "training steps/s, JAX / TF" if metric == "steps_per_s"
                             else "forward lookup, TF ms / JAX ms",
                             **q, "target": TARGET, "met": q["median"] >= TARGET})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1")
    p.add_argument("--variants", default="single,multi")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lookups", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="tiny sizes (peers' --quick)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--output-dir", default=str(peers.DEFAULT_OUT / "jax_speed"))
    p.add_argument("--store", action="store_true", help=f"also write {STORED.name} in "
                   "benchmarks/results")
    a = p.parse_args(argv)
    args = ["--frameworks", ",".join(FRAMEWORKS), "--threads", a.threads,
            "--variants", a.variants, "--output-dir", a.output_dir]
    if a.quick:
        args.append("--quick")
    else:
        args += ["--rounds", str(a.rounds), "--steps", str(a.steps), "--lookups", str(a.lookups)]
    if a.data_dir:
        args += ["--data-dir", a.data_dir]
    report = peers.main(args)
    report["benchmark"] = "jax_speed"
    report["command"] = " ".join(["python benchmarks/jax_speed.py",
                                  *(sys.argv[1:] if argv is None else argv)])
    report["jax_vs_tensorflow"] = rows = ratios(report)
    print("\nJAX / TensorFlow (paired per-round ratios, median (min-max); above 1: JAX faster; "
          f"target >= {TARGET}):\n")
    print("| configuration | form | comparison | ratio | met |\n|---|---|---|---|---|")
    for r in rows:
        form = "GroupEmbedding" if r["tensorflow"] == "ours_group" else "26 EmbeddingVariable"
        print(f"| {r['config']} | {form} | {r['metric']} | {r['median']:.2f} "
              f"({r['min']:.2f}-{r['max']:.2f}) | {'yes' if r['met'] else 'no'} |")
    text = json.dumps(report, indent=1) + "\n"
    out = pathlib.Path(a.output_dir) / "jax_speed.json"
    out.write_text(text)
    if a.store:
        STORED.write_text(text)
    print(json.dumps({"jax_vs_tensorflow": rows}, indent=1))
    return report


if __name__ == "__main__":
    main()
