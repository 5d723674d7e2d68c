"""Incremental checkpoint chains under faults: fallbacks, foreign and broken
links, mismatched models; restores are all-or-nothing (keras_rec_emb/incremental.py).
Under both backends but `apply_to_saved_model` (a TensorFlow SavedModel's)."""

import os
import shutil

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb import incremental
from keras_rec_emb.layers import EmbeddingVariable

both = pytest.mark.backends("tensorflow", "jax")

DIM = 4


def make_model(seed=0, dim=DIM, dense_units=1, filter_freq=0, second_table=False,
               optimizer=None):
    if keras.config.backend() == "jax":
        np.random.seed(seed)  # (keras.utils.set_random_seed would import TensorFlow)
    else:
        keras.utils.set_random_seed(seed)
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(dim, combiner="mean", name="ev", ev_option=kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(filter_freq) if filter_freq else None))
    h = ev(ids)
    if second_table:
        h = keras.layers.Concatenate()([h, EmbeddingVariable(2, combiner="sum", name="ev2")(ids)])
    out = keras.layers.Dense(dense_units, name="out")(h)
    model = keras.Model(ids, out)
    model.compile(optimizer=optimizer or kre.optimizers.Adagrad(0.1), loss="mse")
    model.build((None, 3))
    return model


def train(model, rng, lo=0, hi=60, steps=1):
    for _ in range(steps):
        x = rng.integers(lo, hi, size=(8, 3))
        model.train_on_batch(x, rng.normal(size=(8, model.output_shape[-1])))


def state(model):
    """Every table row (sorted by key), every dense and optimizer variable
    (under JAX the tables' layers' too: anchor, step counter)."""
    out = {}
    for path, table in incremental._tables(model):
        d = table.export()
        order = np.argsort(d["keys"])
        out[path + ":keys"] = d["keys"][order]
        out[path + ":values"] = d["values"][order]
        out[path + ":freqs"] = d["freqs"][order]
        out[path + ":versions"] = d["versions"][order]
        for s in sorted(d["slots"]):
            out[f"{path}:slot:{s}"] = d["slots"][s][order]
        out[path + ":filtered"] = np.sort(d["keys_filtered"])
    for v in model.variables:
        if not hasattr(v, "table"):
            out[v.path] = np.array(v)
    for i, v in enumerate(model.optimizer.variables):
        if not hasattr(v, "table"):
            out[f"opt{i}"] = np.array(v)
    return out


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def corrupt(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 64)


def fresh(seed=7, **kwargs):
    model = make_model(seed=seed, **kwargs)
    return model, state(model)


# -- item 4: a fallback restore continues the older chain --------------------

@both
def test_links_saved_after_a_fallback_restore_are_restored_next_time(tmp_path):
    rng = np.random.default_rng(0)
    model = make_model()
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    train(model, rng)
    ckpt.save_full()                       # step 1
    train(model, rng)
    ckpt.save_incremental()                # step 2
    train(model, rng)
    newer = ckpt.save_full()               # step 3, then corrupted
    corrupt(newer)

    resumed = make_model(seed=1)
    chain = kre.IncrementalCheckpointer(resumed, tmp_path)
    with pytest.warns(UserWarning, match=os.path.basename(newer)):
        assert chain.restore()["step"] == 2   # the older chain (warned)
    for _ in range(5):                     # steps 3..7 continue that chain
        train(resumed, rng, 50, 120)
        assert chain.save_incremental().endswith("-incremental.npz")
    expect = state(resumed)

    again = make_model(seed=2)
    with pytest.warns(UserWarning, match=os.path.basename(newer)):
        info = kre.IncrementalCheckpointer(again, tmp_path).restore()
    assert info["step"] == 7 and len(info["links"]) == 7
    assert newer in info["skipped"]
    assert_same(state(again), expect)


# -- item 5: links prove they belong to their chain ---------------------------

def _other_run(directory, links=3):
    """Another run with the same layer names writing its own chain."""
    rng = np.random.default_rng(99)
    other = make_model(seed=5)
    ckpt = kre.IncrementalCheckpointer(other, directory)
    train(other, rng, 500, 600)
    paths = [ckpt.save_full()]
    for _ in range(links - 1):
        train(other, rng, 500, 600)
        paths.append(ckpt.save_incremental())
    return paths


