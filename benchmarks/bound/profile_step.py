"""perf profile of the peer workload's training steps or forward lookups.

Builds one peer worker in this process (`benchmarks/peers/worker_keras.py`
or `worker_jax.py`, `--impl group`: one GroupEmbedding), warms it up as the
peer benchmark does, then runs `--steps` training steps (`--mode train`,
`model.fit`) or forward lookups (`--mode forward`) under
`perf record -g -e cpu-clock` attached to this process only while they
run, and prints the CPU time a step took (`time.process_time`). Then
`perf report -i OUT --no-children --sort dso,symbol` breaks it down
(docs/performance.md).

    .venv/bin/python benchmarks/bound/profile_step.py --variant single \\
        --backend tensorflow --mode train --steps 60 --perf-out /tmp/train-single.perf

Ids: generated as `benchmarks/bound.py` does (`--data`, default
bench-report/peers-data). One thread (`--threads`).
"""

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
import protocol  # noqa: E402
import workload  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="single", choices=workload.VARIANTS)
    p.add_argument("--backend", default="tensorflow", choices=("tensorflow", "jax"))
    p.add_argument("--mode", default="train", choices=("train", "forward"))
    p.add_argument("--impl", default="group")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=1, help="timed rounds (CPU ms of each printed)")
    p.add_argument("--data", default=str(ROOT / "bench-report" / "peers-data"))
    p.add_argument("--quick", action="store_true", help="tiny sizes (workload.QUICK)")
    p.add_argument("--perf-out", default=None, help="perf.data path (no perf when unset)")
    p.add_argument("--perf-freq", type=int, default=2000)
    opts = p.parse_args(argv)
    workload.generate(opts.data, dict(workload.QUICK if opts.quick else workload.FULL))
    protocol.thread_env(opts.threads)
    args = argparse.Namespace(data=opts.data, variant=opts.variant, threads=opts.threads,
                              impl=opts.impl)
    if opts.backend == "jax":
        import worker_jax as worker
    else:
        import worker_keras as worker
    w = worker.make_worker(args)
    run = (lambda: w.train(opts.steps)) if opts.mode == "train" else \
        (lambda: w.lookup(opts.steps))
    run()  # one more untimed round: nothing left to trace
    perf = None
    if opts.perf_out:
        perf = subprocess.Popen(["perf", "record", "-g", "-e", "cpu-clock", "-F",
                                 str(opts.perf_freq), "-p", str(os.getpid()), "-o",
                                 opts.perf_out], stdout=sys.stderr, stderr=sys.stderr)
        time.sleep(1.0)  # perf attaches
    cpu = []
    for _ in range(opts.rounds):
        c0 = time.process_time()
        run()
        cpu.append(1e3 * (time.process_time() - c0) / opts.steps)
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    print(f"{opts.backend} {opts.variant} {opts.mode}: cpu ms per "
          f"{'step' if opts.mode == 'train' else 'lookup'}: "
          + " ".join(f"{c:.2f}" for c in cpu))
    return cpu


if __name__ == "__main__":
    main()
