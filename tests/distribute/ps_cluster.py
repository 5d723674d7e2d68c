"""Processes of the one-model parameter-server tests: real TensorFlow
processes on 127.0.0.1, each with its log, stopped by pid, under one
deadline (imported by tests/distribute/test_ps_*.py)."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from _net import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Cluster:
    """Processes of one run, each with its log; stopped by pid."""

    def __init__(self, out, timeout):
        self.out = out
        self.procs = {}
        self.deadline = time.monotonic() + timeout

    def start(self, name, cmd):
        log = open(os.path.join(self.out, f"{name}.log"), "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=_env(), cwd=ROOT)
        log.close()
        return self.procs[name]

    def start_ps(self, ps, task, name=None):
        return self.start(name or f"ps{task}", [sys.executable, "-m", "keras_rec_emb.distribute.ps",
                                        "--ps", ",".join(ps), "--task", str(task)])

    def log(self, name):
        with open(os.path.join(self.out, f"{name}.log")) as f:
            return f.read()

    def report(self):
        return "\n".join(f"--- {name} (exit {proc.poll()}):\n{self.log(name)[-6000:]}"
                         for name, proc in self.procs.items())

    def wait_until(self, done, what, watch=(), within=None, stuck=None):
        """Waits for `done()`; fails with every log if a watched process
        ends first, the run's time is up, or `within` seconds pass. Before
        such a time-out, process `stuck` (if given) dumps its Python stacks
        into its log (SIGUSR1, see ps_model_worker.main)."""
        deadline = self.deadline
        if within is not None:
            deadline = min(deadline, time.monotonic() + within)
        while not done():
            for name in watch:
                if self.procs[name].poll() is not None:
                    pytest.fail(f"{name} ended while waiting for {what}:\n{self.report()}")
            if time.monotonic() > deadline:
                if stuck is not None and self.procs[stuck].poll() is None:
                    self.procs[stuck].send_signal(signal.SIGUSR1)
                    time.sleep(3)
                pytest.fail(f"timed out waiting for {what}:\n{self.report()}")
            time.sleep(0.1)

    def wait_serving(self, *names):
        """Waits until each PS process `names` printed that it serves: only
        then does it hold the context of its own that lets workers connect
        at once (see ps_tables._hold_own_context); a worker connecting
        before can crash a TensorFlow 2.21 server."""
        for name in names:
            self.wait_until(lambda: "serving at" in self.log(name), f"{name} to serve", names)

    def exists(self, name):
        return os.path.exists(os.path.join(self.out, name))

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()  # by its pid
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def worker(self, name, role, ps, task, address, *extra):
        """tests/distribute/ps_model_worker.py ROLE as worker `task`."""
        return self.start(name, [sys.executable, os.path.join(HERE, "ps_model_worker.py"),
                                 role, "--ps", ",".join(ps), "--worker", address,
                                 "--task", str(task), "--out", self.out, *extra])


@contextlib.contextmanager
def two_ps_tasks(out, timeout, workers):
    """A `Cluster` whose 2 PS tasks are started on free ports, stopped on
    exit; yields it, the PS addresses and `workers` free worker addresses."""
    ps = [f"127.0.0.1:{p}" for p in free_ports(2)]
    worker_addresses = [f"127.0.0.1:{p}" for p in free_ports(workers)]
    cluster = Cluster(out, timeout)
    try:
        for task in (0, 1):
            cluster.start_ps(ps, task)
        cluster.wait_serving("ps0", "ps1")
        yield cluster, ps, worker_addresses
    finally:
        cluster.stop()
