"""Save under one backend, load under the other, train on: the rows, every
slot, the frequencies, versions, Dense weights and optimizer variables of
an uninterrupted run under either backend, for every optimizer of the
package (the model's, and a table's own beside another model optimizer).

The TensorFlow side runs in this process, the JAX side in one child
process for every case: the TensorFlow files are saved first, the child
trains the uninterrupted JAX runs, saves its own files and resumes the
TensorFlow ones, then this process resumes the JAX files."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests._cross_backend import ROOT

STEPS, MORE = 3, 3  # steps before the save, after the load

# The same code under both backends. A table initialized from a constant
# matrix (its rows follow the id, not a random draw), ids padded with -1
# and pruned, a mean combiner, a Dense layer.
_CODE = """
import json
import numpy as np
import keras
import keras_rec_emb as kre
DIM, DVD, BATCH = 3, 5, 4
STEPS, MORE = %d, %d
rng = np.random.default_rng(5)
IDS = rng.integers(-1, 9, size=(BATCH * (STEPS + MORE), 3)).astype(np.int32)
IDS[2] = -1  # an example without ids
# The last step before the save has no id at all: no version says the
# step, the file's step counter must.
IDS[BATCH * (STEPS - 1):BATCH * STEPS] = -1
LABELS = rng.normal(size=(len(IDS), 1)).astype(np.float32)
MATRIX = rng.normal(size=(DVD, DIM)).astype(np.float32)
KERNEL = rng.normal(size=(DIM, 1)).astype(np.float32)
O = kre.optimizers
def schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)
OPTIMIZERS = {
    "SGD": lambda: O.SGD(0.1, momentum=0.5),
    "Adagrad": lambda: O.Adagrad(0.1, initial_accumulator_value=0.2),
    "Adam": lambda: O.Adam(schedule()),
    "Ftrl keras": lambda: O.Ftrl(0.2, l1_regularization_strength=0.01,
                                 l2_regularization_strength=0.02, beta=0.1),
    "Ftrl deeprec": lambda: O.Ftrl(0.2, l1_regularization_strength=0.01,
                                   l2_regularization_strength=0.02, table_rule="deeprec"),
    "AdamAsync": lambda: O.AdamAsync(0.03),
    "AdagradDecay": lambda: O.AdagradDecay(0.1, accumulator_decay_step=2,
                                           accumulator_decay_rate=0.5),
    "AdamW": lambda: O.AdamW(0.1, 0.03),
    "AdamW unscaled": lambda: O.AdamW(0.01, 0.03, scale_weight_decay_by_learning_rate=False),
}
CASES = [(name, mode) for name in OPTIMIZERS for mode in ("model", "table")]
def model_of(name, mode):
    own = OPTIMIZERS[name]() if mode == "table" else None
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD), track_meta=True)
    layer = kre.layers.EmbeddingVariable(
        DIM, initializer=keras.initializers.Constant(MATRIX), key_dtype="int32",
        combiner="mean", prune_invalid_ids=True, ev_option=option, optimizer=own, name="ev")
    inputs = keras.Input(shape=(3,), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(KERNEL),
                               bias_initializer="ones", name="dense")
    model = keras.Model(inputs, dense(layer(inputs)))
    if mode == "model":
        optimizer = OPTIMIZERS[name]()
    else:  # a model optimizer other than the table's
        optimizer = O.Adagrad(0.05) if name == "SGD" else O.SGD(0.05, momentum=0.3)
    model.compile(optimizer=optimizer, loss="mse")
    return model
def fit(model, first, last):
    model.fit(IDS[BATCH * first:BATCH * last], LABELS[BATCH * first:BATCH * last],
              batch_size=BATCH, shuffle=False, verbose=0)
def state(model):
    parts = model.get_layer("ev").export()
    order = np.argsort(parts["keys"])
    out = {name: np.asarray(parts[name])[order].tolist()
           for name in ("keys", "values", "freqs", "versions")}
    out["slots"] = {n: np.asarray(v)[order].tolist() for n, v in parts["slots"].items()}
    out["dense"] = [w.tolist() for w in model.get_layer("dense").get_weights()]
    # The model optimizer's variables: step, rate, the Dense weights' slots
    # (a JAX table's zero-size anchor slots aside).
    out["optimizer"] = [np.asarray(v).tolist() for v in model.optimizer.variables
                        if np.size(v) > 0]
    return out
