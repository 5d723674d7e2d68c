"""The `keras-rec-emb` command's front: argument parsing, `--help` and
`--version` without importing TensorFlow.

It lives outside the `keras_rec_emb` package because importing anything in
that package runs its `__init__`, which loads Keras, TensorFlow and the
compiled ops (3-4 s and start-up log lines). The commands themselves are in
`keras_rec_emb.cli`, imported only once a command runs, after TensorFlow's
C++ logging has been quieted (`TF_CPP_MIN_LOG_LEVEL=2` unless set).

    keras-rec-emb demo [--rows N] [--epochs E] [--output DIR]
    keras-rec-emb bench [--quick] [--output-dir DIR]
    keras-rec-emb inspect MODEL.keras|SAVEDMODEL_DIR|ckpt-*.npz [--rows K] [--json]
    keras-rec-emb strip-filtered IN.keras OUT.keras
    keras-rec-emb ps --ps HOST:PORT,HOST:PORT --task I
"""

import argparse
import os
import sys

def version():
    """The installed distribution's version (no import of the package)."""
    from importlib import metadata

    try:
        return metadata.version("keras-rec-emb")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parser():
    p = argparse.ArgumentParser(
        prog="keras-rec-emb",
        description="Industrial sparse embeddings for Keras 3: demo, benchmarks and "
                    "tools for saved models.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("demo", help="train, evaluate, save, reload and export a CTR model "
                                    "on synthetic Criteo-like Parquet data")
    c.add_argument("--rows", type=_positive_int, default=1_000_000,
                   help="rows of synthetic data (90%% train, 10%% test)")
    c.add_argument("--epochs", type=_positive_int, default=1)
    c.add_argument("--features", type=_positive_int, default=26,
                   help="categorical features (one EmbeddingVariable each)")
    c.add_argument("--dim", type=_positive_int, default=16, help="embedding dimension")
    c.add_argument("--batch-size", type=_positive_int, default=4096)
    c.add_argument("--output", default="demo-output", help="directory for the saved models")
    c = sub.add_parser("bench", add_help=False,
                       help="run the benchmarks of a source checkout's benchmarks/ side "
                            "by side and write bench-report/report.md (ratios, plots, "
                            "machine); other options go to benchmarks/report.py")
    c.add_argument("--benchmarks-dir", default=None,
                   help="the checkout's benchmarks/ folder (default: next to the "
                        "keras_rec_emb package, then ./benchmarks)")
    c = sub.add_parser("inspect", help="print the embedding tables of a saved .keras model "
                                       "(read from the file: no table is built), of a "
                                       "SavedModel folder or of an incremental checkpoint "
                                       "link")
    c.add_argument("model", help="path of a .keras file, a SavedModel folder or a "
                                 "ckpt-*.npz checkpoint link")
    c.add_argument("--rows", type=int, default=3, help="rows to print per table")
    c.add_argument("--json", action="store_true",
                   help="print the tables and totals as JSON instead")
    c = sub.add_parser("strip-filtered",
                       help="copy a .keras model without the ids an admission filter "
                            "counted but did not admit (for serving)")
    c.add_argument("input", help="path of a .keras file")
    c.add_argument("output", help="path of the .keras file to write")
    add_ps_arguments(sub.add_parser("ps", help=PS_HELP))
    return p


PS_HELP = ("run a parameter-server task (a tf.distribute.Server with keras_rec_emb's ops) "
           "until killed: its shard of every table and its part of the dense and "
           "optimizer variables of the model the workers train (they connect in any "
           "order, several at once). It listens on its --ps address only (its helper "
           "server on loopback); whoever reaches that port can run any TensorFlow graph "
           "in it, reading and writing its files (no authentication): trusted networks "
           "only")


def add_ps_arguments(p):
    """`--ps` and `--task`, of `keras-rec-emb ps` and `python -m
    keras_rec_emb.distribute.ps`."""
    p.add_argument("--ps", required=True,
                   help="comma-separated host:port of every PS task, in task order")
    p.add_argument("--task", type=int, required=True, help="this task's index in --ps")


def ps_addresses(p, args):
    """The `--ps` addresses, once `--task` is checked to index one."""
    ps = [a for a in args.ps.split(",") if a]
    if not 0 <= args.task < len(ps):
        p.error(f"--task must be in [0, {len(ps)}) for {len(ps)} --ps addresses; "
                f"got {args.task}")
    return ps


def main(argv=None):
    p = parser()
    args, forwarded = p.parse_known_args(argv)
    if forwarded and args.command != "bench":
        p.error(f"unrecognized arguments: {' '.join(forwarded)}")
    if args.command == "inspect":
        if not os.path.exists(args.model):
            p.error(f"no such model file or folder: {args.model}")
    elif args.command == "strip-filtered":
        if not os.path.isfile(args.input):
            p.error(f"no such model file: {args.input}")
        if not args.output.endswith(".keras"):
            p.error(f"the output must end in .keras, got {args.output}")
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            p.error(f"cannot write {args.output}: the folder {folder} does not exist "
                    "(create it first)")
    elif args.command == "ps":
        ps_addresses(p, args)
    # Before TensorFlow loads: its C++ start-up lines would bury the output.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_rec_emb import cli

    return cli.run(args, forwarded)


if __name__ == "__main__":
    sys.exit(main())
