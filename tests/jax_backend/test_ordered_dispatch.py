"""`backend/jax/dispatch.OrderedJit`, the dispatch of jitted functions
holding table calls (and so Keras's JAX steps): the same results, table
effects and order as `jax.jit`'s dispatch, the executable run without it
from the second call of a signature, and `jax.jit` itself for everything
it does not take."""

import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb import _keras_fixes
from keras_rec_emb.backend.jax import _jax_private, dispatch, ffi
from tests.jax_backend.test_effect_order import (ADAGRAD, DIM, EPS, LR, NumpyTable, batches,
                                                 exported, train_step)
from tests.jax_backend import test_effect_order

table = test_effect_order.table  # the fixture: a table with an Adagrad slot


class Spy:
    """A jitted function counting the calls that reach its own dispatch."""

    def __init__(self, jitted):
        self.jitted, self.calls = jitted, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.jitted(*args, **kwargs)

    def trace(self, *args):
        return self.jitted.trace(*args)


def test_steps_dispatched_without_jax_give_the_numpy_table(table):
    spy = Spy(jax.jit(functools.partial(train_step, table)))
    step_fn = dispatch.OrderedJit(spy)
    ref = NumpyTable()
    keys, labels = batches(6)
    for s, (k, y) in enumerate(zip(keys, labels)):
        _, rows = step_fn(jnp.asarray(k), jnp.asarray(y), jnp.int32(s))
        np.testing.assert_allclose(np.asarray(rows), ref.step(k, y), rtol=2e-5, atol=1e-6)
    ref.check(table)
    # The keys' shapes differ per batch: still none went through jax.jit.
    assert spy.calls == 0
    assert all(entry[0] for entry in step_fn._executables.values())


