"""One incremental-checkpoint format for both backends: a chain (a full
checkpoint and incremental links, written by `CheckpointCallback` during
`fit`) written under TensorFlow (this process) restores under JAX (a child
process) to the trained model's rows, slots, frequencies, versions, dense
and optimizer variables, and the reverse."""

import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The same code under both backends: `layer()` differs (each backend's
# EmbeddingVariable takes the initializer matrix's height its own way).
_COMMON = """
import numpy as np
import keras
import keras_rec_emb as kre
from keras_rec_emb import incremental
DIM, DVD = 3, 5
rng = np.random.default_rng(5)
ids = rng.integers(0, 30, size=(32, 2)).astype(np.int64)
labels = rng.normal(size=(32, 1)).astype(np.float32)
def model_of(layer):
    inputs = keras.Input(shape=(2,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(layer(inputs)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.build((None, 2))
    return model
def write_chain(directory):
    model = model_of(layer())
    cb = kre.callbacks.CheckpointCallback(directory, full_every_steps=100,
                                          incremental_every_steps=1, save_on_train_end=False)
    model.fit(ids, labels, batch_size=8, shuffle=False, verbose=0, callbacks=[cb])
    assert len(cb.saves) == 4 and cb.saves[0].endswith("-full.npz"), cb.saves
    return model
def restored(directory):
    model = model_of(layer())
    info = kre.IncrementalCheckpointer(model, directory).restore()
    assert len(info["links"]) == 4 and info["step"] == 4, info
    return model
def state(model):
    (name, table), = incremental._tables(model)
    d = table.export()
    order = np.argsort(d["keys"])
    out = {k: np.asarray(d[k])[order] for k in ("keys", "values", "freqs", "versions")}
    out["accumulator"] = np.asarray(d["slots"]["accumulator"])[order]
    out["default_values"] = np.asarray(d["default_values"])
    out.update({v.path: np.asarray(v) for v in incremental._dense(model)})
    out.update({f"opt{i}": np.asarray(v)
                for i, v in enumerate(incremental._optimizer_vars(model))})
    return out
"""

# The same layer under both backends (one class).
_LAYER = """
def layer():
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD), track_meta=True)
    return kre.layers.EmbeddingVariable(DIM, combiner="sum", ev_option=option, name="ev")
"""
_TENSORFLOW = _LAYER

_JAX = _LAYER + """
import sys
model = write_chain(sys.argv[1]) if sys.argv[3] == "write" else restored(sys.argv[1])
got = state(model)
ev = model.get_layer("ev")
got["jax_iterations"] = np.asarray(int(ev.iterations.value))
np.savez(sys.argv[2], **got)
"""


def _run_jax(*args):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _COMMON + _JAX, *map(str, args)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]


def _tensorflow():
    namespace = {}
    exec(_COMMON + _TENSORFLOW, namespace)
    return namespace


def _assert_same(got, want):
    assert sorted(k for k in got if k != "jax_iterations") == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_chain_written_under_tensorflow_restores_under_jax(tmp_path):
    tf_side = _tensorflow()
    want = tf_side["state"](tf_side["write_chain"](str(tmp_path / "chain")))
    assert want["keys"].size > 0 and want["freqs"].max() > 1
    _run_jax(tmp_path / "chain", tmp_path / "jax.npz", "restore")
    with np.load(tmp_path / "jax.npz") as got:
        got = dict(got)
    _assert_same(got, want)
    assert int(got["jax_iterations"]) == 4  # the optimizer's step, which stamped the versions


def test_a_chain_written_under_jax_restores_under_tensorflow(tmp_path):
    _run_jax(tmp_path / "chain", tmp_path / "jax.npz", "write")
    with np.load(tmp_path / "jax.npz") as want:
        want = dict(want)
    assert int(want.pop("jax_iterations")) == 4
    tf_side = _tensorflow()
    _assert_same(tf_side["state"](tf_side["restored"](str(tmp_path / "chain"))), want)