def _our_run(directory, links=2):
    rng = np.random.default_rng(1)
    model = make_model()
    ckpt = kre.IncrementalCheckpointer(model, directory)
    train(model, rng)
    paths = [ckpt.save_full()]
    states = [state(model)]
    for _ in range(links - 1):
        train(model, rng)
        paths.append(ckpt.save_incremental())
        states.append(state(model))
    return paths, states


@both
def test_a_link_of_another_run_copied_into_the_folder_is_skipped_with_a_warning(tmp_path):
    ours, states = _our_run(tmp_path / "ours", links=2)
    theirs = _other_run(tmp_path / "theirs", links=3)
    # Their third link has the file name our third would have, and names our
    # files as its base and parent (same numbering): only its chain differs.
    foreign = str(tmp_path / "ours" / os.path.basename(theirs[2]))
    shutil.copy(theirs[2], foreign)
    model, _ = fresh()
    with pytest.warns(UserWarning, match=rf"{os.path.basename(foreign)}.*another chain"):
        info = kre.IncrementalCheckpointer(model, tmp_path / "ours").restore()
    assert info["links"] == ours and foreign in info["skipped"]
    assert_same(state(model), states[-1])


@both
def test_a_link_replaced_in_the_middle_of_the_chain_refuses_the_restore(tmp_path):
    ours, states = _our_run(tmp_path / "ours", links=3)
    theirs = _other_run(tmp_path / "theirs", links=3)
    shutil.copy(theirs[1], ours[1])       # same name, another run's rows
    model, before = fresh()
    with pytest.raises(ValueError, match=os.path.basename(ours[1])) as info:
        kre.IncrementalCheckpointer(model, tmp_path / "ours").restore()
    assert os.path.basename(ours[2]) in str(info.value) and "partial=True" in str(info.value)
    assert_same(state(model), before)     # nothing applied
    # Asked for, the restore stops at the last good link (warned).
    with pytest.warns(UserWarning, match=os.path.basename(ours[1])):
        info = kre.IncrementalCheckpointer(model, tmp_path / "ours").restore(partial=True)
    assert info["links"] == ours[:1]
    assert_same(state(model), states[0])


# -- restores are all-or-nothing -------------------------------------------------

def _chain(directory, **kwargs):
    """A full checkpoint and one incremental link of a trained model."""
    rng = np.random.default_rng(3)
    model = make_model(**kwargs)
    ckpt = kre.IncrementalCheckpointer(model, directory)
    train(model, rng, 0, 40)
    ckpt.save_full()
    train(model, rng, 30, 80)
    ckpt.save_incremental()
    return state(model)


def _live(seed=9, **kwargs):
    """A trained model (rows in every table) to restore over."""
    model = make_model(seed=seed, **kwargs)
    train(model, np.random.default_rng(seed), 200, 260, steps=2)
    return model, state(model)


@both
def test_a_restore_that_cannot_read_its_checkpoint_changes_nothing(tmp_path):
    _chain(tmp_path)
    corrupt(os.path.join(tmp_path, "ckpt-00000000-full.npz"))
    model, before = _live()
    with pytest.warns(UserWarning, match="Skipping full checkpoint"):
        with pytest.raises(ValueError, match="No intact full checkpoint"):
            kre.IncrementalCheckpointer(model, tmp_path).restore()
    assert_same(state(model), before)


@both
@pytest.mark.parametrize("other, message", [
    ({"dense_units": 2},
     r"out/kernel has shape \[4, 2\] in the model but \[4, 1\] in the checkpoint"),
    # Another width: the table and both widths named.
    ({"dim": 8}, r"rows of dim 4 for table 'ev/embeddings', which has dim 8"),
], ids=["dense_shape", "table_width"])
def test_a_restore_into_other_shapes_raises_before_touching_the_model(tmp_path, other,
                                                                      message):
    _chain(tmp_path)
    model, before = _live(**other)
    with pytest.raises(ValueError, match=message):
        kre.IncrementalCheckpointer(model, tmp_path).restore()
    assert_same(state(model), before)


@both
def test_a_restore_into_other_tables_says_which_tables_differ(tmp_path):
    _chain(tmp_path)
    model, before = _live(second_table=True)
    with pytest.raises(ValueError, match="does not fit this model") as info:
        kre.IncrementalCheckpointer(model, tmp_path).restore()
    message = str(info.value)
    assert "unreadable" not in message
    assert "not in the checkpoint: ['ev2/embeddings']" in message, message
    assert_same(state(model), before)