def test_dispatches_of_both_paths_unblocked_see_every_earlier_update(table):
    """Applies through OrderedJit and lookups through jax.jit, and the
    reverse, never waited on in between: the effect token orders them."""
    keys = jnp.asarray(np.array([1, 1, 2, 3], np.int32))
    grads = jnp.asarray(np.linspace(-1.0, 1.0, 4 * DIM, dtype=np.float32).reshape(4, DIM))

    def apply_fn(k, g, step):
        ffi.apply(table, k, g, jnp.array([LR, 0.0, EPS]), step, "adagrad", ADAGRAD,
                  ("accumulator",))
        return step

    def lookup_fn(k):
        return ffi.lookup(table, k, DIM, insert=False)

    ffi.lookup(table, keys, DIM)
    ref = NumpyTable()
    ref.lookup(np.asarray(keys))
    outs = []
    for s in range(12):
        ordered_apply = s % 2 == 0
        apply = dispatch.OrderedJit(jax.jit(apply_fn)) if ordered_apply else jax.jit(apply_fn)
        lookup = jax.jit(lookup_fn) if ordered_apply else dispatch.OrderedJit(jax.jit(lookup_fn))
        for _ in range(2):  # the second call of each takes the unchecked path
            apply(keys, grads * (s + 1), jnp.int32(s))
            outs.append(lookup(keys))
    for i, out in enumerate(outs):
        g = np.asarray(grads) * (i // 2 + 1)
        for k in np.unique(np.asarray(keys)):
            gk = g[np.asarray(keys) == k].sum(0)
            ref.acc[int(k)] = ref.acc[int(k)] + gk * gk
            ref.values[int(k)] = ref.values[int(k)] - LR * gk / np.sqrt(ref.acc[int(k)] + EPS)
        np.testing.assert_allclose(np.asarray(out), [ref.values[int(k)] for k in keys],
                                   rtol=2e-5, atol=1e-6)


def test_donated_arguments_are_consumed_as_by_jax_jit(table):
    def step(state, keys):
        rows = ffi.lookup(table, keys, DIM)
        return [s + rows.sum() for s in state]

    ordered = dispatch.OrderedJit(jax.jit(step, donate_argnums=0))
    plain = jax.jit(step, donate_argnums=0)
    keys = jnp.asarray(np.array([4, 5], np.int32))
    a = [jnp.ones((3,), jnp.float32), jnp.zeros((2, 2), jnp.float32)]
    b = [jnp.ones((3,), jnp.float32), jnp.zeros((2, 2), jnp.float32)]
    for _ in range(3):
        new_a, new_b = ordered(a, keys), plain(b, keys)
        assert all(x.is_deleted() for x in a) and all(x.is_deleted() for x in b)
        for x, y in zip(new_a, new_b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        consumed, a, b = a, new_a, new_b
    with pytest.raises(RuntimeError, match="deleted"):
        ordered(consumed, keys)


def test_what_it_does_not_take_goes_to_jax_jit(table):
    def lookup(k, scale):
        return ffi.lookup(table, k, DIM) * scale

    keys = np.array([7, 8], np.int32)
    one = np.asarray(1.0, np.float32)
    spy = Spy(jax.jit(lookup))
    ordered = dispatch.OrderedJit(spy)
    ordered(keys, 1.0)  # a Python number
    ordered(keys, scale=one)  # a keyword argument
    with jax.disable_jit():
        ordered(keys, one)
    traced = jax.jit(lambda k: ordered(k, one) * 2)(jnp.asarray(keys))  # under a trace
    assert spy.calls == 4
    # JAX and NumPy arrays, outside any trace: its own dispatch.
    np.testing.assert_array_equal(np.asarray(traced), 2 * np.asarray(ordered(keys, one)))
    ordered(jnp.asarray(keys), jnp.asarray(one))
    assert spy.calls == 4
    np.testing.assert_array_equal(exported(table)["freqs"], [6, 6])

    with jax.enable_x64(False):  # an int64 array JAX would make int32
        ordered(keys.astype(np.int64), one)
    assert spy.calls == 5

    # No table call: every call goes to jax.jit, the signature is not even read.
    plain = Spy(jax.jit(lambda x: x + 1))
    no_effect = dispatch.OrderedJit(plain)
    for _ in range(3):
        assert int(no_effect(jnp.int32(1))) == 2
    assert plain.calls == 3 and no_effect._plain


def test_a_new_signature_or_configuration_gets_its_own_executable(table):
    ordered = dispatch.OrderedJit(jax.jit(lambda k, x: (ffi.lookup(table, k, DIM), x * 2)))
    k = jnp.asarray(np.array([1, 2], np.int32))
    ordered(k, jnp.float32(1.0))
    ordered(k, jnp.float32(2.0))
    assert len(ordered._executables) == 1
    ordered(k[:1], jnp.float32(1.0))  # another shape
    out = ordered(k, jnp.float64(1.5))  # another dtype
    assert out[1].dtype == jnp.float64 and float(out[1]) == 3.0
    assert len(ordered._executables) == 3
    with jax.default_matmul_precision("highest"):  # another configuration of the trace
        ordered(k, jnp.float32(1.0))
    assert len(ordered._executables) == 4
    for i in range(dispatch.MAX_SIGNATURES + 3):
        ordered(jnp.asarray(np.arange(i + 1, dtype=np.int32)), jnp.float32(1.0))
    assert len(ordered._executables) == dispatch.MAX_SIGNATURES


def test_a_deleted_argument_is_refused_as_by_jax(table):
    """On a signature's first call (JAX's checks) and on later ones."""
    ordered = dispatch.OrderedJit(jax.jit(lambda k: ffi.lookup(table, k, DIM)))
    k = jnp.asarray(np.array([1, 2], np.int32))
    k.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        ordered(k)
    k = jnp.asarray(np.array([1, 2], np.int32))
    ordered(k)
    ordered(k)
    k.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        ordered(k)


def model_of(form):
    init = keras.initializers.RandomUniform(-0.1, 0.1, seed=3)
    if form == "sequential":
        return keras.Sequential([keras.Input((2,), dtype="int64"),
                                 kre.layers.EmbeddingVariable(4, initializer=init,
                                                              combiner="sum"),
                                 keras.layers.Dense(1, kernel_initializer="ones")])
    inputs = keras.Input((2,), dtype="int64")
    x = kre.layers.EmbeddingVariable(4, initializer=init, combiner="sum")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(x))


@pytest.mark.parametrize("form", ["functional", "sequential"])
def test_keras_fit_evaluate_predict_take_it_and_train_as_with_jax_jit(form, monkeypatch):
    from keras.src.backend.jax import trainer

    assert getattr(trainer.jit, "_kre_fix", False)
    made = []

    class Recording(dispatch.OrderedJit):
        def __init__(self, jitted):
            super().__init__(jitted)
            made.append(self)

    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(64, 2)).astype("int64")
    y = rng.normal(size=(64, 1)).astype("float32")

    def run():
        keras.utils.set_random_seed(1)
        model = model_of(form)
        model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        loss = model.evaluate(x, y, batch_size=16, verbose=0)
        pred = model.predict(x, batch_size=16, verbose=0)
        layer = model.layers[0 if form == "sequential" else 1]
        e = layer.export()
        order = np.argsort(e["keys"])
        return history.history["loss"], loss, pred, e["values"][order]

    monkeypatch.setattr(dispatch, "OrderedJit", Recording)
    ours = run()
    # Train, test and predict steps; each holds table calls, so each ran
    # from its own executable.
    assert len(made) == 3
    assert all(not f._plain and f._executables for f in made)
    monkeypatch.setattr(trainer, "jit", _keras_fixes.KERAS_JAX_JIT_ORIGINALS["jit"])
    theirs = run()
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-6)
    np.testing.assert_allclose(ours[3], theirs[3], rtol=1e-6)


def test_a_step_without_tables_goes_to_jax_jit(monkeypatch):
    made = []

    class Recording(dispatch.OrderedJit):
        def __init__(self, jitted):
            super().__init__(jitted)
            made.append(self)

    monkeypatch.setattr(dispatch, "OrderedJit", Recording)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), verbose=0)
    assert len(made) == 1 and made[0]._plain


def test_the_private_jax_it_reads_is_there(table):
    k = jnp.asarray(np.array([1, 2], np.int32))
    with_call = jax.jit(lambda k: ffi.lookup(table, k, DIM)).trace(k).lower().compile()
    checked_call, call, const_args, out_tree = _jax_private.ordered_executable(with_call)
    assert callable(checked_call) and callable(call) and const_args == ()
    assert out_tree == jax.tree_util.tree_structure(0)
    plain = jax.jit(lambda x: x + 1).trace(k).lower().compile()
    assert _jax_private.ordered_executable(plain) is None
    signature = _jax_private.array_signature([k, np.ones(2, np.float32)])
    assert len(signature) == 2 and hash((_jax_private.trace_context(), signature))
    assert _jax_private.array_signature([k, 1.0]) is None
    assert _jax_private.trace_state_clean()
