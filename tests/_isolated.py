"""Runs snippets of Python in child processes so that a crash (SIGSEGV,
SIGABRT, SIGBUS) fails one case instead of killing pytest.

A batch of cases shares one child: the child announces each case before it
runs it and reports how it ended, so when the child dies the parent knows
which case killed it, records the crash, and starts a new child for the rest.

Each case is `(name, code)`. `code` runs with `tf`, `np`, `keras`,
`keras_rec_emb as kre` and `_ops` (keras_rec_emb.backend.tensorflow.ops) imported, plus
whatever the batch's `prelude` defines. It ends in one of:

* `ok`: no exception;
* `error`: an exception; the result holds its type and message;
* `crash`: the process died (the result holds the signal or exit status);
* `hang`: the case ran longer than `timeout` seconds.
"""

import json
import os
import subprocess
import sys
import textwrap

_CHILD = r'''
import json, os, sys, traceback
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import tensorflow as tf
import keras
import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import ops as _ops
_ops.gen()
cases = json.loads(sys.stdin.read())
g = {"tf": tf, "np": np, "keras": keras, "kre": kre, "_ops": _ops, "os": os}
exec(compile(cases["prelude"], "<prelude>", "exec"), g)
out = os.fdopen(int(os.environ["KRE_CASE_FD"]), "w", buffering=1)
for name, code in cases["cases"]:
    out.write(json.dumps({"start": name}) + "\n")
    out.flush()
    env = dict(g)
    try:
        exec(compile(code, "<case %s>" % name, "exec"), env)
        res = {"name": name, "outcome": "ok"}
    except BaseException as e:  # noqa: BLE001 - every outcome is recorded
        res = {"name": name, "outcome": "error", "type": type(e).__name__,
               "message": str(e)[:2000]}
    out.write(json.dumps(res) + "\n")
    out.flush()
out.close()
sys.stderr.flush()
# Skip interpreter shutdown: threads a case left running (tf.data, Arrow)
# may block it, and every outcome is already reported.
os._exit(0)
'''


def run_cases(cases, prelude="", timeout=120, env=None):
    """Runs `cases` ([(name, code)]) and returns {name: result dict}."""
    cases = list(cases)
    results = {}
    todo = cases
    while todo:
        r, w = os.pipe()
        child_env = dict(os.environ, **(env or {}), KRE_CASE_FD=str(w))
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(w,),
            env=child_env, text=True)
        os.close(w)
        payload = json.dumps({"prelude": textwrap.dedent(prelude),
                              "cases": [(n, textwrap.dedent(c)) for n, c in todo]})
        import threading

        def feed():
            try:
                proc.stdin.write(payload)
                proc.stdin.close()
            except BrokenPipeError:
                pass

        threading.Thread(target=feed, daemon=True).start()
        stderr_chunks = []
        threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()),
                         daemon=True).start()
        running = None
        timed_out = False
        with os.fdopen(r) as reader:
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(reader, selectors.EVENT_READ)
            buf = ""
            while True:
                if not sel.select(timeout):
                    timed_out = True
                    proc.kill()
                    break
                chunk = os.read(reader.fileno(), 65536).decode()
                if not chunk:
                    break
                buf += chunk
                while "\n" in buf:
                    line, buf = buf.split("\n", 1)
                    msg = json.loads(line)
                    if "start" in msg:
                        running = msg["start"]
                    else:
                        results[msg["name"]] = msg
                        running = None
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        done = set(results)
        if running is not None:
            tail = "".join(stderr_chunks)[-3000:] if stderr_chunks else ""
            if timed_out:
                results[running] = {"name": running, "outcome": "hang", "stderr": tail}
            else:
                results[running] = {"name": running, "outcome": "crash", "returncode": rc,
                                     "stderr": tail}
            done.add(running)
        elif rc != 0 and len(done) < len(cases):
            # Died before announcing a case: set-up failed.
            tail = "".join(stderr_chunks)[-3000:] if stderr_chunks else ""
            raise RuntimeError(f"case runner failed to start (rc={rc}): {tail}")
        todo = [(n, c) for n, c in todo if n not in done]
    return results


def failures(results, allowed=("ok", "error")):
    """Cases whose outcome is not in `allowed`, as readable lines."""
    return [f"{name}: {r['outcome']} {r.get('returncode', '')} {r.get('stderr', '')[-500:]}"
            for name, r in sorted(results.items()) if r["outcome"] not in allowed]
