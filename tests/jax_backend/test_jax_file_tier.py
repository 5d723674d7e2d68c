"""The file tier (`StorageOption("FILE", storage_path, storage_size)`) under
Keras's JAX backend: with far more ids than its DRAM cache holds, a model
trains, exports, saves and reloads every row equal to the same model on
DRAM; the rows live in files under `storage_path`; snapshots restore
exactly, a killed writer never destroys the last complete one, a corrupt one
is refused naming its file; a model reloaded beside the live one works in a
folder of its own; a file-tier `.keras` file saved under TensorFlow loads
under JAX with every row."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

DIM, VOCAB, SHARDS = 4, 3000, 4


def _option(storage=None, filter_option=None, evict_option=None):
    init = kre.InitializerOption(initializer=keras.initializers.RandomUniform(seed=3),
                                 default_value_dim=97)
    return kre.EmbeddingVariableOption(init_option=init, filter_option=filter_option,
                                       evict_option=evict_option, storage_option=storage,
                                       num_shards=SHARDS)


def _file(path, cache=4096):
    # 4 KiB over 4 shards: each shard caches 1 KiB of rows (a few dozen rows
    # of value and Adagrad accumulator), far fewer than the table holds, so
    # rows go to and come back from files.
    return kre.StorageOption("FILE", storage_path=str(path), storage_size=cache)


def _model(option, name="ev"):
    ids = keras.Input((3,), dtype="int32")
    emb = EmbeddingVariable(DIM, ev_option=option, combiner="sum", name=name)(ids)
    out = keras.layers.Dense(1, name="dense", kernel_initializer="ones")(emb)
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def _data(seed=0, n=512):
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.2, size=(n, 3)) % VOCAB).astype(np.int32)
    return ids, rng.normal(size=(n, 1)).astype(np.float32)


def _same_rows(a, b):
    """Every part of two exports equal, row by row (keys in any order)."""
    oa, ob = np.argsort(a["keys"]), np.argsort(b["keys"])
    for key in ("keys", "values", "freqs", "versions"):
        np.testing.assert_array_equal(np.asarray(a[key])[oa], np.asarray(b[key])[ob],
                                      err_msg=key)
    assert sorted(a["slots"]) == sorted(b["slots"])
    for name in a["slots"]:
        np.testing.assert_array_equal(np.asarray(a["slots"][name])[oa],
                                      np.asarray(b["slots"][name])[ob], err_msg=name)
    fa, fb = np.argsort(a["keys_filtered"]), np.argsort(b["keys_filtered"])
    for key in ("keys_filtered", "freqs_filtered", "versions_filtered"):
        np.testing.assert_array_equal(np.asarray(a[key])[fa], np.asarray(b[key])[fb],
                                      err_msg=key)


def _spills(stats):
    # More rows than the cache holds: most live only in files.
    assert stats["storage"] == "FILE"
    assert 0 < stats["cached_rows"] < stats["rows"] == stats["size"]
    assert stats["disk_bytes"] > 0 and stats["file_writes"] > 0 and stats["file_reads"] > 0
    assert 0.0 < stats["cache_hit_rate"] < 1.0


# Training like DRAM, with each filter and eviction: tests/test_file_tier.py
# (both backends).


def test_save_and_load_restore_every_row(tmp_path):
    ids, y = _data(1)
    dram = _model(_option())
    file = _model(_option(_file(tmp_path / "store")))
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
    _same_rows(expect, layer.export())
    np.testing.assert_array_equal(copy.predict(ids, verbose=0), predictions)
    _spills(layer.stats())
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
    _same_rows(expect, layer.export())
    more, y2 = _data(2, 256)
    again.fit(more, y2, batch_size=64, verbose=0, shuffle=False)
    dram.fit(more, y2, batch_size=64, verbose=0, shuffle=False)
    _same_rows(dram.get_layer("ev").export(), layer.export())
    assert layer.snapshot() == 1


def test_snapshot_restores_exactly_and_refuses_a_corrupt_one(tmp_path):
    ids, y = _data(2)
    model = _model(_option(_file(tmp_path)))
    model.fit(ids, y, batch_size=128, epochs=1, verbose=0)
    layer = model.get_layer("ev")
    assert layer.snapshot() == 1
    at_snapshot = layer.export()
    model.fit(ids, y, batch_size=128, epochs=1, verbose=0)
    assert not np.array_equal(layer.export()["values"], at_snapshot["values"])
    assert layer.restore_snapshot() == len(at_snapshot["keys"])
    _same_rows(at_snapshot, layer.export())

    index = os.path.join(layer.storage_dir, "snap-1", "index")
    with open(index, "r+b") as f:
        f.seek(50)
        byte = f.read(1)
        f.seek(50)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=f"corrupt.*{index}"):
        layer.restore_snapshot()
    _same_rows(at_snapshot, layer.export())
    with pytest.raises(ValueError, match="snapshot restore failed"):
        layer.restore_snapshot(str(tmp_path / "nothing_here"))
    _same_rows(at_snapshot, layer.export())


def test_bad_input_names_it(tmp_path):
    dram = EmbeddingVariable(DIM, name="dram")
    dram(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="needs a file-tier table.*'dram/embeddings'"):
        dram.snapshot()
    with pytest.raises(ValueError, match="needs a file-tier table.*'dram/embeddings'"):
        dram.restore_snapshot()
    file = EmbeddingVariable(DIM, ev_option=_option(_file(tmp_path)), name="f")
    file(np.array([1, 2], np.int32))
    with pytest.raises(TypeError, match="path.*Received: path=3"):
        file.restore_snapshot(3)
    with pytest.raises(ValueError, match="not built yet"):
        EmbeddingVariable(DIM, ev_option=_option(_file(tmp_path / "x"))).snapshot()
    # A storage path under a plain file: the error names it.
    plain = tmp_path / "plain"
    plain.write_text("x")
    layer = EmbeddingVariable(DIM, ev_option=_option(_file(plain / "sub")), name="bad")
    with pytest.raises(ValueError, match=str(plain)):
        layer(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="storage_size"):
        kre.StorageOption("FILE", storage_path=str(tmp_path), storage_size=0)
    with pytest.raises(ValueError, match="storage_path.*required"):
        kre.StorageOption("FILE")


_WRITER = textwrap.dedent("""
    import os, sys, numpy as np, keras_rec_emb as kre
    folder = sys.argv[1]
    option = kre.EmbeddingVariableOption(num_shards=4, storage_option=kre.StorageOption(
        "FILE", storage_path=folder, storage_size=4096))
    layer = kre.layers.EmbeddingVariable(4, ev_option=option, name="w",
                                         optimizer=kre.optimizers.Adagrad(0.1))
    layer.build()
    current = os.path.join(folder, "w_embeddings", "CURRENT")
    if os.path.exists(current):
        layer.restore_snapshot()
    rng = np.random.default_rng(os.getpid())
    print("READY", flush=True)
    while True:
        ids = rng.integers(0, 5000, size=256).astype(np.int32)
        layer(ids, training=True)  # inserts (no backward: no update)
        data = layer.export()
        seq = int(open(current).read()[5:]) + 1 if os.path.exists(current) else 1
        tmp = os.path.join(folder, f"expect-{seq}.tmp.npz")
        np.savez(tmp, keys=data["keys"], values=data["values"],
                 acc=data["slots"]["accumulator"])
        os.replace(tmp, os.path.join(folder, f"expect-{seq}.npz"))
        assert layer.snapshot() == seq
