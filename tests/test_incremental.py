"""Incremental checkpoints: keras_rec_emb/incremental.py and the kv change tracking."""

import os

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

pytestmark = pytest.mark.tensorflow_only  # tf.train.Checkpoint's incremental checkpoints

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


class TwoHeads(keras.Model):
    """Two same-shaped dense layers: the order in which they are made sets
    the order of the model's (and its optimizer's) variables, not their
    paths, so a restore by position would swap them."""

    def __init__(self, swap=False):
        super().__init__(name="heads")
        self.ev = EmbeddingVariable(DIM, combiner="mean", name="ev")
        first, second = ("b", "a") if swap else ("a", "b")
        setattr(self, first, keras.layers.Dense(2, name=first))
        setattr(self, second, keras.layers.Dense(2, name=second))

    def call(self, ids):
        h = self.ev(ids)
        return self.a(h) - 2.0 * self.b(h)


def two_heads(swap=False, optimizer=None, seed=0):
    keras.utils.set_random_seed(seed)
    model = TwoHeads(swap)
    model.compile(optimizer=optimizer or kre.optimizers.Adagrad(0.1), loss="mse")
    model(np.zeros((1, 3), np.int64))
    model.optimizer.build(model.trainable_variables)
    return model


def variables_by_path(model):
    """{path: value} of every dense variable and, keyed past the
    optimizer's own name, every optimizer variable."""
    out = {v.path: np.array(v) for v in model.variables if not hasattr(v, "table")}
    for v in model.optimizer.variables:
        if not hasattr(v, "table"):
            out["optimizer:" + v.path.split("/", 1)[1]] = np.array(v)
    return out


def trained_chain(tmp_path, optimizer=None):
    model = two_heads(optimizer=optimizer)
    rng = np.random.default_rng(6)
    for _ in range(3):
        model.train_on_batch(rng.integers(0, 40, (8, 3)), rng.normal(size=(8, 2)))
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    ckpt.save_full()
    model.train_on_batch(rng.integers(30, 60, (8, 3)), rng.normal(size=(8, 2)))
    ckpt.save_incremental()
    return model


@pytest.mark.parametrize("wrapped", [False, True], ids=["adagrad", "loss_scale_adagrad"])
def test_dense_and_optimizer_variables_restore_by_path_not_position(tmp_path, wrapped):
    """A model whose layers were made in the other order (so its variables
    and its optimizer's are listed in the other order, under another
    optimizer name) gets each saved value at its own path."""
    def optimizer():
        inner = kre.optimizers.Adagrad(0.1)
        return kre.optimizers.LossScaleOptimizer(inner) if wrapped else inner

    model = trained_chain(tmp_path, optimizer())
    restored = two_heads(swap=True, optimizer=optimizer(), seed=9)
    assert [v.path for v in restored.variables if not hasattr(v, "table")] != [
        v.path for v in model.variables if not hasattr(v, "table")]
    assert restored.optimizer.name != model.optimizer.name
    kre.IncrementalCheckpointer(restored, tmp_path).restore()
    want, got = variables_by_path(model), variables_by_path(restored)
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    sa, sb = table_state(model.ev), table_state(restored.ev)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    x = np.random.default_rng(7).integers(0, 60, (16, 3))
    np.testing.assert_array_equal(model.predict(x, verbose=0), restored.predict(x, verbose=0))


