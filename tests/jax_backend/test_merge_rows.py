"""`ffi.merge_rows`, the TensorFlow table's `merge_rows` under JAX: rows
written into a live table under jit, past its filter, frequencies kept or
set, versions at the latest step, masked entries and other keys untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keras_rec_emb.backend.jax import ffi

SGD = ("learning_rate", "decay")


@pytest.fixture
def table():
    # A counter filter admitting at the 3rd lookup; NaN for keys not admitted.
    handle = ffi.create(np.full((1, 2), np.inf, np.float32), filter_freq=3,
                        no_permission_value=np.nan)
    yield handle
    ffi.destroy(handle)


def by_key(handle):
    e = ffi.export(handle, "int32", 2)
    return {int(k): (e["values"][i].tolist(), int(e["freqs"][i]), int(e["versions"][i]))
            for i, k in enumerate(e["keys"])}


def test_rows_are_written_past_the_filter_under_jit(table):
    rows = ffi.lookup(table, jnp.array([1, 1, 1, 2], jnp.int32), 2)  # 1 admitted, 2 counted
    assert np.isnan(np.asarray(rows)).all()  # the admitting lookup reads NaN
    ffi.apply(table, jnp.array([1], jnp.int32), jnp.zeros((1, 2)), jnp.array([0.1, 0.0]),
              jnp.int32(6), "sgd", SGD, ())  # latest step 6
    assert by_key(table) == {1: ([np.inf, np.inf], 3, 6)}

    @jax.jit
    def merge(keys, values, freqs, mask):
        ffi.merge_rows(table, keys, values, freqs, mask)
        return ffi.lookup(table, keys, 2, insert=False)

    keys = jnp.array([1, 2, 5, 9], jnp.int32)
    values = jnp.arange(8, dtype=jnp.float32).reshape(4, 2)
    read = merge(keys, values, jnp.array([-1, -1, 4, 7]), jnp.array([1, 1, 1, 0]))
    np.testing.assert_array_equal(np.asarray(read)[:3], np.asarray(values)[:3])
    assert np.isnan(np.asarray(read)[3]).all()  # masked out: still not admitted
    # -1 keeps a key's count, admitted (1's 3) or counted (2's 1), 4 sets
    # it; every version is the latest step.
    assert by_key(table) == {1: ([0.0, 1.0], 3, 6), 2: ([2.0, 3.0], 1, 6),
                             5: ([4.0, 5.0], 4, 6)}
    assert ffi.size(table)[1] == 0  # 2 left the counting keys


def test_bad_input_is_an_error_naming_it(table):
    with pytest.raises(Exception, match=r"`values` must be float32 \[2, 2\], got \[2, 3\]"):
        ffi.merge_rows(table, jnp.array([1, 2], jnp.int32), jnp.zeros((2, 3)),
                       jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32))
    with pytest.raises(Exception, match=r"`freqs` must be an int32 or int64 vector of 2"):
        ffi.merge_rows(table, jnp.array([1, 2], jnp.int32), jnp.zeros((2, 2)),
                       jnp.zeros(3, jnp.int32), jnp.ones(2, jnp.int32))
    with pytest.raises(Exception, match=r"`values` .*finite"):
        ffi.merge_rows(table, jnp.array([1], jnp.int32), jnp.full((1, 2), jnp.nan),
                       jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
    assert by_key(table) == {}