def uninterrupted():
    out = {}
    for name, mode in CASES:
        model = model_of(name, mode)
        fit(model, 0, STEPS + MORE)
        out[f"{name} {mode}"] = state(model)
    return out
def save_all(folder):
    for name, mode in CASES:
        model = model_of(name, mode)
        fit(model, 0, STEPS)
        model.save(f"{folder}/{name} {mode}.keras")
def resume_all(folder):
    out = {}
    for name, mode in CASES:
        model = keras.saving.load_model(f"{folder}/{name} {mode}.keras")
        fit(model, STEPS, STEPS + MORE)
        out[f"{name} {mode}"] = state(model)
    return out
""" % (STEPS, MORE)

# The child: the JAX uninterrupted runs, the JAX files, the TensorFlow
# files resumed.
_JAX_MAIN = """
import sys
result = {"uninterrupted": uninterrupted()}
save_all(sys.argv[2])
result["resumed"] = resume_all(sys.argv[1])
with open(sys.argv[3], "w") as f:
    json.dump(result, f)
"""

# What is compared, with the tolerances (float32 arithmetic in a
# different order: 1e-5 relative for SGD, Adagrad and Ftrl, 1e-4 for the
# Adam family).
_ADAM = ("Adam", "AdamAsync", "AdamW", "AdamW unscaled")


def _tolerance(case):
    return 1e-4 if case.rsplit(" ", 1)[0] in _ADAM else 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"tensorflow"|"jax": {"uninterrupted"|"resumed": {case: state}}}; a
    backend's "resumed" is its run resumed from the other's files."""
    folder = tmp_path_factory.mktemp("resume")
    (folder / "tensorflow").mkdir()
    (folder / "jax").mkdir()
    namespace = {}
    exec(_CODE, namespace)
    namespace["save_all"](folder / "tensorflow")
    tensorflow = {"uninterrupted": namespace["uninterrupted"]()}
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _CODE + _JAX_MAIN, str(folder / "tensorflow"),
                          str(folder / "jax"), str(folder / "jax.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    jax = json.loads((folder / "jax.json").read_text())
    tensorflow["resumed"] = namespace["resume_all"](folder / "jax")
    return {"tensorflow": tensorflow, "jax": jax}


def _assert_same(got, want, case, what):
    tolerance = _tolerance(case)
    for key in ("keys", "freqs", "versions"):
        assert got[key] == want[key], (case, what, key)
    assert sorted(got["slots"]) == sorted(want["slots"]), (case, what)
    assert len(got["optimizer"]) == len(want["optimizer"]), (case, what)
    pairs = [("values", got["values"], want["values"])]
    pairs += [(f"slot {n}", got["slots"][n], want["slots"][n]) for n in want["slots"]]
    pairs += [(f"dense {i}", g, w) for i, (g, w) in enumerate(zip(got["dense"], want["dense"]))]
    pairs += [(f"optimizer variable {i}", g, w)
              for i, (g, w) in enumerate(zip(got["optimizer"], want["optimizer"]))]
    for name, g, w in pairs:
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tolerance, atol=1e-6,
                                   err_msg=f"{case}: {what} {name}")


_CASES = [f"{name} {mode}" for name in
          ("SGD", "Adagrad", "Adam", "Ftrl keras", "Ftrl deeprec", "AdamAsync", "AdagradDecay",
           "AdamW", "AdamW unscaled") for mode in ("model", "table")]


@pytest.mark.parametrize("case", _CASES)
def test_both_backends_train_the_same_uninterrupted(runs, case):
    """The references agree (so each resumed run below is checked against
    both), and they did train: slots, versions past the save."""
    want = runs["tensorflow"]["uninterrupted"][case]
    _assert_same(runs["jax"]["uninterrupted"][case], want, case, "JAX uninterrupted")
    assert max(want["versions"]) == STEPS + MORE - 1
    assert STEPS - 1 not in want["versions"]
    assert want["slots"], case


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("direction", ["tensorflow to jax", "jax to tensorflow"])
def test_saved_under_one_backend_resumed_under_the_other(runs, case, direction):
    resumed_under = direction.split(" to ")[1]
    got = runs[resumed_under]["resumed"][case]
    for backend in ("tensorflow", "jax"):
        _assert_same(got, runs[backend]["uninterrupted"][case], case,
                     f"{direction} vs {backend} uninterrupted")
