"""The file tier (`StorageOption("FILE", storage_path, storage_size)`) under
Keras's JAX backend: with far more ids than its DRAM cache holds, a model
saves and reloads every row equal to the same model on DRAM; a model
reloaded beside the live one works in a folder of its own; a file-tier
`.keras` file saved under TensorFlow loads under JAX with every row. What
runs under both backends (training like DRAM, snapshots, a killed writer,
bad input) is in tests/test_file_tier.py."""

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from tests._file_tier import DIM, build_model, ev_option, file_option, same_export, spills
from tests._file_tier import data as training_data

def test_save_and_load_restore_every_row(tmp_path):
    ids, y = training_data(1)
    dram = build_model(ev_option())
    file = build_model(ev_option(file_option(tmp_path / "store")))
    dram.fit(ids, y, batch_size=128, epochs=1, verbose=0, shuffle=False)
    file.fit(ids, y, batch_size=128, epochs=1, verbose=0, shuffle=False)
    expect = dram.get_layer("ev").export()
    predictions = dram.predict(ids, verbose=0)
    path = str(tmp_path / "m.keras")
    file.save(path)
    saved_dir = file.get_layer("ev").storage_dir

    # Beside the live model: a folder of its own, the same rows.
    with pytest.warns(UserWarning, match="held by another live table"), \
            kre.storage_root(tmp_path):
        copy = keras.saving.load_model(path)
    layer = copy.get_layer("ev")
    assert layer.storage_dir.startswith(saved_dir + ".copy-")
    same_export(expect, layer.export())
    np.testing.assert_array_equal(copy.predict(ids, verbose=0), predictions)
    spills(layer.stats())
    with pytest.raises(ValueError, match="storage_path of its own"):
        layer.snapshot()
    copy_dir = layer.storage_dir
    del copy, layer, file
    gc.collect()
    assert not os.path.exists(copy_dir)  # the copy's folder goes with it

    # The live model gone, a reload takes the folder itself (no warning)
    # and trains on as the DRAM model does.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        again = kre.load_model(path, storage_root=tmp_path)
    layer = again.get_layer("ev")
    assert layer.storage_dir == saved_dir
    same_export(expect, layer.export())
    more, y2 = training_data(2, 256)
    again.fit(more, y2, batch_size=64, verbose=0, shuffle=False)
    dram.fit(more, y2, batch_size=64, verbose=0, shuffle=False)
    same_export(dram.get_layer("ev").export(), layer.export())
    assert layer.snapshot() == 1


_TENSORFLOW_SAVES = textwrap.dedent("""
    import sys
    import numpy as np, keras, keras_rec_emb as kre
    store, path, out = sys.argv[1:4]
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=97), num_shards=4,
        storage_option=kre.StorageOption("FILE", storage_path=store, storage_size=4096))
    ids = keras.Input((3,), dtype="int32")
    emb = kre.layers.EmbeddingVariable(4, ev_option=option, combiner="sum", name="ev",
                                       key_dtype="int32")(ids)
    model = keras.Model(ids, keras.layers.Dense(1, name="dense")(emb))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    rng = np.random.default_rng(5)
    x = (rng.zipf(1.2, size=(512, 3)) % 3000).astype(np.int32)
    model.fit(x, rng.normal(size=(512, 1)), batch_size=64, verbose=0, shuffle=False)
    layer = model.get_layer("ev")
    assert layer.stats()["file_writes"] > 0
    model.save(path)
    data = layer.export()
    np.savez(out, x=x, predictions=model.predict(x, verbose=0), keys=data["keys"],
             values=data["values"], freqs=data["freqs"], versions=data["versions"],
             acc=data["slots"]["accumulator"])
    print("SAVED-OK")
""")


