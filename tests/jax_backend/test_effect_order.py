"""Table calls under jit run exactly once each, in program order: a
training step called N times gives the table NumPy computes; unused and
repeated lookups still run; XLA neither drops, merges nor reorders calls."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keras_rec_emb.backend.jax import ffi

DIM = 3
ADAGRAD = ("learning_rate", "decay", "epsilon")
LR, EPS, ACC0 = np.float32(0.2), np.float32(1e-7), np.float32(0.1)


def defaults():
    return (np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM) - 4.0) / 5.0


@pytest.fixture
def table():
    handle = ffi.create(defaults())
    ffi.add_slot(handle, "accumulator", DIM, ACC0)
    yield handle
    ffi.destroy(handle)


def exported(handle):
    e = ffi.export(handle, "int32", DIM)
    order = np.argsort(e["keys"])
    return {name: value[order] for name, value in e.items()}


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    # Ids repeat within a batch and across steps, and new ones keep coming.
    keys = [rng.integers(0, 4 + 3 * s, size=(4, 2)).astype(np.int32) for s in range(steps)]
    labels = [rng.normal(size=4).astype(np.float32) for _ in range(steps)]
    return keys, labels


def loss_of_rows(rows, labels):
    pred = rows.sum(axis=(1, 2))
    return jnp.mean((pred - labels) ** 2)


def train_step(handle, keys, labels, step):
    """Lookup with insert, loss, gradient of the rows, Adagrad apply."""
    rows = ffi.lookup(handle, keys, DIM)
    loss, grads = jax.value_and_grad(loss_of_rows)(rows, labels)
    ffi.apply(handle, keys, grads, jnp.array([LR, 0.0, EPS]), step, "adagrad", ADAGRAD,
              ("accumulator",))
    return loss, rows


class NumpyTable:
    """The same training, by hand."""

    def __init__(self):
        self.values, self.acc, self.freqs = {}, {}, {}

    def lookup(self, keys):
        for k in keys.ravel():
            k = int(k)
            self.values.setdefault(k, defaults()[k % 4].copy())
            self.acc.setdefault(k, np.full(DIM, ACC0, np.float32))
            self.freqs[k] = self.freqs.get(k, 0) + 1
        return np.stack([self.values[int(k)] for k in keys.ravel()]).reshape(*keys.shape, DIM)

    def step(self, keys, labels):
        rows = self.lookup(keys)
        pred = rows.sum(axis=(1, 2))
        d = 2.0 * (pred - labels) / len(labels)  # d loss / d pred
        grads = np.broadcast_to(d[:, None, None], rows.shape).astype(np.float32)
        flat_keys, flat_grads = keys.ravel(), grads.reshape(-1, DIM)
        for k in np.unique(flat_keys):
            g = flat_grads[flat_keys == k].sum(0)
            self.acc[int(k)] = self.acc[int(k)] + g * g
            self.values[int(k)] = self.values[int(k)] - LR * g / np.sqrt(self.acc[int(k)] + EPS)
        return rows

    def check(self, handle):
        e = exported(handle)
        keys = sorted(self.values)
        np.testing.assert_array_equal(e["keys"], keys)
        np.testing.assert_allclose(e["values"], [self.values[k] for k in keys], rtol=2e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(e["slots"], [self.acc[k] for k in keys], rtol=2e-5)
        np.testing.assert_array_equal(e["freqs"], [self.freqs[k] for k in keys])


def test_a_jitted_step_called_n_times_gives_the_numpy_table(table):
    step_fn = jax.jit(functools.partial(train_step, table))
    ref = NumpyTable()
    keys, labels = batches(6)
    for s, (k, y) in enumerate(zip(keys, labels)):
        _, rows = step_fn(k, y, jnp.int32(s))
        # Each step reads the rows the previous steps left.
        np.testing.assert_allclose(np.asarray(rows), ref.step(k, y), rtol=2e-5, atol=1e-6)
    ref.check(table)
    np.testing.assert_array_equal(exported(table)["versions"].max(), 5)


def test_a_scan_of_steps_equals_the_python_loop(table):
    other = ffi.create(defaults())
    ffi.add_slot(other, "accumulator", DIM, ACC0)
    keys, labels = batches(5, seed=1)

    def body(_, xs):
        k, y, s = xs
        loss, _ = train_step(table, k, y, s)
        return None, loss

    _, losses = jax.jit(lambda k, y, s: jax.lax.scan(body, None, (k, y, s)))(
        np.stack(keys), np.stack(labels), jnp.arange(5, dtype=jnp.int32))
    step_fn = jax.jit(functools.partial(train_step, other))
    loop_losses = [step_fn(k, y, jnp.int32(s))[0] for s, (k, y) in enumerate(zip(keys, labels))]
    np.testing.assert_allclose(np.asarray(losses), np.asarray(loop_losses), rtol=1e-6)
    a, b = exported(table), exported(other)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    ffi.destroy(other)


def test_a_lookup_whose_rows_are_unused_still_inserts(table):
    @jax.jit
    def touch(keys):
        ffi.lookup(table, keys, DIM)
        return jnp.zeros(())

    touch(np.array([5, 6, 5], np.int32))
    touch(np.array([5], np.int32))
    e = exported(table)
    np.testing.assert_array_equal(e["keys"], [5, 6])
    np.testing.assert_array_equal(e["freqs"], [3, 1])


def test_identical_lookups_in_one_function_each_run(table):
    def twice(keys):
        return ffi.lookup(table, keys, DIM), ffi.lookup(table, keys, DIM)

    compiled = jax.jit(twice).lower(np.array([2, 9], np.int32)).compile()
    # Not merged by XLA's CSE: two custom calls remain after optimization.
    assert compiled.as_text().count("custom_call_target=\"kre_table_lookup\"") == 2
    a, b = jax.jit(twice)(np.array([2, 9], np.int32))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(exported(table)["freqs"], [2, 2])


def test_an_apply_orders_before_a_later_lookup_without_a_data_dependency(table):
    """The lookup after the apply reads no output of it: only the effect
    token orders them, inside one computation and across dispatches."""
    keys = np.array([1, 1, 2], np.int32)
    grads = np.ones((3, DIM), np.float32)

    @jax.jit
    def apply_then_lookup(k, g):
        before = ffi.lookup(table, k, DIM)
        ffi.apply(table, k, g, jnp.array([LR, 0.0, EPS]), 1, "adagrad", ADAGRAD,
                  ("accumulator",))
        return before, ffi.lookup(table, k, DIM, insert=False)

    @jax.jit
    def apply_only(k, g):  # no outputs: nothing to wait on
        ffi.apply(table, k, g, jnp.array([LR, 0.0, EPS]), 2, "adagrad", ADAGRAD,
                  ("accumulator",))

    ref = NumpyTable()
    before, after = apply_then_lookup(keys, grads)
    ref.lookup(keys)
    np.testing.assert_array_equal(np.asarray(before), defaults()[keys % 4])
    summed = {1: 2.0, 2: 1.0}
    for k, g in summed.items():
        ref.acc[k] = ref.acc[k] + g * g
        ref.values[k] = ref.values[k] - LR * g / np.sqrt(ref.acc[k] + EPS)
    np.testing.assert_allclose(np.asarray(after), [ref.values[k] for k in keys], rtol=1e-6)
    apply_only(keys, grads)
    rows = np.asarray(jax.jit(lambda k: ffi.lookup(table, k, DIM, insert=False))(keys))
    for k, g in summed.items():
        ref.acc[k] = ref.acc[k] + g * g
        ref.values[k] = ref.values[k] - LR * g / np.sqrt(ref.acc[k] + EPS)
    np.testing.assert_allclose(rows, [ref.values[k] for k in keys], rtol=1e-6)


def test_an_update_in_the_lookups_backward_runs_once_per_gradient(table):
    """The placement of TPU embedding (and of our JAX layer): a custom_vjp
    whose backward applies the rows' gradient. jax.grad inside jit runs the
    forward lookup and the backward apply once each, in that order."""

    @jax.custom_vjp
    def embed(keys, anchor):
        del anchor
        return ffi.lookup(table, keys, DIM)

    def forward(keys, anchor):
        del anchor
        return ffi.lookup(table, keys, DIM), keys

    def backward(keys, grads):
        ffi.apply(table, keys, grads, jnp.array([LR, 0.0, EPS]), 0, "adagrad", ADAGRAD,
                  ("accumulator",))
        return None, jnp.zeros(())

    embed.defvjp(forward, backward)

    @jax.jit
    def step(keys, labels):
        return jax.grad(lambda a: loss_of_rows(embed(keys, a), labels))(jnp.zeros(()))

    ref = NumpyTable()
    keys, labels = batches(4, seed=2)
    for k, y in zip(keys, labels):
        step(k, y)
        ref.step(k, y)
    ref.check(table)


def test_dispatches_get_the_last_token_itself_on_one_device(table):
    """`_jax_private.pass_tokens_in_place`: the next dispatch is handed the
    token the last one left (no put of it); an effect with no token yet
    takes JAX's own code."""
    from jax._src import dispatch

    lookup = jax.jit(lambda k: ffi.lookup(table, k, DIM, insert=False))
    lookup(np.array([1, 2], np.int32)).block_until_ready()
    tokens = dispatch.runtime_tokens
    last = tokens.current_tokens[ffi._EFFECT]
    device = jax.devices()[0]
    assert tokens.get_token_input(ffi._EFFECT, [device]) is last
    fresh = ffi.TableEffect()
    first = tokens.get_token_input(fresh, [device])
    assert tokens.current_tokens.pop(fresh) is first


