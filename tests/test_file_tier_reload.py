"""Reloading a file-tier model beside the live one: the copy
works in a folder of its own next to the live table's, removed when it is
freed; it cannot snapshot (its folder goes with it); when no such folder can
be made, the error names the fixes."""

import gc
import os
import subprocess
import sys
import textwrap
import time
import warnings

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable


def _model(storage):
    opt = kre.EmbeddingVariableOption(storage_option=kre.StorageOption(
        "FILE", storage_path=str(storage), storage_size=4096))  # rows spill to files
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(8, combiner="sum", name="ev", ev_option=opt)
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.3), loss="mse")
    return model, ev


def _trained(tmp_path, seed=0):
    keras.utils.set_random_seed(seed)
    model, ev = _model(tmp_path / "store")
    rng = np.random.default_rng(seed)
    model.fit(rng.integers(0, 3000, (900, 3)), rng.normal(size=(900, 1)), batch_size=64,
              verbose=0)
    assert ev.stats()["file_writes"] > 0  # rows really went to files
    path = str(tmp_path / "m.keras")
    model.save(path)
    return model, ev, path, rng


def _same_rows(a, b):
    order_a, order_b = np.argsort(a["keys"]), np.argsort(b["keys"])
    np.testing.assert_array_equal(a["keys"][order_a], b["keys"][order_b])
    np.testing.assert_array_equal(a["values"][order_a], b["values"][order_b])
    for name in a["slots"]:
        np.testing.assert_array_equal(a["slots"][name][order_a], b["slots"][name][order_b])


def test_reload_beside_the_live_model_gets_its_own_folder(tmp_path):
    model, ev, path, rng = _trained(tmp_path)
    live_dir = ev.table.storage_dir
    first_snapshot = ev.snapshot()
    live_files = sorted(os.listdir(live_dir))
    with pytest.warns(UserWarning, match="held by another live table"), \
            kre.storage_root(tmp_path):
        copy = kre.load_model(path, storage_root=tmp_path)
    copy_ev = copy.get_layer("ev")
    copy_dir = copy_ev.table.storage_dir
    assert os.path.dirname(copy_dir) == os.path.dirname(live_dir)
    assert os.path.basename(copy_dir).startswith("ev_embeddings.copy-")
    assert copy_ev.stats()["storage"] == "FILE"
    _same_rows(ev.export(), copy_ev.export())
    batch = rng.integers(0, 4000, (32, 3))
    np.testing.assert_array_equal(copy.predict(batch, verbose=0), model.predict(batch, verbose=0))

    # The two train apart: neither sees the other's rows.
    before = ev.export()
    copy.fit(rng.integers(0, 3000, (300, 3)), rng.normal(size=(300, 1)), batch_size=64,
             verbose=0)
    assert copy_ev.stats()["file_writes"] > 0
    _same_rows(before, ev.export())
    model.fit(rng.integers(0, 3000, (300, 3)), rng.normal(size=(300, 1)), batch_size=64,
              verbose=0)
    assert not np.allclose(copy.predict(batch, verbose=0), model.predict(batch, verbose=0))

    # Its folder goes with it, so it refuses to snapshot there; it restores
    # the live table's latest snapshot by default.
    with pytest.raises(ValueError, match="storage_path of its own"):
        copy_ev.snapshot()
    second_snapshot = ev.snapshot()
    assert second_snapshot > first_snapshot
    assert copy_ev.restore_snapshot() == ev.table.size()
    _same_rows(ev.export(), copy_ev.export())

    # A second copy beside both, then the copies are freed with their folders.
    with pytest.warns(UserWarning, match="held by another live table"):
        other = kre.load_model(path, storage_root=tmp_path)
    other_dir = other.get_layer("ev").table.storage_dir
    assert other_dir not in (copy_dir, live_dir)
    del copy, copy_ev, other
    keras.backend.clear_session()
    gc.collect()
    assert not os.path.exists(copy_dir) and not os.path.exists(other_dir)
    # The live table's folder kept its files (and gained its snapshot).
    assert set(live_files) <= set(os.listdir(live_dir))
    model.fit(batch, np.zeros((32, 1)), verbose=0)
    assert ev.snapshot() > second_snapshot


def test_reload_in_another_process_while_the_trainer_lives(tmp_path):
    model, ev, path, rng = _trained(tmp_path, seed=1)
    batch = rng.integers(0, 4000, (16, 3))
    np.save(tmp_path / "batch.npy", batch)
    script = textwrap.dedent(f"""
        import os, warnings
        import numpy as np, keras
        import keras_rec_emb
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with keras_rec_emb.storage_root({str(tmp_path)!r}):
                m = keras.saving.load_model({path!r})
        assert any("held by another live table" in str(w.message) for w in caught)
        folder = m.get_layer("ev").table.storage_dir
        assert ".copy-" in os.path.basename(folder) and os.path.isdir(folder)
        np.save({str(tmp_path / "out.npy")!r},
                m.predict(np.load({str(tmp_path / "batch.npy")!r}), verbose=0))
        print(folder)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"),
                                  model.predict(batch, verbose=0))
    # The evaluator's folder went with it (at exit).
    assert not os.path.exists(r.stdout.strip().splitlines()[-1])


def test_copy_folder_from_the_environment_and_the_error_when_none_can_be_made(
        tmp_path, monkeypatch):
    model, ev, path, rng = _trained(tmp_path, seed=2)
    elsewhere = tmp_path / "copies"
    monkeypatch.setenv("KRE_STORAGE_COPY_PATH", str(elsewhere))
    with pytest.warns(UserWarning, match="held by another live table"):
        copy = kre.load_model(path, storage_root=tmp_path)
    copy_dir = copy.get_layer("ev").table.storage_dir
    assert os.path.dirname(copy_dir) == str(elsewhere)
    batch = rng.integers(0, 4000, (8, 3))
    np.testing.assert_array_equal(copy.predict(batch, verbose=0), model.predict(batch, verbose=0))
    del copy

    # Nowhere to make a folder: the error says what to do.
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    monkeypatch.setenv("KRE_STORAGE_COPY_PATH", str(a_file / "copies"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError) as info:
            kre.load_model(path, storage_root=tmp_path)
    message = str(info.value)
    for part in (ev.table.storage_dir, "held by another live table", str(a_file / "copies"),
                 "Set the environment variable KRE_STORAGE_COPY_PATH", "no live table holds"):
        assert part in message, message


def test_stale_copy_folders_are_removed(tmp_path):
    model, ev, path, rng = _trained(tmp_path, seed=3)
    root = os.path.dirname(ev.table.storage_dir)
    # A copy's folder left by a killed process: its lock is free.
    stale = os.path.join(root, "ev_embeddings.copy-killed00")
    os.makedirs(os.path.join(stale, "live-1-0"))
    open(os.path.join(stale, "LOCK"), "w").close()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with pytest.warns(UserWarning, match="held by another live table"):
        held = kre.load_model(path, storage_root=tmp_path)
    held_dir = held.get_layer("ev").table.storage_dir
    assert not os.path.exists(stale)
    os.utime(held_dir, (old, old))  # old, but its table lives: kept
    with pytest.warns(UserWarning, match="held by another live table"):
        other = kre.load_model(path, storage_root=tmp_path)
    assert os.path.isdir(held_dir)
    batch = rng.integers(0, 4000, (8, 3))
    np.testing.assert_array_equal(held.predict(batch, verbose=0),
                                  other.predict(batch, verbose=0))
