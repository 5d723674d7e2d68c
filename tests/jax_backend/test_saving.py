"""Saving under Keras's JAX backend: the table's import through the FFI,
and `model.save` / `keras.saving.load_model` of an EmbeddingVariable in the
TensorFlow backend's layout (test_cross_backend_saving.py loads the files
across backends)."""

import io
import json
import zipfile

import h5py
import jax
import keras
import numpy as np
import pytest

from keras_rec_emb import tables
from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

# Written for int32 ids (JAX's 32-bit mode); the 64-bit cases switch it on.
pytestmark = pytest.mark.usefixtures("jax_32_bit_mode")

ADAGRAD = ("learning_rate", "decay", "epsilon")
DIM = 4


def by_key(parts):
    order = np.argsort(parts["keys"])
    out = {}
    for name, value in parts.items():
        if name == "slots" and isinstance(value, dict):
            out[name] = {n: v[order] for n, v in value.items()}
        elif name in ("keys", "values", "freqs", "versions", "slots"):
            out[name] = value[order]
        else:
            out[name] = value
    return out


def trained_table(filter_freq=0):
    """A table with an Adagrad slot, updated rows and, with a filter, keys
    counted but not admitted."""
    handle = ffi.create(np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM) / 10,
                        filter_freq=filter_freq)
    ffi.add_slot(handle, "accumulator", DIM, 0.1)
    keys = np.array([1, 2, 2, 5, 5, 9, 2, 5], np.int32)
    ffi.lookup(handle, keys, DIM)
    ffi.apply(handle, keys, np.linspace(-1, 1, len(keys) * DIM, dtype=np.float32).reshape(-1, DIM),
              [0.1, 0.0, 1e-7], 3, "adagrad", ADAGRAD, ("accumulator",))
    return handle


def test_import_replaces_the_contents_with_every_part():
    source = trained_table(filter_freq=2)
    parts = ffi.export_parts(source, "int32", DIM, [("accumulator", DIM)])
    # 2 and 5 are seen 3 times (admitted), 1 and 9 once (counted only).
    np.testing.assert_array_equal(np.sort(parts["keys"]), [2, 5])
    np.testing.assert_array_equal(np.sort(parts["keys_filtered"]), [1, 9])
    target = ffi.create(np.full((2, DIM), -1.0, np.float32), filter_freq=2)
    ffi.lookup(target, np.array([7, 7, 100], np.int32), DIM)  # replaced by the import
    ffi.import_parts(target, "int32", DIM, parts)
    got = by_key(ffi.export_parts(target, "int32", DIM, [("accumulator", DIM)]))
    want = by_key(parts)
    for name in ("keys", "values", "freqs", "versions", "default_values", "keys_filtered",
                 "bloom"):
        np.testing.assert_array_equal(np.sort(got[name], axis=0), np.sort(want[name], axis=0),
                                      err_msg=name)
    np.testing.assert_array_equal(got["slots"]["accumulator"], want["slots"]["accumulator"])
    np.testing.assert_array_equal(np.asarray(ffi.size(target)), [2, 2, DIM, 1])
    # A filtered key kept its count: one more lookup admits it.
    ffi.lookup(target, np.array([9], np.int32), DIM)
    assert 9 in ffi.export(target, "int32", DIM)["keys"]
    for handle in (source, target):
        ffi.destroy(handle)


def test_import_adds_a_slot_the_table_lacks_and_accepts_an_empty_table():
    source = trained_table()
    parts = ffi.export_parts(source, "int32", DIM, [("accumulator", DIM)])
    target = ffi.create(np.zeros((1, DIM), np.float32))
    ffi.import_parts(target, "int32", DIM, parts)
    np.testing.assert_array_equal(np.asarray(ffi.size(target)), [4, 0, DIM, 1])
    got = by_key(ffi.export_parts(target, "int32", DIM, [("accumulator", DIM)]))
    np.testing.assert_array_equal(got["slots"]["accumulator"],
                                  by_key(parts)["slots"]["accumulator"])
    # The imported initializer matrix (3 rows) serves new keys.
    np.testing.assert_array_equal(np.asarray(ffi.lookup(target, np.array([40], np.int32), DIM)),
                                  parts["default_values"][[40 % 3]])
    ffi.import_parts(target, "int32", DIM, {"keys": np.zeros(0, np.int32),
                                            "values": np.zeros((0, DIM), np.float32)})
    assert int(ffi.size(target)[0]) == 0
    for handle in (source, target):
        ffi.destroy(handle)


