"""`python -m keras_rec_emb.distribute.ps --ps HOST:PORT,HOST:PORT --task I`:
runs parameter-server task I (same as `keras-rec-emb ps`)."""

import argparse
import faulthandler
import sys


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="keras-rec-emb ps",
        description="Run a parameter-server task (a tf.distribute.Server with "
                    "keras_rec_emb's ops loaded) until killed: it holds its shard of "
                    "every table and its part of the dense and optimizer variables of "
                    "the model the workers train. Workers may connect in any order, "
                    "several at once.")
    p.add_argument("--ps", required=True,
                   help="comma-separated host:port of every PS task, in task order")
    p.add_argument("--task", type=int, required=True, help="this task's index in --ps")
    args = p.parse_args(argv)
    ps = [a for a in args.ps.split(",") if a]
    if not 0 <= args.task < len(ps):
        p.error(f"--task must be in [0, {len(ps)}) for {len(ps)} --ps addresses; "
                f"got {args.task}")
    # A crash of a long-lived server process prints its stacks (to stderr).
    faulthandler.enable()
    from keras_rec_emb.distribute.ps_tables import serve

    server = serve(ps, args.task)
    print(f"keras-rec-emb ps: task {args.task} serving at {ps[args.task]}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