""")


def test_a_killed_snapshot_never_destroys_the_previous_one(tmp_path):
    """A writer inserts and snapshots in a loop (saving what each snapshot
    must hold just before taking it) and is killed with SIGKILL at a
    random point, twice; each time the latest complete snapshot restores
    exactly, and the next writer goes on from it."""
    rng = np.random.default_rng(3)
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    checked = 0
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            line = proc.stdout.readline().strip()
            assert line == b"READY", proc.stderr.read()[-2000:] if proc.poll() else line
            time.sleep(1.0 + rng.random() * 1.5)
        finally:
            proc.send_signal(signal.SIGKILL)
            code = proc.wait(timeout=60)
        assert code == -signal.SIGKILL, proc.stderr.read()[-2000:]  # not a crash
        current = tmp_path / "w_embeddings" / "CURRENT"
        assert current.exists(), proc.stderr.read()[-2000:]
        seq = int(current.read_text()[5:])
        expect = np.load(tmp_path / f"expect-{seq}.npz")
        layer = EmbeddingVariable(4, name="w", optimizer=kre.optimizers.Adagrad(0.1),
                                  ev_option=kre.EmbeddingVariableOption(
                                      num_shards=4, storage_option=_file(tmp_path)))
        layer.build()
        assert layer.restore_snapshot() == len(expect["keys"])
        data = layer.export()
        a, b = np.argsort(expect["keys"]), np.argsort(data["keys"])
        np.testing.assert_array_equal(expect["keys"][a], data["keys"][b])
        np.testing.assert_array_equal(expect["values"][a], data["values"][b])
        np.testing.assert_array_equal(expect["acc"][a], data["slots"]["accumulator"][b])
        checked += 1
        del layer, data  # releases the folder for the next writer
        gc.collect()
    assert checked == 2


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
    layer = EmbeddingVariable(DIM, ev_option=_option(_file(tmp_path, cache=1 << 16)), name="c")
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

    ids, y = _data(5, 128)
    model = _model(_option(_file(tmp_path / "trainer")))
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
    ids, y = _data(6, 128)
    model = _model(_option(_file(tmp_path / "store")))
    model.fit(ids, y, batch_size=64, verbose=0)
    live = sorted(os.listdir(tmp_path / "store"))
    out = kre.export_for_serving(model, str(tmp_path / "serving"))
    assert os.path.exists(os.path.join(out, "saved_model.pb"))
    # The child's table worked in a copy folder beside the live one, gone with it.
    assert sorted(os.listdir(tmp_path / "store")) == live
