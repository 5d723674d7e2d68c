"""Incremental checkpoints under Keras's JAX backend: a `CheckpointCallback`
chain (a full checkpoint and incremental links) written during `fit`
restores into a fresh model exactly (rows, slots, frequencies, versions,
keys counted by a filter, the layers' step counters, dense and optimizer
variables); keys evicted between links are gone after the restore; a
corrupt link is named; `apply_to_saved_model` names the JAX alternative;
TensorFlow stays unimported. (Chain faults: tests/test_chain_faults.py,
under both backends; chains across backends:
test_cross_backend_incremental.py.)"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

DIM = 4


def make_model(steps_to_live=None):
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(DIM, combiner="mean", name="ev", ev_option=kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(2),
        evict_option=kre.GlobalStepEvict(steps_to_live) if steps_to_live else None))
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.build((None, 3))
    return model, ev


def state(model, ev):
    d = ev.export()
    order, fo = np.argsort(d["keys"]), np.argsort(d["keys_filtered"])
    out = {k: d[k][order] for k in ("keys", "values", "freqs", "versions")}
    out.update({f"slot:{s}": d["slots"][s][order] for s in d["slots"]})
    out.update({k: d[k][fo] for k in ("keys_filtered", "freqs_filtered",
                                      "versions_filtered")})
    out["default_values"] = d["default_values"]
    out.update({v.path: np.asarray(v) for v in model.variables})  # iterations included
    out.update({f"opt:{v.path.split('/', 1)[1]}": np.asarray(v)
                for v in model.optimizer.variables})
    return out


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _fit(model, callbacks, steps=4, lo=0, hi=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(lo, hi, size=(8 * steps, 3))
    model.fit(x, rng.normal(size=(8 * steps, 1)), batch_size=8, shuffle=False, verbose=0,
              callbacks=callbacks)


def test_a_fit_chain_restores_into_a_fresh_model_exactly(tmp_path):
    model, ev = make_model()
    cb = kre.callbacks.CheckpointCallback(tmp_path, full_every_steps=100,
                                          incremental_every_steps=1, save_on_train_end=False)
    _fit(model, [cb], steps=4)
    assert [os.path.basename(p).split("-")[-1] for p in cb.saves] == [
        "full.npz", "incremental.npz", "incremental.npz", "incremental.npz"]
    assert ev.stats()["filtered"] > 0  # keys counted, not admitted: part of the state
    want = state(model, ev)
    assert int(want["ev/iterations"]) == 4
    # The links hold only what changed: the last one fewer rows than the table.
    with np.load(cb.saves[-1]) as last:
        assert 0 < last["t0/keys"].size < want["keys"].size

    fresh, fresh_ev = make_model()
    info = kre.callbacks.CheckpointCallback(tmp_path).restore(fresh)
    assert info["links"] == cb.saves and info["step"] == 4 and info["skipped"] == []
    assert_same(state(fresh, fresh_ev), want)
    # Training on continues the chain: a later restore reaches its new link.
    again = kre.IncrementalCheckpointer(fresh, tmp_path)
    again.restore()
    _fit(fresh, [], steps=1, lo=30, hi=70, seed=1)
    link = again.save_incremental()
    assert link.endswith("-incremental.npz")
    third, third_ev = make_model()
    assert kre.IncrementalCheckpointer(third, tmp_path).restore()["links"][-1] == link
    assert_same(state(third, third_ev), state(fresh, fresh_ev))


def test_keys_evicted_between_links_are_erased_by_the_restore(tmp_path):
    model, ev = make_model(steps_to_live=1)
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    _fit(model, [], steps=2, lo=0, hi=20)
    ckpt.save_full()
    old = set(ev.export()["keys"].tolist())
    _fit(model, [], steps=3, lo=100, hi=120, seed=2)
    assert ev.evict() > 0
    link = ckpt.save_incremental()
    with np.load(link) as z:
        erased = set(z["t0/erased"].tolist())
    kept = set(ev.export()["keys"].tolist())
    # Every admitted key gone since the full checkpoint is logged as erased
    # (with keys counted but not admitted that went stale).
    assert old - kept and old - kept <= erased and not erased & kept
    fresh, fresh_ev = make_model(steps_to_live=1)
    kre.IncrementalCheckpointer(fresh, tmp_path).restore()
    assert set(fresh_ev.export()["keys"].tolist()) == kept
    assert_same(state(fresh, fresh_ev), state(model, ev))


def test_a_corrupt_link_in_the_middle_is_named_and_changes_nothing(tmp_path):
    model, ev = make_model()
    ckpt = kre.IncrementalCheckpointer(model, tmp_path)
    paths = []
    for step in range(3):
        _fit(model, [], steps=1, seed=step)
        paths.append(ckpt.save_full() if step == 0 else ckpt.save_incremental())
    with open(paths[1], "r+b") as f:
        f.seek(os.path.getsize(paths[1]) // 2)
        f.write(b"\xff" * 64)
    fresh, fresh_ev = make_model()
    _fit(fresh, [], steps=1, lo=500, hi=540)
    before = state(fresh, fresh_ev)
    with pytest.raises(ValueError, match=os.path.basename(paths[1])):
        kre.IncrementalCheckpointer(fresh, tmp_path).restore()
    assert_same(state(fresh, fresh_ev), before)
    with pytest.warns(UserWarning, match=os.path.basename(paths[1])):
        info = kre.IncrementalCheckpointer(fresh, tmp_path).restore(partial=True)
    assert info["links"] == paths[:1]


def test_apply_to_saved_model_names_the_jax_alternative(tmp_path):
    with pytest.raises(NotImplementedError, match=r"TensorFlow backend.*export_for_serving"):
        kre.apply_to_saved_model(object(), tmp_path / "ckpt-00000000-full.npz")
    assert "apply_to_saved_model" in dir(kre) and "IncrementalCheckpointer" in dir(kre)


def test_the_docstring_example_runs():
    import doctest

    test = doctest.DocTestFinder().find(kre.IncrementalCheckpointer, "IncrementalCheckpointer",
                                        globs={"keras": keras, "np": np,
                                               "keras_rec_emb": kre})[0]
    assert doctest.DocTestRunner().run(test, out=lambda text: None).failed == 0


def test_checkpoints_do_not_import_tensorflow(tmp_path):
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import numpy as np, keras, keras_rec_emb as kre
ids = keras.Input((2,), dtype="int64")
model = keras.Model(ids, keras.layers.Dense(1)(kre.layers.EmbeddingVariable(4, combiner="sum")(ids)))
model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
cb = kre.callbacks.CheckpointCallback({str(tmp_path)!r}, incremental_every_steps=1)
model.fit(np.arange(8).reshape(4, 2), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=[cb])
assert kre.IncrementalCheckpointer(model, {str(tmp_path)!r}).restore()["step"] == 2
assert "tensorflow" not in sys.modules
"""
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
