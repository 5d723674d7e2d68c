"""Incremental checkpoint chains under faults: fallbacks, foreign and broken
links, mismatched models; restores are all-or-nothing (keras_rec_emb/incremental.py)."""

import os
import shutil
import warnings

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

DIM = 4


def make_model(seed=0, dim=DIM, dense_units=1, filter_freq=0, second_table=False,
               optimizer=None):
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
    """Every table row (sorted by key), every dense and optimizer variable."""
    out = {}
    for v in model.variables:
        if hasattr(v, "table"):
            d = v.table.export()
            order = np.argsort(d["keys"])
            out[v.path + ":keys"] = d["keys"][order]
            out[v.path + ":values"] = d["values"][order]
            out[v.path + ":freqs"] = d["freqs"][order]
            for s in sorted(d["slots"]):
                out[f"{v.path}:slot:{s}"] = d["slots"][s][order]
            out[v.path + ":filtered"] = np.sort(d["keys_filtered"])
        else:
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