def test_int64_keys_round_trip_with_x64():
    with jax.enable_x64(True):
        source = ffi.create(np.ones((2, DIM), np.float32), key_dtype="int64", filter_freq=2)
        big = np.array([2**40 + 1, 2**40 + 1, -(2**35), 7], np.int64)
        ffi.lookup(source, big, DIM)
        parts = ffi.export_parts(source, "int64", DIM, [])
        assert parts["keys"].dtype == np.int64 and parts["freqs"].dtype == np.int64
        target = ffi.create(np.zeros((2, DIM), np.float32), key_dtype="int64", filter_freq=2)
        ffi.import_parts(target, "int64", DIM, parts)
        got = ffi.export_parts(target, "int64", DIM, [])
        np.testing.assert_array_equal(got["keys"], [2**40 + 1])
        np.testing.assert_array_equal(np.sort(got["keys_filtered"]), [-(2**35), 7])
        for handle in (source, target):
            ffi.destroy(handle)
    # Without x64 a table has int32 keys: saved int64 keys beyond int32 are refused.
    table32 = ffi.create(np.zeros((2, DIM), np.float32))
    with pytest.raises(ValueError, match="`keys` holds values outside int32"):
        ffi.import_parts(table32, "int32", DIM, {"keys": np.array([2**40]),
                                                 "values": np.zeros((1, DIM), np.float32)})
    ffi.destroy(table32)


@pytest.fixture
def table():
    handle = trained_table()
    yield handle
    ffi.destroy(handle)


def _parts(**changes):
    parts = {"keys": np.array([3, 4], np.int32), "values": np.ones((2, DIM), np.float32),
             "freqs": np.array([1, 2], np.int64), "versions": np.array([0, 1], np.int64),
             "slots": {"accumulator": np.ones((2, DIM), np.float32)}}
    parts.update(changes)
    return parts


@pytest.mark.parametrize("parts, message", [
    (_parts(values=np.ones((2, DIM + 1), np.float32)),
     r"`values` must have shape \[2, 4\]. Received: shape \(2, 5\)"),
    (_parts(freqs=np.array([1], np.int64)), r"`freqs` must have shape \[2\]"),
    (_parts(keys=np.array([3.0, 4.0])), "`keys` must hold integers. Received: dtype float64"),
    (_parts(versions=np.array([0, 2**40])), "`versions` holds values outside int32"),
    (_parts(slots={"accumulator": np.ones((3, DIM), np.float32)}),
     r"`accumulator` must have shape \[2, any\]"),
    (_parts(slots={"a,b": np.ones((2, DIM), np.float32)}), "slot names must be non-empty"),
    ({"values": np.ones((2, DIM), np.float32)}, "the saved table has no `keys`"),
])
def test_bad_parts_are_a_value_error_naming_the_part(table, parts, message):
    before = ffi.export(table, "int32", DIM)
    with pytest.raises(ValueError, match=message):
        ffi.import_parts(table, "int32", DIM, parts)
    np.testing.assert_array_equal(ffi.export(table, "int32", DIM)["keys"], before["keys"])


def _raw_import(table, **changes):
    """The import handler called without import_parts's checks."""
    operands = {"keys": np.array([3, 4], np.int32), "values": np.ones((2, DIM), np.float32),
                "freqs": np.array([1, 2], np.int32), "versions": np.array([0, 1], np.int32),
                "slot_values": np.ones((2, DIM), np.float32),
                "slot_widths": np.array([DIM], np.int32),
                "default_values": np.zeros((0, DIM), np.float32),
                "keys_filtered": np.zeros(0, np.int32), "freqs_filtered": np.zeros(0, np.int32),
                "versions_filtered": np.zeros(0, np.int32), "bloom": np.zeros(0, np.uint8)}
    slot_names = changes.pop("slot_names", "accumulator")
    operands.update(changes)
    jax.block_until_ready(ffi._call("kre_table_import", list(operands.values()), [],
                                    table=np.int64(table), slot_names=slot_names, clear=True))