@both
@pytest.mark.parametrize("stage", ["full import", "second table's link", "dense", "optimizer"])
def test_a_restore_failing_while_applying_puts_the_model_back(tmp_path, monkeypatch, stage):
    """Out of memory (or disk) at each step of applying: the tables, dense
    and optimizer variables are as before the restore."""
    saved = _chain(tmp_path, second_table=True)
    model, before = _live(second_table=True)
    calls = []

    def fail_once(original):
        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise MemoryError(f"injected at {stage}")
            return original(*args, **kwargs)
        return wrapper

    table_cls = type(dict(incremental._tables(model))["ev/embeddings"])
    if stage == "full import":
        monkeypatch.setattr(table_cls, "import_", fail_once(table_cls.import_))
    elif stage == "second table's link":
        original = table_cls.apply_changes
        seen = []

        def apply_changes(self, delta):
            seen.append(self)
            if len(seen) == 2:
                raise MemoryError("injected in the second table's link")
            return original(self, delta)
        monkeypatch.setattr(table_cls, "apply_changes", apply_changes)
    else:
        v = (model.get_layer("out").bias if stage == "dense"
             else model.optimizer.iterations)
        monkeypatch.setattr(v, "assign", fail_once(v.assign))
    with pytest.raises(MemoryError, match="injected") as info:
        kre.IncrementalCheckpointer(model, tmp_path).restore()
    assert any("put back as it was" in note for note in info.value.__notes__)
    monkeypatch.undo()
    assert_same(state(model), before)
    # And the same restore, without the fault, gives the saved state.
    kre.IncrementalCheckpointer(model, tmp_path).restore()
    assert_same(state(model), saved)


# -- apply_to_saved_model -----------------------------------------------------------

def _served_chain(tmp_path, links=3):
    import tensorflow as tf

    rng = np.random.default_rng(4)
    model = make_model()
    train(model, rng, 0, 40)
    ckpt = kre.IncrementalCheckpointer(model, tmp_path / "chain")
    ckpt.save_full()
    model.export(str(tmp_path / "served"), verbose=False)
    paths = []
    for i in range(links):
        train(model, rng, 30 + 20 * i, 60 + 20 * i)
        paths.append(ckpt.save_incremental())
    return model, paths, lambda: tf.saved_model.load(str(tmp_path / "served"))


def _serves_like(served, model):
    import tensorflow as tf

    x = np.random.default_rng(5).integers(0, 120, (32, 3))
    np.testing.assert_allclose(served.serve(tf.constant(x)).numpy(),
                               model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.tensorflow_only
def test_apply_to_saved_model_names_a_path_or_none_given_as_the_model(tmp_path):
    _, paths, _ = _served_chain(tmp_path, links=1)
    for bad in (str(tmp_path / "served"), None):
        with pytest.raises(TypeError, match=r"`loaded` must be .*tf.saved_model.load"):
            kre.apply_to_saved_model(bad, paths[0])
    with pytest.raises(TypeError, match=r"IncrementalCheckpointer\(model, directory\)"):
        kre.apply_to_saved_model(make_model(), paths[0])


@pytest.mark.tensorflow_only
def test_apply_to_saved_model_refuses_links_out_of_order_and_orders_a_list(tmp_path):
    model, paths, load = _served_chain(tmp_path, links=3)
    served = load()
    kre.apply_to_saved_model(served, paths[0])
    before = served.serve(np.zeros((1, 3), np.int64)).numpy()
    with pytest.raises(ValueError, match=rf"{os.path.basename(paths[2])} does not follow "
                                         rf"the last link this model took, "
                                         rf"{os.path.basename(paths[0])}"):
        kre.apply_to_saved_model(served, paths[2])      # skips paths[1]
    with pytest.raises(ValueError, match="does not follow"):
        kre.apply_to_saved_model(served, paths[0])      # again
    np.testing.assert_array_equal(served.serve(np.zeros((1, 3), np.int64)).numpy(), before)
    stats = kre.apply_to_saved_model(served, paths[1:])
    assert stats["links"] == paths[1:]
    _serves_like(served, model)
    # A list in any order is applied in chain order.
    fresh_server = load()
    assert kre.apply_to_saved_model(fresh_server, paths[::-1])["links"] == paths
    _serves_like(fresh_server, model)
