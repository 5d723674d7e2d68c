"""Compares what a JAX process does with what TensorFlow does: `cases` is
source that defines `outcomes()` (a dict of JSON values, by case name),
run here and in a TensorFlow child process."""

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def here(cases):
    """`outcomes()` of `cases` run in this process."""
    namespace = {"json": json, "re": re}
    exec(cases, namespace)  # pylint: disable=exec-used
    return namespace["outcomes"]()


def in_tensorflow(cases, tmp_dir):
    """`outcomes()` of `cases` run by a child under Keras's TensorFlow
    backend, through JSON."""
    path = pathlib.Path(tmp_dir) / "outcomes.json"
    script = ("import json, re, sys\n" + cases
              + "\njson.dump(outcomes(), open(sys.argv[1], 'w'))\n")
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    run = subprocess.run([sys.executable, "-c", script, str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(path.read_text())


def assert_same(got, want):
    """The same cases, each with the same outcome."""
    assert sorted(got) == sorted(want)
    for case, outcome in got.items():
        assert outcome == want[case], case
