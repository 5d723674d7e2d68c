"""Admission filters and eviction of `EmbeddingVariable` under Keras's JAX
backend: `CounterFilter` and `CBFFilter` admit keys as a NumPy count says,
`GlobalStepEvict` and `L2WeightEvict` erase what their rules name (on
`evict()` and when the model is saved), and the filtered keys, their counts
and the Bloom counters survive `model.save` / `load_model` in every model
form. (The same numbers as TensorFlow's: test_jax_backend.py's `_CROSS`;
the files of either backend loading under the other:
test_cross_backend_saving.py.)"""

import io
import json
import math
import os
import subprocess
import sys
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

DIM, DVD, NO_PERMISSION = 3, 7, -0.5


def _option(**kwargs):
    init = kre.InitializerOption(initializer=keras.initializers.RandomUniform(seed=2),
                                 default_value_dim=DVD,
                                 default_value_no_permission=NO_PERMISSION)
    return kre.EmbeddingVariableOption(init_option=init, **kwargs)


def _layer(name="ev", **kwargs):
    return EmbeddingVariable(DIM, ev_option=_option(**kwargs), optimizer=kre.optimizers.SGD(0.1),
                             name=name)


def _parts(layer):
    return ffi.export_parts(layer.handle, layer.key_dtype, layer.embedding_dim,
                            layer._kre_slot_specs)


def _by_key(keys, *columns):
    order = np.argsort(keys)
    return (np.asarray(keys)[order], *(np.asarray(c)[order] for c in columns))


def _batches(seed=0, n=6, width=8, high=12):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=(width,)).astype(np.int32) for _ in range(n)]


def _train_counting(layer):
    """Calls `layer` on `_batches(1)` in training; how often each key came."""
    counts = {}
    for ids in _batches(1):
        layer(ids, training=True)
        for key in ids.tolist():
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("filter_freq, record_freq", [(3, False), (3, True), (1, False)])
def test_the_counter_filter_admits_keys_at_their_count(filter_freq, record_freq):
    layer = _layer(filter_option=kre.CounterFilter(filter_freq), record_freq=record_freq)
    counts = {}
    for ids in _batches():
        before = dict(counts)
        rows = np.asarray(layer(ids, training=True))
        for key in ids.tolist():
            counts[key] = counts.get(key, 0) + 1
        for key, row in zip(ids.tolist(), rows):
            if counts[key] < filter_freq:  # not admitted after this batch either
                np.testing.assert_array_equal(row, np.full(DIM, NO_PERMISSION, np.float32))
            elif before.get(key, 0) >= filter_freq:  # admitted earlier: its initializer row
                np.testing.assert_array_equal(row, layer.default_values[key % DVD])
    admitted = sorted(k for k, c in counts.items() if c >= max(filter_freq, 1))
    filtered = sorted(k for k, c in counts.items() if c < filter_freq)
    parts = _parts(layer)
    keys, freqs, values = _by_key(parts["keys"], parts["freqs"], parts["values"])
    assert keys.tolist() == admitted
    # DeepRec's frequency: an admitted key's stays at filter_freq (CounterFilter(1)
    # too) unless record_freq.
    cap = None if record_freq else filter_freq
    assert freqs.tolist() == [min(counts[k], cap) if cap else counts[k] for k in admitted]
    np.testing.assert_array_equal(values, layer.default_values[keys % DVD])
    keys_f, freqs_f = _by_key(parts["keys_filtered"], parts["freqs_filtered"])
    assert keys_f.tolist() == filtered
    assert freqs_f.tolist() == [counts[k] for k in filtered]
    assert layer.table_size() == len(admitted)


def test_the_bloom_filter_admits_keys_at_their_count():
    f = kre.CBFFilter(3, max_element_size=1000, false_positive_probability=1e-4,
                      counter_type="uint16")
    layer = _layer(filter_option=f)
    counts = _train_counting(layer)
    parts = _parts(layer)
    # 12 keys in a filter sized for 1000 at p=1e-4: no false positive here.
    assert sorted(parts["keys"].tolist()) == sorted(k for k, c in counts.items() if c >= 3)
    counters, _, counter_bytes = f.sizing()
    assert parts["bloom"].dtype == np.uint8 and parts["bloom"].size >= counters * counter_bytes
    assert parts["bloom"].any()
    assert parts["keys_filtered"].size == 0  # the Bloom filter keeps no keys


def _trained_versions():
    """A layer trained 6 steps by its own SGD in a model: versions 0..5."""
    layer = _layer(evict_option=kre.GlobalStepEvict(2))
    ids = keras.Input(shape=(4,), dtype="int32")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(optimizer="sgd", loss="mse")
    x = np.concatenate([b.reshape(2, 4) for b in _batches(2, n=3, high=30)])
    model.fit(x, np.ones((6, 1)), batch_size=1, shuffle=False, verbose=0)
    return layer, model