def test_alternating_dispatches_unblocked_see_every_earlier_update(table):
    """Applies and lookups dispatched one after the other, never waited on
    in between (the tokens handed on in place): each lookup reads the rows
    every earlier apply left, as NumPy computes them."""
    keys = np.array([1, 1, 2, 3], np.int32)
    grads = np.linspace(-1.0, 1.0, 4 * DIM, dtype=np.float32).reshape(4, DIM)

    @jax.jit
    def apply_only(k, g, step):
        ffi.apply(table, k, g, jnp.array([LR, 0.0, EPS]), step, "adagrad", ADAGRAD,
                  ("accumulator",))

    lookup = jax.jit(lambda k: ffi.lookup(table, k, DIM, insert=False))
    ffi.lookup(table, keys, DIM)  # inserts the keys
    ref = NumpyTable()
    ref.lookup(keys)
    outs = []
    for s in range(12):
        apply_only(keys, grads * (s + 1), s)
        outs.append(lookup(keys))
    for s, out in enumerate(outs):
        g = grads * (s + 1)
        for k in np.unique(keys):
            gk = g[keys == k].sum(0)
            ref.acc[int(k)] = ref.acc[int(k)] + gk * gk
            ref.values[int(k)] = ref.values[int(k)] - LR * gk / np.sqrt(ref.acc[int(k)] + EPS)
        np.testing.assert_allclose(np.asarray(out), [ref.values[int(k)] for k in keys],
                                   rtol=2e-5, atol=1e-6)
