"""MultiHashEmbedding under both backends (this process runs TensorFlow, a
child JAX): the same model and data train to the same tables and Dense
weights, and a `.keras` file saved under one backend loads under the other
with the same tables, optimizer state and predictions, and trains on to the
same numbers."""

import json
import os
import pathlib
import subprocess
import sys
import zipfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# ids -> MultiHashEmbedding -> Dense(1), MSE, the same code under both
# backends. SGD trains on ids that reach past [0, 40) both ways (hashed into
# range) and read table rows several times a batch. Adagrad trains on
# batches that read each table row at most once: where a row repeats,
# Keras's TensorFlow backend squares each occurrence's gradient (its sparse
# path for tf.gather's IndexedSlices, keras.layers.Embedding's too) and its
# JAX backend the row's summed gradient, so no layer made of Keras
# variables can give both backends' numbers there.
_COMMON = """
import json, sys
import numpy as np
import keras
import keras_rec_emb as kre
N = 40
CASES = {
    "Q-R add": dict(embedding_dim=3),
    "CRT concat mean": dict(embedding_dim=[2, 3, 1], complementary_strategy="CRT",
                            operation="concat", moduli=[5, 7, 9], combiner="mean"),
    "generalized_QR mult sqrtn": dict(embedding_dim=3, complementary_strategy="generalized_QR",
                                      operation="mult", moduli=[4, 10], combiner="sqrtn"),
    "Adaptive": dict(embedding_dim=3, hash_bucket_size=7, promote_threshold=2),
}
OPTIMIZERS = {"SGD": 0.05, "Adagrad": 0.1}
BATCH = {"SGD": 4, "Adagrad": 2}
def make_layer(case):
    if case == "Adaptive":  # ids < 0 stay static under JAX: none here
        return kre.layers.AdaptiveEmbedding(name="mh", **CASES[case])
    return kre.layers.MultiHashEmbedding(N, name="mh", **CASES[case])
def rows_read(layer, ids):
    if isinstance(layer, kre.layers.AdaptiveEmbedding):
        return [layer.static_bucket(ids)]
    return layer.partition_indices(ids)
def data(case, optimizer, n, seed):
    rng = np.random.default_rng(seed)
    if optimizer == "SGD" and case == "Adaptive":
        return (rng.integers(0, 12, size=(n, 3)).astype(np.int32),
                rng.normal(size=(n, 1)).astype(np.float32))
    if optimizer == "SGD":
        return (rng.integers(-60, 100, size=(n, 3)).astype(np.int32),
                rng.normal(size=(n, 1)).astype(np.float32))
    # Batches of 2 x 2 ids, no table row read twice in a batch.
    layer = make_layer(case)
    batches = []
    for _ in range(10000):
        if len(batches) == n // 2:
            break
        ids = rng.integers(0, N, size=4).astype(np.int32)
        if all(len(set(np.asarray(i).tolist())) == 4 for i in rows_read(layer, ids)):
            batches.append(ids.reshape(2, 2))
    assert len(batches) == n // 2, case
    return (np.concatenate(batches).astype(np.int32),
            rng.normal(size=(n, 1)).astype(np.float32))
def make(case, optimizer, features):
    kwargs = CASES[case]
    inputs = keras.Input(shape=(features,), dtype="int32")
    x = make_layer(case)(inputs)
    if not kwargs.get("combiner"):
        x = keras.layers.Flatten()(x)
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(x))
    model.compile(optimizer=getattr(kre.optimizers, optimizer)(OPTIMIZERS[optimizer]),
                  loss="mse")
    # Fixed starting weights, the same under both backends.
    init = np.random.default_rng(5)
    for w in model.weights:
        if "dynamic" not in w.path:  # an AdaptiveEmbedding's table starts empty
            w.assign(init.normal(size=w.shape).astype(np.float32))
    return model
def weights(model):
    # Keras weights only (an AdaptiveEmbedding's table is read below).
    dense = [w for w in model.weights if "dynamic" not in w.path]
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(dense)}
    layer = model.get_layer("mh")
    if isinstance(layer, kre.layers.AdaptiveEmbedding):  # the table's ids and rows
        out.update({f"wt_{k}": v for k, v in layer.promotion_state().items()})
        e = layer.dynamic.export()
        order = np.argsort(e["keys"])
        out.update(wt_values=e["values"][order], wt_versions=e["versions"][order],
                   **{f"wt_slot_{k}": np.asarray(v)[order] for k, v in e["slots"].items()})
    return out
def optimizer_state(model):
    # Under JAX the optimizer also holds an empty slot per table anchor.
    state = [np.asarray(v) for v in model.optimizer.variables]
    return {f"opt{i}": v for i, v in enumerate(s for s in state if s.size)}
def train_all():
    out = {}
    for case in CASES:
        for optimizer in OPTIMIZERS:
            ids, labels = data(case, optimizer, 16, 21)
            model = make(case, optimizer, ids.shape[1])
            model.fit(ids, labels, batch_size=BATCH[optimizer], epochs=2, shuffle=False,
                      verbose=0)
            out[f"{case} {optimizer}"] = {k: v.tolist() for k, v in weights(model).items()}
    return out
# The saving tests' model and data.
SAVED = (sys.argv[-1] if sys.argv[-1] in CASES else "CRT concat mean", "Adagrad")
ids, labels = data(*SAVED, 16, 22)
more_ids, more_labels = data(*SAVED, 8, 23)
"""

