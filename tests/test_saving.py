"""Saving: .keras round trips, tf.train.Checkpoint, SavedModel export served in
a fresh process, and saves that never destroy the previous file."""

import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

rng = np.random.default_rng(11)
X = rng.integers(0, 10**15, size=(64, 3))
X2 = np.concatenate([X[:32], rng.integers(0, 10**15, size=(32, 3))])  # old + new ids
Y = rng.integers(0, 2, size=(64, 1)).astype(np.float32)


def make_model(optimizer="adam", key_dtype="int64"):
    ids = keras.Input((3,), dtype=key_dtype, name="ids")
    emb = EmbeddingVariable(8, combiner="mean", key_dtype=key_dtype, name="ev",
                            ev_option=kre.EmbeddingVariableOption(track_meta=True))(ids)
    seq = EmbeddingVariable(4, key_dtype=key_dtype, name="ev_seq")(ids)
    h = keras.layers.Concatenate()([emb, keras.layers.Flatten()(seq)])
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(8, "relu")(h))
    model = keras.Model(ids, out)
    opts = {"adam": kre.optimizers.Adam(0.01), "ftrl": kre.optimizers.Ftrl(0.1),
            "sgd": kre.optimizers.SGD(0.1, momentum=0.5)}
    model.compile(optimizer=opts[optimizer], loss="binary_crossentropy")
    return model


def tables(model):
    out = {}
    for layer in model.layers:
        if isinstance(layer, EmbeddingVariable):
            data = layer.export()
            order = np.argsort(data["keys"])
            out[layer.name] = {
                "keys": data["keys"][order], "values": data["values"][order],
                "freqs": data["freqs"][order], "versions": data["versions"][order],
                **{f"slot:{k}": v[order] for k, v in data["slots"].items()},
            }
    return out


def assert_tables_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for part in a[name]:
            np.testing.assert_array_equal(a[name][part], b[name][part], err_msg=f"{name}/{part}")


@pytest.mark.parametrize("optimizer, key_dtype", [("adam", "int64"), ("ftrl", "int64"),
                                                  ("sgd", "int32")])