@pytest.mark.parametrize("step", [None, 4, 10])
def test_global_step_eviction_erases_keys_not_updated_for_steps_to_live(step):
    layer, _ = _trained_versions()
    assert int(layer.iterations.value) == 6
    keys, versions = _by_key(_parts(layer)["keys"], _parts(layer)["versions"])
    now = int(versions.max()) if step is None else step  # None: the last update's step
    assert now == 5 or step is not None
    gone = versions < now - 2
    assert layer.evict(step) == int(gone.sum()) > 0
    assert sorted(_parts(layer)["keys"].tolist()) == keys[~gone].tolist()
    assert layer.evict(step) == 0  # nothing more to evict


def test_l2_eviction_erases_small_rows():
    layer = _layer()
    layer(np.arange(20, dtype=np.int32), training=True)
    keys, values = _by_key(_parts(layer)["keys"], _parts(layer)["values"])
    l2 = 0.5 * np.sum(values.astype(np.float64) ** 2, axis=1)
    # DeepRec's rule, half the squared norm, against a threshold halfway
    # between two of the (DVD distinct) rows' values.
    levels = np.unique(l2)
    threshold = float(levels[len(levels) // 2 - 1] + levels[len(levels) // 2]) / 2
    # The rule is the table's from its build on (as under TensorFlow): set on
    # the JAX table itself for this threshold, known only once rows exist.
    layer.table.eviction_rule = kre.L2WeightEvict(threshold)
    small = l2 < threshold
    assert 0 < small.sum() < len(keys)
    assert layer.evict() == int(small.sum())
    assert sorted(_parts(layer)["keys"].tolist()) == keys[~small].tolist()


def test_without_an_eviction_option_evict_erases_nothing():
    layer = _layer(filter_option=kre.CounterFilter(2))
    layer(np.arange(5, dtype=np.int32), training=True)
    assert layer.evict(100) == 0 and _parts(layer)["keys_filtered"].size == 5


def test_saving_evicts_as_deeprec_does(tmp_path):
    layer, model = _trained_versions()
    keys, versions = _by_key(_parts(layer)["keys"], _parts(layer)["versions"])
    kept = keys[versions >= int(versions.max()) - 2]
    assert len(kept) < len(keys)
    model.save(str(tmp_path / "m.keras"))
    assert sorted(_parts(layer)["keys"].tolist()) == kept.tolist()
    loaded = keras.saving.load_model(str(tmp_path / "m.keras"))
    assert sorted(_parts(loaded.get_layer("ev"))["keys"].tolist()) == kept.tolist()


# -- eviction at save: reported, and optional ------------------------------------
# L2WeightEvict(1.0) at dim 16 evicts every trained row (issue 56).

def _filtered_model(form, filter_option, **option):
    def ev():
        return EmbeddingVariable(DIM, ev_option=_option(filter_option=filter_option, **option),
                                 name="ev")
    if form == "functional":
        inputs = keras.Input(shape=(4,), dtype="int32")
        return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(ev()(inputs))))
    if form == "sequential":
        return keras.Sequential([keras.Input(shape=(4,), dtype="int32"), ev(),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])
    return FilteredSubclassed(filter_option)


@keras.saving.register_keras_serializable(package="test_filters_eviction")
class FilteredSubclassed(keras.Model):
    def __init__(self, filter_option, **kwargs):
        super().__init__(**kwargs)
        if isinstance(filter_option, dict):
            filter_option = keras.saving.deserialize_keras_object(filter_option)
        self.filter_option = filter_option
        self.ev = EmbeddingVariable(DIM, ev_option=_option(filter_option=filter_option),
                                    name="ev")
        self.flatten = keras.layers.Flatten()
        self.dense = keras.layers.Dense(1)

    def call(self, ids):
        return self.dense(self.flatten(self.ev(ids)))

    def get_config(self):
        return {**super().get_config(),
                "filter_option": keras.saving.serialize_keras_object(self.filter_option)}


_FILTERS = {"counter": lambda: kre.CounterFilter(3),
            "bloom": lambda: kre.CBFFilter(3, 500, 0.01, counter_type="uint8")}