_JAX_TRAINS = """
json.dump(train_all(), sys.stdout)
"""

# Records a model's state as saved (or loaded), then after one more epoch.
_STATES = """
def states(model, out):
    state = dict(weights(model), **optimizer_state(model),
                 predictions=model.predict(ids, verbose=0))
    model.fit(more_ids, more_labels, batch_size=2, shuffle=False, verbose=0)
    state.update({f"trained_{k}": v for k, v in
                  dict(weights(model), **optimizer_state(model)).items()})
    np.savez(out, **state)
"""

# Loads a file saved by the other backend and saves it again.
_LOADS = _STATES + """
def load_and_train_on(path, out, path_again):
    model = keras.saving.load_model(path)
    states(model, out)
    model.save(path_again)
"""

_SAVES = _STATES + """
def train_and_save(path, out):
    model = make(*SAVED, ids.shape[1])
    model.fit(ids, labels, batch_size=2, epochs=2, shuffle=False, verbose=0)
    model.save(path)
    states(model, out)
"""


def _run_jax(code, *args):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def _tensorflow(case=None):
    namespace = {"sys": type("argv", (), {"argv": [case]})}
    exec(_COMMON.replace("import json, sys", "import json"), namespace)
    exec(_LOADS + _SAVES, namespace)
    return namespace


def test_the_same_model_trains_to_the_same_numbers_under_both_backends():
    """SGD and Adagrad (kre.optimizers, given to compile), three strategies
    and operations, with and without a combiner: every table and the Dense
    weights within 1e-5 (Adagrad on batches that read a row once: see the
    top)."""
    want = _tensorflow()["train_all"]()
    got = json.loads(_run_jax(_COMMON + _JAX_TRAINS).strip().splitlines()[-1])
    assert sorted(got) == sorted(want)
    for run in want:
        assert sorted(got[run]) == sorted(want[run])
        for name in want[run]:
            np.testing.assert_allclose(got[run][name], want[run][name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{run} {name}")


def _assert_same(got, want, prefix="", rtol=0.0):
    names = [k for k in want if k.startswith(("w", "opt"))]
    assert names and sorted(names) == sorted(k[len(prefix):] for k in got
                                             if k.startswith(prefix + "w")
                                             or k.startswith(prefix + "opt"))
    for name in names:
        np.testing.assert_allclose(got[prefix + name], want[name], rtol=rtol, atol=rtol / 10,
                                   err_msg=name)


@pytest.mark.parametrize("saved_by", ["tensorflow", "jax"])
@pytest.mark.parametrize("case, layer_class", [("CRT concat mean", "MultiHashEmbedding"),
                                               ("Adaptive", "AdaptiveEmbedding")])
def test_a_model_saved_under_one_backend_loads_and_trains_on_under_the_other(
        case, layer_class, saved_by, tmp_path):
    """Adagrad; for AdaptiveEmbedding the promotion state (promoted ids and
    their counts, ids still counting), the table's rows, versions and
    accumulators too."""
    import keras

    tf_side = _tensorflow(case)
    path, again = tmp_path / "saved.keras", tmp_path / "again.keras"
    if saved_by == "tensorflow":
        tf_side["train_and_save"](str(path), tmp_path / "saved.npz")
        _run_jax(_COMMON + _LOADS + "load_and_train_on(*sys.argv[1:4])\n", path,
                 tmp_path / "loaded.npz", again, case)
    else:
        _run_jax(_COMMON + _SAVES + "train_and_save(*sys.argv[1:3])\n", path,
                 tmp_path / "saved.npz", case)
        tf_side["load_and_train_on"](str(path), tmp_path / "loaded.npz", str(again))
    saved = dict(np.load(tmp_path / "saved.npz"))
    got = dict(np.load(tmp_path / "loaded.npz"))
    _assert_same(got, saved)  # every table row, Dense weight and optimizer slot
    np.testing.assert_allclose(got["predictions"], saved["predictions"], rtol=1e-6, atol=1e-6)
    # One more epoch from the saved state: the same under either backend.
    _assert_same(got, {k[len("trained_"):]: v for k, v in saved.items()
                       if k.startswith("trained_")}, prefix="trained_", rtol=1e-5)
    # The file saved again by the loading backend has the first one's config
    # and registered name (the module is each backend's own).
    configs = []
    for file in (path, again):
        with zipfile.ZipFile(file) as archive:
            config = json.loads(archive.read("config.json"))
        configs.append(next(e for e in config["config"]["layers"] if e["name"] == "mh"))
    assert configs[0]["config"] == configs[1]["config"]
    assert [c["registered_name"] for c in configs] == [f"keras_rec_emb>{layer_class}"] * 2
    if saved_by == "jax":  # TensorFlow saved it again: its own class
        loaded = keras.saving.load_model(str(again))
        assert type(loaded.get_layer("mh")).__module__.startswith("keras_rec_emb.layers.")