def test_a_model_without_an_optimizer_restores_its_tables_and_dense_variables(tmp_path):
    """An uncompiled model (to evaluate or serve) has no optimizer state to
    take: the rest is restored."""
    model = trained_chain(tmp_path)
    keras.utils.set_random_seed(8)
    plain = TwoHeads(swap=True)
    plain(np.zeros((1, 3), np.int64))
    assert getattr(plain, "optimizer", None) is None
    kre.IncrementalCheckpointer(plain, tmp_path).restore()
    want = {v.path: np.array(v) for v in model.variables if not hasattr(v, "table")}
    got = {v.path: np.array(v) for v in plain.variables if not hasattr(v, "table")}
    assert sorted(got) == sorted(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    x = np.random.default_rng(8).integers(0, 60, (16, 3))
    np.testing.assert_array_equal(model.predict(x, verbose=0), plain.predict(x, verbose=0))


def snapshot(model):
    out = variables_by_path(model)
    d = model.ev.table.export()
    out.update({f"ev:{k}": d[k] for k in ("keys", "values", "freqs")})
    out.update({f"ev:slot:{k}": v for k, v in d["slots"].items()})
    return out


def assert_unchanged(before, model):
    after = snapshot(model)
    assert sorted(after) == sorted(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_a_restore_into_other_optimizer_variables_names_them_and_changes_nothing(tmp_path):
    trained_chain(tmp_path)
    other = two_heads(optimizer=kre.optimizers.Adam(0.1), seed=3)
    other.train_on_batch(np.array([[1, 2, 3]]), np.ones((1, 2)))
    before = snapshot(other)
    with pytest.raises(ValueError, match="optimizer variables") as info:
        kre.IncrementalCheckpointer(other, tmp_path).restore()
    message = str(info.value)
    assert ("in the checkpoint only: ['heads_a_bias_accumulator', "
            "'heads_a_kernel_accumulator', 'heads_b_bias_accumulator', "
            "'heads_b_kernel_accumulator']; in the model only: ['heads_a_bias_momentum'"
            ) in message, message
    assert "'heads_b_kernel_velocity']" in message, message
    assert_unchanged(before, other)


def test_a_restore_into_other_dense_variables_names_them_and_changes_nothing(tmp_path):
    trained_chain(tmp_path)

    class Renamed(TwoHeads):
        def __init__(self):
            keras.Model.__init__(self, name="heads")
            self.ev = EmbeddingVariable(DIM, combiner="mean", name="ev")
            self.a = keras.layers.Dense(2, name="a")
            self.b = keras.layers.Dense(2, name="c")

    keras.utils.set_random_seed(4)
    other = Renamed()
    other.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    other.train_on_batch(np.array([[1, 2, 3]]), np.ones((1, 2)))
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"dense variables are not the model's \(in the "
                                         r"checkpoint only: \['heads/b/bias', 'heads/b/kernel'\]; "
                                         r"in the model only: \['heads/c/bias', "
                                         r"'heads/c/kernel'\]\)"):
        kre.IncrementalCheckpointer(other, tmp_path).restore()
    assert_unchanged(before, other)


def test_a_first_format_link_restores_by_the_paths_it_lists(tmp_path):
    """Links have always listed their variables' paths: a full checkpoint
    of the first format (no chain id) restores by them too."""
    import json

    model = two_heads()
    model.train_on_batch(np.array([[1, 2, 3], [4, 5, 6]]), np.ones((2, 2)))
    path = kre.IncrementalCheckpointer(model, tmp_path).save_full()
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["__meta__"].tobytes())
    assert meta["format"] == "keras_rec_emb.checkpoint/2"
    meta["format"] = "keras_rec_emb.checkpoint/1"
    for k in ("chain", "parent_digest", "run"):
        meta.pop(k)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **arrays)
    with np.load(path) as z:
        assert json.loads(z["__meta__"].tobytes())["format"] == "keras_rec_emb.checkpoint/1"
    restored = two_heads(swap=True, seed=5)
    info = kre.IncrementalCheckpointer(restored, tmp_path).restore()
    assert info["links"] == [path]
    want, got = variables_by_path(model), variables_by_path(restored)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_model_with_two_variables_of_one_path_is_refused_at_save(tmp_path):
    class Twins(keras.layers.Layer):
        def build(self, input_shape):
            self.one = self.add_weight(shape=(2,), name="w")
            self.two = self.add_weight(shape=(2,), name="w")

        def call(self, x):
            return x[:, :2] * self.one + self.two

    ids = keras.Input((3,), dtype="int64")
    h = EmbeddingVariable(DIM, combiner="mean", name="ev")(ids)
    model = keras.Model(ids, Twins(name="twins")(h))
    with pytest.raises(ValueError, match=r"dense variable paths \['twins/w'\] name more than "
                                         "one variable"):
        kre.IncrementalCheckpointer(model, tmp_path).save_full()
    assert os.listdir(tmp_path) == []
