"""Incremental checkpoints: keras_rec_emb/incremental.py and the kv change tracking."""

import os

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

DIM = 4


def make_model(filter_freq=2, steps_to_live=None, seed=0):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(DIM, combiner="mean", name="ev", ev_option=kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(filter_freq) if filter_freq else None,
        evict_option=kre.GlobalStepEvict(steps_to_live) if steps_to_live else None))
    out = keras.layers.Dense(1, name="out")(ev(ids))
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model, ev


def train(model, batches, rng):
    for lo, hi in batches:
        x = rng.integers(lo, hi, size=(8, 3))
        model.train_on_batch(x, rng.normal(size=(8, 1)))


def table_state(ev):
    """Row-for-row state of a table as sortable dicts."""
    d = ev.table.export()
    order = np.argsort(d["keys"])
    rows = {k: np.concatenate([d["values"][order]] + [d["slots"][s][order]
                                                    for s in sorted(d["slots"])], 1)
            for k in ("rows",)}
    fo = np.argsort(d["keys_filtered"])
    return {"keys": d["keys"][order], "rows": rows["rows"], "freqs": d["freqs"][order],
            "versions": d["versions"][order], "keys_f": d["keys_filtered"][fo],
            "freqs_f": d["freqs_filtered"][fo], "versions_f": d["versions_filtered"][fo]}


def assert_same_state(a, b):
    sa, sb = table_state(a["ev"]), table_state(b["ev"])
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    for va, vb in zip(a["model"].variables, b["model"].variables):
        if not hasattr(va, "table"):
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
    for va, vb in zip(a["model"].optimizer.variables, b["model"].optimizer.variables):
        if not hasattr(va, "table"):
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))


def test_restore_full_plus_chain_equals_state_row_for_row(tmp_path):
    rng = np.random.default_rng(0)
    model, ev = make_model(filter_freq=2, steps_to_live=3)
    train(model, [(0, 50)] * 3, rng)
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    full = ckpt.save_full()
    full_bytes = os.path.getsize(full)
    sizes, erased_seen = [], 0
    for step in range(6):
        train(model, [(40 + 10 * step, 60 + 10 * step)], rng)  # new ids, some filtered
        erased_seen += ev.evict()  # stale ids go (logged)
        if step == 3:  # an id evicted between saves comes back
            gone = int(ev.table.export()["keys"][0])
            assert ev.table.erase([gone]) == 1
            model.train_on_batch(np.full((8, 3), gone), np.ones((8, 1)))
            model.train_on_batch(np.full((8, 3), gone), np.ones((8, 1)))
        sizes.append(os.path.getsize(ckpt.save_incremental()))
    assert erased_seen > 0
    assert ev.table.stats()["filtered"] > 0  # filtered keys are part of the state
    assert max(sizes) < full_bytes
    restored, rev = make_model(filter_freq=2, steps_to_live=3, seed=1)
    restored.build((None, 3))
    info = kre.IncrementalCheckpointer(restored, tmp_path).restore()
    assert len(info["links"]) == 7 and info["skipped"] == []
    assert info["step"] == int(model.optimizer.iterations)
    assert_same_state({"model": model, "ev": ev}, {"model": restored, "ev": rev})
    x = rng.integers(0, 120, size=(16, 3))
    np.testing.assert_array_equal(model.predict(x, verbose=0), restored.predict(x, verbose=0))


def test_delta_holds_only_changed_rows(tmp_path):
    rng = np.random.default_rng(1)
    model, ev = make_model(filter_freq=0)
    train(model, [(0, 1000)] * 20, rng)
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    ckpt.save_full()
    model.train_on_batch(np.array([[1, 2, 3]] * 2), np.ones((2, 1)))
    path = ckpt.save_incremental()
    with np.load(path) as z:
        assert sorted(z["t0/keys"].tolist()) == [1, 2, 3]
        assert z["t0/erased"].size == 0
        assert z["t0/slot/accumulator"].shape[0] == 3 or any(
            k.startswith("t0/slot/") for k in z.files)