@pytest.mark.parametrize("form", ["functional", "subclassed", "sequential"])
@pytest.mark.parametrize("kind", sorted(_FILTERS))
def test_filtered_keys_counts_and_bloom_counters_survive_save_and_load(tmp_path, form, kind):
    model = _filtered_model(form, _FILTERS[kind]())
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    x = np.stack(_batches(3, n=4, width=4, high=9)).repeat(2, axis=0)
    model.fit(x, np.ones((8, 1)), batch_size=2, shuffle=False, verbose=0)
    layer = next(lay for lay in model.layers if isinstance(lay, EmbeddingVariable))
    before = _parts(layer)
    assert before["keys"].size and (before["keys_filtered"].size or kind == "bloom")
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    twin = next(lay for lay in loaded.layers if isinstance(lay, EmbeddingVariable))
    assert type(twin.ev_option.filter_option) is type(layer.ev_option.filter_option)
    after = _parts(twin)
    for names in (("keys", "freqs", "versions", "values"),
                  ("keys_filtered", "freqs_filtered", "versions_filtered")):
        got, want = _by_key(*(after[n] for n in names)), _by_key(*(before[n] for n in names))
        for name, g, w in zip(names, got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)
    np.testing.assert_array_equal(after["bloom"], before["bloom"])
    # Trains on alike: a key one lookup short of admission gets in with the next.
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    loaded.fit(x, np.ones((8, 1)), batch_size=2, shuffle=False, verbose=0)
    model.fit(x, np.ones((8, 1)), batch_size=2, shuffle=False, verbose=0)
    assert sorted(_parts(twin)["keys"].tolist()) == sorted(_parts(layer)["keys"].tolist())


@pytest.mark.parametrize("by", ["option", "environment"])
def test_save_filtered_off_saves_no_filtered_keys_or_counters(tmp_path, monkeypatch, by):
    if by == "environment":
        monkeypatch.setenv("KRE_EV_SAVE_FILTERED_FEATURES", "false")
    # The option is the table's, fixed when the layer builds (as under TensorFlow).
    option = {"save_filtered": False} if by == "option" else {}
    model = _filtered_model("functional", kre.CounterFilter(3), **option)
    layer = model.get_layer("ev")
    model.compile(optimizer=kre.optimizers.SGD(0.1), loss="mse")
    model.fit(np.stack(_batches(4, n=4, width=4)), np.ones((4, 1)), verbose=0)
    assert _parts(layer)["keys_filtered"].size
    path = tmp_path / "m.keras"
    model.save(str(path))
    with zipfile.ZipFile(path) as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")))
        stored = {n: v[()] for n, v in weights["layers/embedding_variable/vars"].items()}
        config = json.loads(archive.read("config.json"))
    assert "bloom" not in stored and stored["keys_filtered"].size == 0
    assert stored["keys"].size == layer.table_size()
    ev = next(e for e in config["config"]["layers"] if e["name"] == "ev")
    assert ev["config"]["ev_option"]["config"]["filter_option"]["config"] == {"filter_freq": 3}
    assert ev["config"]["ev_option"]["config"]["save_filtered"] is (by == "environment")
    loaded = keras.saving.load_model(str(path))
    assert _parts(loaded.get_layer("ev"))["keys_filtered"].size == 0


def test_options_are_public_under_jax_and_round_trip_in_the_config():
    option = _option(filter_option=kre.CBFFilter(2, 100, 0.1), evict_option=kre.L2WeightEvict(
        0.5), num_shards=4, record_freq=True, save_filtered=False, track_meta=True)
    layer = EmbeddingVariable(DIM, ev_option=option)
    assert (layer.num_shards, layer.default_value_dim) == (4, DVD)
    twin = EmbeddingVariable.from_config(layer.get_config())
    assert twin.ev_option == option
    assert twin.get_config() == layer.get_config()
    assert EmbeddingVariable(DIM, ev_option=keras.saving.serialize_keras_object(
        option)).ev_option == option


def test_bad_arguments_are_refused_by_name():
    layer = _layer(evict_option=kre.GlobalStepEvict(1))
    with pytest.raises(ValueError, match="is not built yet.*evict"):
        layer.evict()
    layer(np.arange(3, dtype=np.int32), training=True)
    with pytest.raises(ValueError, match="`step` must be None or a non-negative integer. "
                                         "Received: step=-1"):
        layer.evict(-1)
    with pytest.raises(TypeError, match="`step` must be None or a non-negative integer"):
        layer.evict("3")
    with pytest.raises(ValueError, match="`ev_option.filter_option` must be a serialized "
                                         "CounterFilter or CBFFilter or None"):
        EmbeddingVariable(DIM, ev_option={"class_name": "EmbeddingVariableOption", "config": {
            "filter_option": {"class_name": "GlobalStepEvict", "config": {"steps_to_live": 1}}}})
    with pytest.raises(TypeError, match="`ev_option` must be None, a keras_rec_emb."
                                        "EmbeddingVariableOption or its config"):
        EmbeddingVariable(DIM, ev_option=kre.CounterFilter(2))
    with pytest.raises(ValueError, match=r"`filter_freq` must be an integer in \[0, "):
        kre.CounterFilter(-1)