@pytest.mark.parametrize("changes, message", [
    (dict(values=np.ones((2, DIM + 1), np.float32)), r"`values` must be float32 \[2, 4\]"),
    (dict(keys=np.array([3, 3], np.int32)), "`keys` holds key 3 twice"),
    (dict(keys=np.array([3.0, 4.0], np.float32)), "the embedding table has int32 keys"),
    (dict(freqs=np.array([1, -1], np.int32)), "`freqs` must be >= 0, got -1"),
    (dict(versions=np.array([1], np.int32)), "`versions` must be an int32 or int64 vector of 2"),
    (dict(slot_values=np.ones((2, 1), np.float32), slot_widths=np.array([1], np.int32)),
     "slot 'accumulator' has width 4 in the table but 1"),
    (dict(slot_names="m,m", slot_widths=np.array([2, 2], np.int32)), "holds 'm' twice"),
    (dict(slot_names="m,v"), "`slot_names` and `slot_widths` must have one length"),
    (dict(values=np.full((2, DIM), np.inf, np.float32)), "`values` must be finite"),
    (dict(default_values=np.zeros((2, DIM + 1), np.float32)), r"`default_values` must be"),
    (dict(bloom=np.ones(5, np.uint8)), "`bloom` has 5 bytes but this table's"),
])
def test_the_import_handler_refuses_bad_operands_and_keeps_the_table(table, changes, message):
    before = by_key(ffi.export(table, "int32", DIM))
    with pytest.raises(Exception, match=message):
        _raw_import(table, **changes)
    after = by_key(ffi.export(table, "int32", DIM))
    np.testing.assert_array_equal(after["keys"], before["keys"])
    np.testing.assert_array_equal(after["values"], before["values"])


# -- model.save / keras.saving.load_model ---------------------------------------

def _model(layer, features=2):
    inputs = keras.Input(shape=(features,), dtype="int32")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=3))
    return keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))


def _adagrad_layer(**kwargs):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    return EmbeddingVariable(
        3, optimizer=keras.optimizers.Adagrad(schedule, initial_accumulator_value=0.2),
        default_value_dim=5, initializer=keras.initializers.RandomUniform(seed=1), name="ev",
        **kwargs)


def _data(seed, n=8):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 9, size=(n, 2)).astype(np.int32),
            rng.normal(size=(n, 1)).astype(np.float32))


def _parts_of(layer):
    return by_key(ffi.export_parts(layer.handle, layer.key_dtype, layer.embedding_dim,
                                   [("accumulator", layer.embedding_dim)]))