def test_a_tensorflow_saved_file_tier_model_loads_under_jax(tmp_path):
    path, out = str(tmp_path / "tf.keras"), str(tmp_path / "tf.npz")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-c", _TENSORFLOW_SAVES, str(tmp_path / "tf_store"), path, out],
        capture_output=True, text=True, env=env, timeout=400)
    assert "SAVED-OK" in result.stdout, result.stderr[-3000:]
    saved = np.load(out)
    model = kre.load_model(path, storage_root=tmp_path)
    layer = model.get_layer("ev")
    assert layer.stats()["storage"] == "FILE"
    # The TensorFlow process is gone: its folder is free for this table.
    assert layer.storage_dir == os.path.join(str(tmp_path / "tf_store"), "ev_embeddings")
    data = layer.export()
    a, b = np.argsort(saved["keys"]), np.argsort(data["keys"])
    np.testing.assert_array_equal(saved["keys"][a], data["keys"][b])
    for name, mine in (("values", data["values"]), ("freqs", data["freqs"]),
                       ("versions", data["versions"]), ("acc", data["slots"]["accumulator"])):
        np.testing.assert_array_equal(saved[name][a], np.asarray(mine)[b], err_msg=name)
    np.testing.assert_allclose(model.predict(saved["x"], verbose=0), saved["predictions"],
                               rtol=1e-5, atol=1e-6)
    assert layer.stats()["rows"] > layer.stats()["cached_rows"]


def test_the_config_keeps_the_storage_option(tmp_path):
    layer = EmbeddingVariable(DIM, ev_option=ev_option(file_option(tmp_path, cache=1 << 16)),
                              name="c")
    config = layer.get_config()
    storage = config["ev_option"]["config"]["storage_option"]["config"]
    assert storage == {"storage_type": "FILE", "storage_path": str(tmp_path),
                       "storage_size": 1 << 16}
    with kre.storage_root(tmp_path):  # the folder a config may name
        twin = EmbeddingVariable.from_config(config)
    assert twin.get_config() == config
    twin(np.array([1, 2, 3], np.int32), training=False)
    assert twin.storage_dir == os.path.join(str(tmp_path), "c_embeddings")
    assert twin.stats()["storage"] == "FILE"


def test_the_snapshot_example_runs():
    import doctest

    tests = doctest.DocTestFinder().find(
        EmbeddingVariable.snapshot, "snapshot",
        globs={"keras": keras, "np": np, "keras_rec_emb": kre})
    assert tests and tests[0].examples
    assert doctest.DocTestRunner().run(tests[0], out=lambda text: None).failed == 0


def test_a_keras_file_naming_a_storage_path_outside_the_root_writes_nothing_there(tmp_path):
    """As under TensorFlow (tests/test_untrusted_files.py): a crafted config
    naming an absolute folder, or one outside the caller's root, is refused
    and nothing is created there; inside the root it loads."""
    import json
    import zipfile

    ids, y = training_data(5, 128)
    model = build_model(ev_option(file_option(tmp_path / "trainer")))
    model.fit(ids, y, batch_size=64, verbose=0)
    expect = model.predict(ids, verbose=0)
    saved, crafted = str(tmp_path / "saved.keras"), str(tmp_path / "crafted.keras")
    model.save(saved)
    del model
    gc.collect()
    victim = tmp_path / "victim" / "tables"
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(crafted, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "config.json":
                old = json.dumps(str(tmp_path / "trainer"))
                assert data.decode().count(old) == 1
                data = data.decode().replace(old, json.dumps(str(victim))).encode()
            dst.writestr(info, data)
    with pytest.raises(ValueError) as info:
        keras.saving.load_model(crafted)
    assert "storage_path" in str(info.value) and str(victim) in str(info.value)
    assert "storage_root" in str(info.value)
    with pytest.raises(ValueError, match="outside the storage root"):
        kre.load_model(crafted, storage_root=tmp_path / "root")
    assert not (tmp_path / "victim").exists() and not (tmp_path / "root").exists()
    with kre.storage_root(tmp_path / "victim"):
        loaded = keras.saving.load_model(crafted)
    assert loaded.get_layer("ev").storage_dir == str(victim / "ev_embeddings")
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), expect, rtol=1e-6)


def test_export_for_serving_of_a_file_tier_model(tmp_path):
    """The TensorFlow child loads the file this process writes of its own
    model (its storage_path is absolute): it names no storage root, so the
    child must give one for the export to work."""
    ids, y = training_data(6, 128)
    model = build_model(ev_option(file_option(tmp_path / "store")))
    model.fit(ids, y, batch_size=64, verbose=0)
    live = sorted(os.listdir(tmp_path / "store"))
    out = kre.export_for_serving(model, str(tmp_path / "serving"))
    assert os.path.exists(os.path.join(out, "saved_model.pb"))
    # The child's table worked in a copy folder beside the live one, gone with it.
    assert sorted(os.listdir(tmp_path / "store")) == live