def test_a_bad_bloom_configuration_is_an_error_not_a_crash():
    with pytest.raises(ValueError, match="bloom_counter_bytes must be 1, 2, 4 or 8"):
        ffi.create(np.zeros((1, 2), np.float32), filter_freq=2, bloom=(10, 2, 3))
    with pytest.raises(ValueError, match="`bloom_counters` must be >= 0"):
        ffi.create(np.zeros((1, 2), np.float32), filter_freq=2, bloom=(-1, 2, 1))
    handle = ffi.create(np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="`l2_threshold` must not be NaN"):
        ffi.evict(handle, -1, -1, float("nan"))
    ffi.destroy(handle)
    with pytest.raises(ValueError, match="no embedding table has handle"):
        ffi.evict(handle, -1, 1, -1.0)


def test_the_docstring_example_with_a_filter_runs():
    import doctest

    test = doctest.DocTestFinder().find(
        EmbeddingVariable, globs={"keras": keras, "np": np, "keras_rec_emb": kre})[0]
    assert doctest.DocTestRunner().run(test, out=lambda text: None).failed == 0


@pytest.mark.parametrize("spelling, name, width", [
    ("uint64", "uint64", 8), ("int64", "int64", 8), (np.uint64, "uint64", 8),
    (np.dtype("int64"), "int64", 8), (np.uint16, "uint16", 2), ("jnp.uint64", "uint64", 8),
    ("jnp.int64", "int64", 8), ("jnp.uint8", "uint8", 1), ("jnp.int32", "int32", 4)])
def test_cbf_counter_type_takes_deeprec_spellings_under_jax(spelling, name, width):
    """Strings, NumPy and JAX dtypes name the counter type as under
    TensorFlow (tests/test_options.py; tf.uint64 and tf.int64 under JAX:
    the child test below), and admission is the same."""
    import jax.numpy as jnp
    if isinstance(spelling, str) and spelling.startswith("jnp."):
        spelling = getattr(jnp, spelling[4:])
    f = kre.CBFFilter(3, max_element_size=1000, false_positive_probability=1e-4,
                      counter_type=spelling)
    assert f.counter_type == name and f.sizing()[2] == width
    assert kre.CBFFilter.from_config(f.get_config()) == f
    layer = _layer(filter_option=f)
    counts = _train_counting(layer)
    assert sorted(_parts(layer)["keys"].tolist()) == sorted(
        k for k, c in counts.items() if c >= 3)


@pytest.mark.parametrize("bad", ["float32", None, 5, object()])
def test_cbf_counter_type_refuses_other_types_under_jax(bad):
    import jax.numpy as jnp
    for value in (bad, jnp.float32) if bad is None else (bad,):
        with pytest.raises(ValueError, match=r"`counter_type` must be an integer dtype.*"
                                             r"counter_type="):
            kre.CBFFilter(3, 1000, 0.01, counter_type=value)


def test_cbf_larger_than_the_machine_warns_under_jax():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = 2**30
    while math.ceil(-n * math.log(0.01) / math.log(2) ** 2) * 8 <= physical:
        n *= 4
    with pytest.warns(UserWarning, match=rf"Bloom filter of \d+ bytes .*\({physical} bytes"):
        kre.CBFFilter(3, max_element_size=n, false_positive_probability=0.01)


@pytest.mark.parametrize("spelling", ["jnp.int64", "tf.uint64"])
def test_deeprec_bloom_setting_holds_memory_for_the_counters_written_under_jax(spelling):
    """DeepRec's modelzoo filter, CBFFilter(3, 2**30, 0.01) (76.7 GiB of
    counters), under the JAX backend: 2000 keys counted four times hold far
    less than the filter, admit as an exact counter and a small filter do;
    a 2**24 filter's first lookup costs no 1.2 GiB. With a JAX dtype no
    TensorFlow is imported; tf.uint64 (the child imports TensorFlow for
    it) is taken too."""
    child = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_bloom_memory_child.py")
    result = subprocess.run([sys.executable, child, spelling], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, KERAS_BACKEND="jax"))
    assert result.returncode == 0, result.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert out["SAME"] == "True" and out["ADMITTED"] == "2000", out
    assert int(out["FULL"]) == 82_335_024_528
    assert int(out["GROWN"]) < 200 * 2**20, out
    assert int(out["MEMORY"]) < 200 * 2**20, out
    assert int(out["GROWN24"]) < 100 * 2**20, out
    assert out["TENSORFLOW"] == str(spelling.startswith("tf.")), out