def _assert_same_tables(a, b):
    for name in ("keys", "values", "freqs", "versions", "default_values"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    np.testing.assert_array_equal(a["slots"]["accumulator"], b["slots"]["accumulator"])


def test_load_model_restores_every_row_slot_frequency_and_version(tmp_path):
    layer = _adagrad_layer()
    model = _model(layer)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ids, labels = _data(0)
    model.fit(ids, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    twin = loaded.get_layer("ev")
    assert isinstance(twin, EmbeddingVariable) and twin.handle != layer.handle
    _assert_same_tables(_parts_of(layer), _parts_of(twin))
    assert int(twin.iterations.value) == int(layer.iterations.value) == 4
    queries = np.array([[1, 2], [40, 41]], np.int32)  # 40, 41: initializer rows
    np.testing.assert_array_equal(loaded.predict(queries, verbose=0),
                                  model.predict(queries, verbose=0))
    # Training on goes on alike: slots, steps (the schedule) and the Dense
    # layer's optimizer state came back.
    more_ids, more_labels = _data(1)
    for m in (model, loaded):
        m.fit(more_ids, more_labels, batch_size=4, shuffle=False, verbose=0)
    _assert_same_tables(_parts_of(layer), _parts_of(twin))
    np.testing.assert_array_equal(loaded.layers[-1].get_weights()[0],
                                  model.layers[-1].get_weights()[0])


def test_the_weights_file_holds_the_tensorflow_backends_parts(tmp_path):
    layer = _adagrad_layer()
    model = _model(layer)
    model.compile(optimizer="sgd", loss="mse")
    ids, labels = _data(0)
    model.fit(ids, labels, batch_size=4, verbose=0)
    path = tmp_path / "model.keras"
    model.save(str(path))
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")))
        group = weights["layers/embedding_variable/vars"]
        stored = {name: group[name][()] for name in group}
    assert sorted(stored) == sorted(tables.ARRAY_PARTS + ("slot:accumulator", "iterations"))
    assert int(stored["iterations"]) == int(layer.iterations.value) == 2
    n = len(np.unique(ids))
    assert stored["keys"].dtype == np.int32 and stored["keys"].shape == (n,)
    for name in ("freqs", "versions", "freqs_filtered", "versions_filtered"):
        assert stored[name].dtype == np.int64, name
    assert stored["values"].shape == stored["slot:accumulator"].shape == (n, 3)
    np.testing.assert_array_equal(stored["default_values"], layer.default_values)
    assert stored["bloom"].dtype == np.uint8 and stored["keys_filtered"].shape == (0,)
    entry = next(e for e in config["config"]["layers"] if e["name"] == "ev")
    assert entry["registered_name"] == "keras_rec_emb>EmbeddingVariable"
    assert entry["config"]["optimizer"]["registered_name"] == "keras_rec_emb>Adagrad"
    assert entry["config"]["ev_option"]["config"]["init_option"]["config"][
        "default_value_dim"] == 5


@pytest.mark.parametrize("change, message", [
    ({"optimizer": {"class_name": "RMSprop", "config": {}}},
     r"`optimizer` config must be that of an optimizer of keras_rec_emb.optimizers \(adagrad, "),
    ({"ev_option": 3}, "`ev_option` must be a serialized EmbeddingVariableOption"),
])
def test_a_config_the_jax_layer_cannot_run_is_refused(change, message):
    config = _adagrad_layer().get_config()
    config.update(change)
    with pytest.raises(ValueError, match=message):
        EmbeddingVariable.from_config(config)


def test_config_round_trip():
    layer = _adagrad_layer(num_shards=4)
    twin = EmbeddingVariable.from_config(layer.get_config())
    assert twin.get_config() == layer.get_config()
    assert (twin.num_shards, twin.default_value_dim) == (4, 5)
    assert isinstance(twin.optimizer, keras.optimizers.Adagrad)


def test_export_for_serving_refuses_bad_arguments(tmp_path):
    import keras_rec_emb

    model = _model(_adagrad_layer())
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        keras_rec_emb.export_for_serving("model", tmp_path / "a")
    with pytest.raises(ValueError, match="`input_signature` must be None"):
        keras_rec_emb.export_for_serving(model, tmp_path / "a", input_signature=[None])
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="`filepath` must be a directory"):
        keras_rec_emb.export_for_serving(model, tmp_path / "file")
    # As under the TensorFlow backend (tests/test_request_memory.py).
    with pytest.raises(ValueError, match=r"`max_input_size` must be .*Received: "
                                         r"max_input_size=0"):
        keras_rec_emb.export_for_serving(model, tmp_path / "a", max_input_size=0)
    with pytest.raises(TypeError, match=r"`max_input_size` must be .*Received: "
                                        r"max_input_size=1.5"):
        keras_rec_emb.export_for_serving(model, tmp_path / "a", max_input_size=1.5)
    assert not (tmp_path / "a").exists()


def test_a_sequential_model_saves_and_loads_its_table(tmp_path):
    """(The functional form: test_load_model_restores_every_row_slot_frequency_and_version.)"""
    model = keras.Sequential([keras.Input((2,), dtype="int32"), _adagrad_layer(),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    ids, labels = _data(0)
    model.fit(ids, labels, batch_size=4, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    _assert_same_tables(_parts_of(model.layers[0]), _parts_of(loaded.layers[0]))
    queries = np.array([[1, 2], [40, 41]], np.int32)
    np.testing.assert_array_equal(loaded.predict(queries, verbose=0),
                                  model.predict(queries, verbose=0))


def test_the_optimizer_saves_what_the_tensorflow_backends_saves(tmp_path):
    """Step, learning rate and the Dense weights' accumulators; not the
    slots of the layer's zero-size anchor (a table's slots are the
    layer's)."""
    from keras_rec_emb import optimizers

    layer = EmbeddingVariable(3, default_value_dim=5, name="ev")
    model = _model(layer)
    model.compile(optimizer=optimizers.Adagrad(0.1), loss="mse")
    ids, labels = _data(0)
    model.fit(ids, labels, batch_size=4, verbose=0)
    assert [tuple(v.shape) for v in model.optimizer.variables] == [(), (), (0,), (6, 1), (1,)]
    path = tmp_path / "model.keras"
    model.save(str(path))
    with zipfile.ZipFile(path) as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")))
        stored = [weights["optimizer/vars"][str(i)][()] for i in range(len(
            weights["optimizer/vars"]))]
    assert [np.shape(v) for v in stored] == [(), (), (6, 1), (1,)]
    assert int(stored[0]) == 2
    np.testing.assert_array_equal(stored[2], np.asarray(model.optimizer.variables[3]))
    assert "slot:accumulator" in weights_names(path)
    loaded = keras.saving.load_model(str(path))
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def weights_names(path):
    with zipfile.ZipFile(path) as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")))
        return list(weights["layers/embedding_variable/vars"])
