"""Faults of the file tier with real files: segments truncated or corrupted
under a live table or in a snapshot, restores that fail part-way (all or
nothing), descriptors and mappings bounded over many snapshots, bad cache
sizes. Processes that could die of a signal run as subprocesses."""

import glob
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")


def run_child(script, *args, timeout=300):
    """Runs `script` in a fresh interpreter; returns (returncode, stdout, stderr)."""
    result = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                            capture_output=True, text=True, timeout=timeout, env=ENV)
    return result.returncode, result.stdout, result.stderr


def lines(out, tag):
    return [line[len(tag) + 1:] for line in out.splitlines() if line.startswith(tag + " ")]


_TRUNCATED_CHILD = r"""
import glob, os, sys
import numpy as np
import tensorflow as tf
import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

folder = sys.argv[1]
option = kre.EmbeddingVariableOption(num_shards=2, storage_option=kre.StorageOption(
    "FILE", storage_path=folder, storage_size=4096))
layer = EmbeddingVariable(8, ev_option=option, name="t")
keys = np.arange(200_000, dtype=np.int64)
for start in range(0, len(keys), 50_000):
    layer(keys[start:start + 50_000], training=True)
segments = glob.glob(os.path.join(folder, "*", "live-*", "*.seg"))
for path in segments:
    os.truncate(path, 32)
print("TRUNCATED", len(segments), flush=True)
for what, fn in (("lookup", lambda: layer(keys[:1000])),
                 ("export", lambda: layer.table.export())):
    try:
        fn()
        print("NOERROR", what, flush=True)
    except tf.errors.OpError as e:
        print("ERROR", what, type(e).__name__, " ".join(str(e).split()), flush=True)
print("ALIVE", flush=True)
"""


def test_segments_truncated_under_a_live_table_raise_not_kill(tmp_path):
    """Issue 43.1: segment files cut to their 32-byte header while the table
    lives (a tool rewriting them, a full disk): the next read of a row on
    file raised SIGBUS through the memory map and killed the process. Now
    each read is an error naming the file and the offset, and the process
    lives on."""
    code, out, err = run_child(_TRUNCATED_CHILD, tmp_path)
    assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert int(lines(out, "TRUNCATED")[0]) >= 2
    errors = lines(out, "ERROR")
    assert [e.split()[0] for e in errors] == ["lookup", "export"], out
    for error in errors:
        assert error.split()[1] == "DataLossError", error
        assert "was truncated under the table" in error and "offset" in error, error
        assert str(tmp_path) in error and ".seg" in error and "/live-" in error, error
    assert lines(out, "ALIVE") is not None and "ALIVE" in out
