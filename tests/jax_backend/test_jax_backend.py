"""The JAX binding's library links neither TensorFlow nor Python, and
trains as the TensorFlow backend does (in a JAX child; this process runs
TensorFlow)."""

import pathlib
import subprocess

import keras_rec_emb
from tests._cross_backend import LAYER, assert_runs_agree, result_here, result_under_jax
LIBRARY = pathlib.Path(keras_rec_emb.__file__).parent / "_kre_jax.so"


def test_library_is_built():
    assert LIBRARY.exists(), f"{LIBRARY} is missing: `make jax-ops` builds it"


def test_library_links_neither_tensorflow_nor_python():
    needed = subprocess.run(["ldd", str(LIBRARY)], capture_output=True, text=True, check=True)
    libraries = [line.split()[0] for line in needed.stdout.splitlines() if line.strip()]
    assert libraries and not [lib for lib in libraries
                              if "tensorflow" in lib or "python" in lib or "jax" in lib]
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(LIBRARY)],
                               capture_output=True, text=True, check=True).stdout
    symbols = [line.split()[-1] for line in undefined.splitlines() if line.strip()]
    assert symbols  # libc, libstdc++
    assert [s for s in symbols if "tensorflow" in s or "absl" in s or s.startswith("Py")] == []
    exported = subprocess.run(["nm", "-D", "--defined-only", str(LIBRARY)],
                              capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert {"KreHostCreate", "KreHostAddSlot", "KreTableLookup", "KreTableApply",
            "KreTableExport"} <= names


# The same model under both backends: ids -> EmbeddingVariable -> Flatten ->
# Dense(1), MSE, the optimizer of keras_rec_emb.optimizers given to `compile`
# training the table and the Dense layer, fixed initial values.
_CROSS = """
import numpy as np
import keras
import keras_rec_emb as kre
DIM, FEATURES, DVD = 3, 2, 5
OPTIMIZERS = {"SGD": 0.05, "Adagrad": 0.05, "Adam": 0.01}
def train(name, combiner=None):
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 11, size=(16, FEATURES)).astype(np.int32)
    if combiner:  # padded with -1, pruned: one row has no id at all
        ids = np.concatenate([ids, np.full((16, 1), -1, np.int32)], axis=1)
        ids[::3, 1] = -1
        ids[5, :] = -1
    labels = rng.normal(size=(16, 1)).astype(np.float32)
    matrix = rng.normal(size=(DVD, DIM)).astype(np.float32)
    width = DIM if combiner else FEATURES * DIM
    kernel = rng.normal(size=(width, 1)).astype(np.float32)
    layer = make_layer(keras.initializers.Constant(matrix), combiner)
    inputs = keras.Input(shape=(ids.shape[1],), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(kernel))
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=getattr(kre.optimizers, name)(OPTIMIZERS[name]), loss="mse")
    model.fit(ids, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return summary(layer, dense)
def summary(layer, dense):
    e = export(layer)
    order = np.argsort(e["keys"])
    return {"keys": e["keys"][order].tolist(), "values": e["values"][order].tolist(),
            "slots": {k: np.asarray(v)[order].tolist() for k, v in e["slots"].items()},
            "freqs": e["freqs"][order].tolist(), "versions": e["versions"][order].tolist(),
            "kernel": dense.get_weights()[0].tolist(), "bias": dense.get_weights()[1].tolist()}
def train_group():
    # Two features (sum, mean) share one table: stacked ids [batch, 2, 3]
    # padded with -1, one row with no id at all.
    rng = np.random.default_rng(8)
    ids = rng.integers(-1, 7, size=(16, 2, 3)).astype(np.int32)
    ids[3] = -1
    labels = rng.normal(size=(16, 1)).astype(np.float32)
    matrix = rng.normal(size=(DVD, DIM)).astype(np.float32)
    kernel = rng.normal(size=(2 * DIM, 1)).astype(np.float32)
    table = make_layer(keras.initializers.Constant(matrix), None)
    group = kre.layers.GroupEmbedding({"a": kre.layers.FeatureSpec(table, "sum"),
                                       "b": kre.layers.FeatureSpec(table, "mean")},
                                      output_mode="concat")
    inputs = keras.Input(shape=(2, 3), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(kernel))
    model = keras.Model(inputs, dense(group(inputs)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.05), loss="mse")
    model.fit(ids, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return summary(table, dense)
def train_filtered(name):
    # A CounterFilter admits a key at its 2nd training lookup; a
    # GlobalStepEvict(2) evicts after each of 3 epochs (as saving would).
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 25, size=(16, FEATURES)).astype(np.int32)
    ids[8:] = rng.integers(20, 40, size=(8, FEATURES))  # keys seen late only
    labels = rng.normal(size=(16, 1)).astype(np.float32)
    matrix = rng.normal(size=(DVD, DIM)).astype(np.float32)
    kernel = rng.normal(size=(FEATURES * DIM, 1)).astype(np.float32)
    layer = make_layer(keras.initializers.Constant(matrix), None,
                       filter_option=kre.CounterFilter(2),
                       evict_option=kre.GlobalStepEvict(steps_to_live=2))
    inputs = keras.Input(shape=(FEATURES,), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(kernel))
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=getattr(kre.optimizers, name)(OPTIMIZERS[name]), loss="mse")
    last = ids.copy()
    last[12:] = np.arange(100, 100 + 4 * FEATURES).reshape(4, FEATURES)  # seen once, at the end
    evicted = []
    for epoch_ids in (ids, ids, last):
        model.fit(epoch_ids, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
        evicted.append(int(layer.evict()))
    out = summary(layer, dense)
    e = export(layer)
    order = np.argsort(e["keys_filtered"])
    out.update({name: np.asarray(e[name])[order].tolist()
                for name in ("keys_filtered", "freqs_filtered", "versions_filtered")})
    out["evicted"] = evicted
    return out
result = {name: train(name) for name in OPTIMIZERS}
result["Adagrad mean"] = train("Adagrad", combiner="mean")
result["GroupEmbedding Adagrad"] = train_group()
for name in ("SGD", "Adagrad"):
    result[f"{name} filtered and evicted"] = train_filtered(name)
"""

def test_compiled_optimizers_give_the_tensorflow_backends_numbers():
    """model.fit with kre.optimizers.SGD, Adagrad and Adam, Adagrad
    through a mean combiner over ids padded with -1 (pruned), and Adagrad
    through a GroupEmbedding whose two features share one table, SGD and
    Adagrad through a CounterFilter with a GlobalStepEvict applied after
    each epoch, under KERAS_BACKEND=jax and =tensorflow: the same ids,
    frequencies, versions, filtered ids and their counts, evictions, rows,
    slots and Dense weights (1e-5 for SGD and Adagrad, 1e-4 for Adam)."""
    code = _CROSS.replace("def train", LAYER + "def train", 1)
    tf_runs, jax_runs = result_here(code), result_under_jax(code)
    assert -1 not in jax_runs["Adagrad mean"]["keys"]  # pruned padding
    assert -1 not in jax_runs["GroupEmbedding Adagrad"]["keys"]
    for name in ("SGD filtered and evicted", "Adagrad filtered and evicted"):
        run = jax_runs[name]  # the filter and eviction had something to do
        assert run["keys_filtered"] and run["evicted"][1:] != [0, 0], (name, run["evicted"])
    assert_runs_agree(tf_runs, jax_runs, {
        "SGD": 1e-5, "Adagrad": 1e-5, "Adam": 1e-4, "Adagrad mean": 1e-5,
        "GroupEmbedding Adagrad": 1e-5, "SGD filtered and evicted": 1e-5,
        "Adagrad filtered and evicted": 1e-5},
        exact=("keys", "freqs", "versions", "keys_filtered", "freqs_filtered",
               "versions_filtered", "evicted"))
