"""`MultiHashEmbedding`'s JAX half (`keras_rec_emb.layers.MultiHashEmbedding`'s
base under Keras's JAX backend).

Its tables are fixed-size Keras weights, trained by the compiled optimizer
like any dense weight. TensorFlow's gradient is `tf.IndexedSlices` (a row
per id read), JAX's dense (equal rows summed): where a batch reads a row
twice, Adagrad under TensorFlow adds each occurrence's squared gradient and
under JAX the square of their sum (as `keras.layers.Embedding`). The shared
checks, partitions, tables and config live in _multi_hash_spec.py.
"""

import jax
import jax.numpy as jnp
import numpy as np

from keras_rec_emb.backend.jax import ffi, hashing
from keras_rec_emb.backend.jax.ids import check_combinable, integer_ids, numpy_ids
from keras_rec_emb.backend.jax.layers import combine_last_axis


def check_in_range(ids, n, what):
    """`ids` unchanged, after checking each is in [0, n): a ValueError now
    when they are concrete; when traced, a host check whose ValueError
    comes out of the jitted step as a `JaxRuntimeError`."""
    message = f"{what} has hash_input=False and takes ids in [0, {n})"

    def check(values):
        values = np.asarray(values)
        bad = values[(values < 0) | (values >= n)]
        if bad.size:
            raise ValueError(f"{message}. Received {bad.size} id(s) outside, e.g. {bad[0]}")

    if isinstance(ids, jax.core.Tracer):
        jax.debug.callback(check, ids)
    else:
        check(ids)
    return ids


class MultiHashBackend:
    """What `MultiHashEmbedding` does its own way under JAX."""

    def partition_indices(self, ids):
        """Row of each table for ids in `[0, num_buckets)`: a list of
        integer arrays `(ids // divisor_j) mod modulus_j`."""
        ids = jnp.asarray(ids)
        return [((ids // d) if d > 1 else ids) % mod for d, mod in self._partitions]

    def _in_range(self, ids):
        n = self.num_buckets
        if n > hashing.INT32_MAX and ids.dtype != jnp.int64:
            raise ValueError(
                f"MultiHashEmbedding '{self.name}' holds int32 ids (JAX's default), which "
                f"take num_buckets <= {hashing.INT32_MAX}; more need JAX's 64-bit mode "
                "(jax.config.update('jax_enable_x64', True)). Received: "
                f"num_buckets={n}")
        if not self.hash_input:
            return check_in_range(ids, n, f"MultiHashEmbedding '{self.name}'")
        inside = (ids >= 0) & (ids < n)
        return jnp.where(inside, ids, hashing.hash_to_range(ids, n))

    def __call__(self, inputs, *args, **kwargs):
        return super().__call__(numpy_ids(inputs, f"MultiHashEmbedding '{self.name}'",
                                          ffi.int_dtype().name), *args, **kwargs)

    def _call(self, inputs):
        ids = integer_ids(inputs, f"MultiHashEmbedding '{self.name}'", ffi.int_dtype().name,
                          via=np.int64)
        check_combinable(ids, self.combiner, f"MultiHashEmbedding '{self.name}'")
        ids = self._in_range(ids)
        out = self.combine_rows([jnp.take(table.value, idx, axis=0) for table, idx in
                                 zip(self.tables, self.partition_indices(ids))])
        out = out.astype(self.compute_dtype)
        return out if self.combiner is None else combine_last_axis(out, None, self.combiner)
