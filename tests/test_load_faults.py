"""`keras_rec_emb.load_model` of a .keras file whose second table fails to
load: no model, and nothing of it left behind (keras_rec_emb/saving.py)."""

import gc
import io
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_rec_emb as kre


def _file_tier_model(storage):
    def option():
        return kre.EmbeddingVariableOption(storage_option=kre.StorageOption(
            "FILE", storage_path=str(storage), storage_size=4096))

    ids = keras.Input((2,), dtype="int64")
    a = kre.layers.EmbeddingVariable(4, combiner="sum", name="a", ev_option=option())
    b = kre.layers.EmbeddingVariable(4, combiner="sum", name="b", ev_option=option())
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Concatenate()([a(ids),
                                                                               b(ids)])))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def _second_table_broken(good, bad):
    """A copy of `good` whose table 'b' holds NaN rows (refused on load)."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "model.weights.h5":
                buf = io.BytesIO(data)
                with h5py.File(buf, "r+") as h5:
                    groups = []
                    h5.visititems(lambda n, o: groups.append(o) if n.endswith("/vars")
                                  and o.attrs.get("name") == "b" else None)
                    values = groups[0]["values"]
                    shape = values.shape
                    del groups[0]["values"]
                    groups[0]["values"] = np.full(shape, np.nan, np.float32)
                data = buf.getvalue()
            dst.writestr(info, data)


def test_a_failed_load_frees_the_tables_it_had_loaded(tmp_path):
    model = _file_tier_model(tmp_path / "store")
    model.fit(np.arange(40).reshape(20, 2), np.ones((20, 1)), verbose=0)
    x = np.arange(6).reshape(3, 2)
    expect = model.predict(x, verbose=0)
    good, bad = str(tmp_path / "m.keras"), str(tmp_path / "bad.keras")
    kre.save_model(model, good)
    del model
    gc.collect()  # the trainer is gone: its folders are free
    _second_table_broken(good, bad)
    with pytest.raises(ValueError, match="could not be loaded") as info:
        kre.load_model(bad, storage_root=tmp_path)
    notes = getattr(info.value, "__notes__", [])
    # Table 'a' of the failed load loaded and took its folder; it is gone, so
    # the good file loads into the folders themselves (no stand-in copy
    # folder) and snapshots there.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = kre.load_model(good, storage_root=tmp_path)
    assert not [w for w in caught if "held by another live table" in str(w.message)]
    assert any("tables it had begun to load were freed" in n for n in notes)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expect, rtol=1e-6)
    assert loaded.get_layer("a").table.snapshot() >= 1