def test_corrupt_or_missing_link_refuses_or_restores_up_to_last_good_one(tmp_path):
    rng = np.random.default_rng(2)
    model, ev = make_model(filter_freq=0)
    train(model, [(0, 30)], rng)
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    links = [ckpt.save_full()]
    states = [table_state(ev)]
    for i in range(3):
        train(model, [(30 * (i + 1), 30 * (i + 2))], rng)
        links.append(ckpt.save_incremental())
        states.append(table_state(ev))

    def check(got_ev, i):
        got = table_state(got_ev)
        for k in got:
            np.testing.assert_array_equal(got[k], states[i][k])

    # The newest link corrupt: nothing after it is lost, so the restore stops
    # before it with a warning.
    saved_last = open(links[3], "rb").read()
    with open(links[3], "r+b") as f:
        f.seek(os.path.getsize(links[3]) // 2)
        f.write(b"\x00" * 64)
    restored, rev = make_model(filter_freq=0, seed=3)
    restored.build((None, 3))
    with pytest.warns(UserWarning, match=os.path.basename(links[3])):
        info = kre.IncrementalCheckpointer(restored, tmp_path).restore()
    assert info["links"] == links[:3] and info["skipped"] == [links[3]]
    check(rev, 2)
    with open(links[3], "wb") as f:
        f.write(saved_last)
    # Link 2 corrupt while link 3 follows it: the chain is broken in the
    # middle; the restore refuses (naming both) and changes nothing ...
    with open(links[2], "r+b") as f:
        f.seek(os.path.getsize(links[2]) // 2)
        f.write(b"\x00" * 64)
    restored, rev = make_model(filter_freq=0, seed=3)
    restored.build((None, 3))
    r = kre.IncrementalCheckpointer(restored, tmp_path)
    with pytest.raises(ValueError, match=os.path.basename(links[2])) as error:
        r.restore()
    assert os.path.basename(links[3]) in str(error.value)
    assert rev.table_size() == 0
    # ... unless asked to stop at the last good link (warned).
    with pytest.warns(UserWarning, match=os.path.basename(links[2])):
        info = r.restore(partial=True)
    assert info["links"] == links[:2]
    assert sorted(info["skipped"]) == sorted(links[2:])
    check(rev, 1)
    # After a shortened chain the next save starts a new full checkpoint.
    assert r.save_incremental().endswith("-full.npz")
    # A missing link in the middle: refused, naming it.
    os.remove(links[2])
    os.remove(links[1])
    for p in os.listdir(tmp_path):
        if p.endswith("-full.npz") and os.path.join(tmp_path, p) != links[0]:
            os.remove(os.path.join(tmp_path, p))
    again, aev = make_model(filter_freq=0, seed=4)
    again.build((None, 3))
    with pytest.raises(ValueError, match=rf"{os.path.basename(links[2])}: it is missing"):
        kre.IncrementalCheckpointer(again, tmp_path).restore()
    with pytest.warns(UserWarning, match="it is missing"):
        info = kre.IncrementalCheckpointer(again, tmp_path).restore(partial=True)
    assert info["links"] == links[:1]
    check(aev, 0)


def test_atomic_save_leaves_no_partial_file(tmp_path, monkeypatch):
    model, _ = make_model(filter_freq=0)
    model.train_on_batch(np.array([[1, 2, 3]]), np.ones((1, 1)))
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    first = ckpt.save_full()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_incremental()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [os.path.basename(first)]


def test_keep_prunes_old_chains(tmp_path):
    model, _ = make_model(filter_freq=0)
    model.train_on_batch(np.array([[1, 2, 3]]), np.ones((1, 1)))
    ckpt = kre.IncrementalCheckpointer(model, tmp_path, keep=1)
    ckpt.save_full()
    ckpt.save_incremental()
    last = ckpt.save_full()
    assert os.listdir(tmp_path) == [os.path.basename(last)]


def test_bad_arguments():
    model, _ = make_model(filter_freq=0)
    with pytest.raises(ValueError, match="keep=0"):
        kre.IncrementalCheckpointer(model, "/tmp/x", keep=0)
    with pytest.raises(TypeError, match="model="):
        kre.IncrementalCheckpointer("model", "/tmp/x")
    with pytest.raises(TypeError, match="kafka_position="):
        kre.IncrementalCheckpointer(model, "/tmp/x", kafka_position=3)
    with pytest.raises(ValueError, match="erased"):
        model.build((None, 3))
        model.get_layer("ev").table.apply_changes({"keys": []})