def test_keras_round_trip_and_training_continues_identically(saving_round_trip, optimizer, key_dtype):
    x, x2 = (X % 2**31, X2 % 2**31) if key_dtype == "int32" else (X, X2)
    model = make_model(optimizer, key_dtype)
    model.fit(x, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    loaded = saving_round_trip(model, x)
    assert type(loaded.optimizer) is type(model.optimizer)
    assert_tables_equal(tables(model), tables(loaded))
    assert any(t["slot:" + ("momentum" if optimizer != "ftrl" else "linear")].size
               for t in tables(loaded).values())
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)
    # Both keep training on old and new ids: they stay identical.
    for m in (model, loaded):
        m.fit(x2, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_tables_equal(tables(model), tables(loaded))
    np.testing.assert_array_equal(model.predict(x2, verbose=0), loaded.predict(x2, verbose=0))


def test_checkpoint_round_trip_with_optimizer(tmp_path):
    model = make_model()
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = ckpt.save(str(tmp_path / "ckpt"))
    expect_tables = tables(model)
    expect = model.predict(X, verbose=0)
    model.fit(X2, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # diverge

    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    status = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    status.assert_existing_objects_matched()
    assert_tables_equal(tables(fresh), expect_tables)
    np.testing.assert_array_equal(fresh.predict(X, verbose=0), expect)
    # Restoring in place rolls the trained model back too.
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
    assert_tables_equal(tables(model), expect_tables)
    for m in (model, fresh):
        m.fit(X2, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_tables_equal(tables(model), tables(fresh))


def test_export_serves_in_a_fresh_process(tmp_path):
    model = make_model()
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    unseen = rng.integers(0, 10**15, size=(5, 3))
    batch = np.concatenate([X[:5], unseen])
    expect = model.predict(batch, verbose=0)
    size_before = {k: len(v["keys"]) for k, v in tables(model).items()}
    export_dir = str(tmp_path / "served")
    model.export(export_dir)
    np.save(tmp_path / "batch.npy", batch)
    script = textwrap.dedent(f"""
        import numpy as np, tensorflow as tf
        import keras_rec_emb  # registers the ops
        served = tf.saved_model.load({export_dir!r})
        batch = np.load({str(tmp_path / 'batch.npy')!r})
        out = served.serve(tf.constant(batch))
        np.save({str(tmp_path / 'out.npy')!r}, out.numpy())
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expect, rtol=1e-6)
    # Serving does not insert unseen ids.
    assert {k: len(v["keys"]) for k, v in tables(model).items()} == size_before


def test_failed_save_keeps_previous_file(tmp_path):
    path = str(tmp_path / "m.keras")
    model = make_model()
    model.fit(X, Y, batch_size=16, verbose=0)
    kre.save_model(model, path)
    expect = model.predict(X, verbose=0)
    model.fit(X2, Y, batch_size=16, verbose=0)
    layer = model.get_layer("ev")
    layer.save_own_variables = lambda store: (_ for _ in ()).throw(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        kre.save_model(model, path)
    np.testing.assert_array_equal(keras.saving.load_model(path).predict(X, verbose=0), expect)
    assert [p for p in os.listdir(tmp_path)] == ["m.keras"]  # no temporary left behind
    with pytest.raises(ValueError, match=r"\.keras.*filepath='m.h5'"):
        kre.save_model(model, "m.h5")


def test_weights_round_trip_and_get_weights(tmp_path):
    model = make_model()
    model.fit(X, Y, batch_size=16, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    np.testing.assert_array_equal(fresh.predict(X, verbose=0), model.predict(X, verbose=0))
    assert int(fresh.optimizer.iterations) == int(model.optimizer.iterations)
    assert_tables_equal(tables(fresh), tables(model))
    weights = model.get_layer("ev").get_weights()
    assert weights[0].shape == (len(np.unique(X)), 8)


def test_load_model_names_the_file_and_what_is_wrong(tmp_path):
    # Keras says "File not found" for all three cases.
    missing = tmp_path / "missing.keras"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        kre.load_model(missing)
    not_zip = tmp_path / "notzip.keras"
    not_zip.write_bytes(b"this is not a zip archive")
    with pytest.raises(ValueError, match=re.escape(str(not_zip)) + ".*not a zip archive"):
        kre.load_model(not_zip)
    inp = keras.Input((2,), dtype="int64")
    model = keras.Model(inp, keras.layers.Flatten()(EmbeddingVariable(3, name="ev")(inp)))
    good = tmp_path / "good.keras"
    kre.save_model(model, good)
    truncated = tmp_path / "truncated.keras"
    truncated.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(ValueError, match=re.escape(str(truncated)) + ".*(corrupt|not a zip)"):
        kre.load_model(truncated)
    back = kre.load_model(good)
    x = np.array([[1, 2]])
    np.testing.assert_array_equal(back(x).numpy(), model(x).numpy())


def test_loaded_export_keeps_every_table_its_own(tmp_path):
    """Regression: loading a SavedModel rewrites every op's `shared_name`
    attr (empty ones too) to '<node name>_load_<uid>'; TableCreate's name
    for parameter-server tables must not be that attr, or every table of a
    loaded model (same node name in each creator function) becomes one."""
    ids = keras.Input((2,), dtype="int64", name="ids")
    a = EmbeddingVariable(4, combiner="sum", name="ev_a")(ids)
    b = EmbeddingVariable(4, combiner="sum", name="ev_b",
                          initializer=keras.initializers.RandomNormal(seed=5))(ids)
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="mse")
    model.fit(X[:, :2], Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    expect = model.predict(X[:8, :2], verbose=0)
    export_dir = str(tmp_path / "served")
    model.export(export_dir, verbose=False)
    first = tf.saved_model.load(export_dir)
    second = tf.saved_model.load(export_dir)  # a second load has its own tables too
    for loaded in (first, second):
        np.testing.assert_allclose(loaded.serve(tf.constant(X[:8, :2])).numpy(), expect,
                                   rtol=1e-5, atol=1e-6)
