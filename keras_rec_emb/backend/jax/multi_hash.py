"""`MultiHashEmbedding` under Keras's JAX backend.

Its tables are fixed-size Keras weights, as under TensorFlow: no hash
table, no table engine. The compiled optimizer trains them like any dense
weight. TensorFlow's gradient is `tf.IndexedSlices` (a row per id read),
JAX's dense (zero outside the rows read, equal rows summed): the same
numbers for SGD, and for Adagrad where a batch reads each row once; where
it reads a row twice Keras's TensorFlow backend adds each occurrence's
squared gradient to the accumulator and its JAX backend the square of their
sum (`keras.layers.Embedding` differs so too). What the two backends share,
argument checks, partitions, tables and config, lives in
keras_rec_emb/_multi_hash_spec.py; the id hash in `hashing`.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_rec_emb.backend.jax import ffi, hashing, register
from keras_rec_emb.backend.jax.ids import integer_ids, numpy_ids
from keras_rec_emb.backend.jax.layers import combine_last_axis
from keras_rec_emb._multi_hash_spec import MultiHashSpec


def check_in_range(ids, n, what):
    """`ids` unchanged, after checking each is in [0, n): a ValueError now
    when they are concrete; when traced, a host check at run time, whose
    ValueError comes out of the jitted step as a `JaxRuntimeError` (as the
    TensorFlow layer's check is an `InvalidArgumentError` in graphs)."""
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


@register(package="keras_rec_emb", name="MultiHashEmbedding")
class MultiHashEmbedding(MultiHashSpec, keras.layers.Layer):
    """Compositional embedding over complementary partitions (DeepRec's
    Multi-Hash Variable), under Keras's JAX backend (the TensorFlow
    backend's `MultiHashEmbedding`: same arguments, tables, numbers and
    config, one `.keras` file for both).

    Instead of one `[num_buckets, dim]` matrix, `k` small tables (Keras
    weights, trained by the compiled optimizer) are kept; id `x` in
    `[0, num_buckets)` reads row `(x // M_j) mod m_j` of table `j` and the
    rows are combined by `operation`. Ids outside `[0, num_buckets)` are
    hashed into it (`fingerprint64(id) mod num_buckets`, the TensorFlow
    backend's splitmix64, to the bit) unless `hash_input=False`: then they
    are a ValueError when called eagerly and a `JaxRuntimeError` carrying
    that ValueError inside `jit` (`model.fit`, `predict`).

    Under JAX the ids are dense (ragged and sparse ids are TensorFlow's);
    they are int32 unless JAX's 64-bit mode is on, so without it
    `num_buckets` must be at most 2**31 - 1.

    Args:
        num_buckets: int > 0. Size of the id range `[0, num_buckets)` that
            embeds without collisions.
        embedding_dim: int > 0 for `"add"` and `"mult"` (a one-element list
            is accepted); for `"concat"` a list of one width per table.
        complementary_strategy: `"Q-R"` (default), `"generalized_QR"` or
            `"CRT"`.
        operation: `"add"` (default), `"mult"` or `"concat"`.
        initializer: Keras initializer of the tables (table `j` of a seeded
            random one uses `seed + j`). Defaults to `"truncated_normal"`.
        combiner: `None`, `"sum"`, `"mean"` or `"sqrtn"`: combines the last
            axis of the ids (`[..., L]` -> `[..., output width]`).
        m: int > 0 or `None`: the remainder modulus of `"Q-R"`.
        num_partitions: int >= 2 or `None`: tables of `"generalized_QR"` and
            `"CRT"`.
        moduli: list of ints > 0 or `None`: the moduli of
            `"generalized_QR"` and `"CRT"` (product >= `num_buckets`;
            pairwise coprime for `"CRT"`).
        hash_input: bool. Hash ids outside `[0, num_buckets)` into range.
            Defaults to `True`.
        output_dim: int or `None`: the output width `embedding_dim` must
            give.
        qr_sizes: `None` or DeepRec's Q-R pair `(quotient_rows,
            remainder_rows)`.
        name: str or `None`.
        **kwargs: other `keras.layers.Layer` arguments (e.g. `dtype`).

    Example:

    >>> layer = keras_rec_emb.layers.MultiHashEmbedding(
    ...     num_buckets=10**6, embedding_dim=[8, 8], operation="concat")
    >>> tuple(layer(np.array([[3, 999_999]])).shape)
    (1, 2, 16)
    >>> [tuple(w.shape) for w in layer.weights]
    [(1000, 8), (1000, 8)]
    >>> ids = keras.Input(shape=(2,), dtype="int32")
    >>> emb = keras_rec_emb.layers.MultiHashEmbedding(1000, 4, combiner="sum")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(emb))
    >>> model.compile(optimizer="adam", loss="mse")
    >>> history = model.fit(np.random.randint(-5, 2000, (32, 2)),
    ...                     np.zeros((32, 1)), verbose=0)
    """

    def __init__(self, num_buckets, embedding_dim, complementary_strategy="Q-R",
                 operation="add", initializer="truncated_normal", combiner=None, m=None,
                 num_partitions=None, moduli=None, hash_input=True, output_dim=None,
                 qr_sizes=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.init_spec(num_buckets, embedding_dim, complementary_strategy, operation,
                       initializer, combiner, m, num_partitions, moduli, hash_input,
                       output_dim, qr_sizes)

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
        # NumPy ids are checked before Keras makes JAX arrays of them (which
        # in JAX's 32-bit mode narrows int64 ids unchecked).
        return super().__call__(numpy_ids(inputs, f"MultiHashEmbedding '{self.name}'",
                                          ffi.int_dtype().name), *args, **kwargs)

    def call(self, inputs):
        ids = integer_ids(inputs, f"MultiHashEmbedding '{self.name}'", ffi.int_dtype().name,
                          via=np.int64)
        if self.combiner is not None and ids.ndim < 1:
            raise ValueError(
                f"MultiHashEmbedding '{self.name}' with a combiner combines the last axis "
                f"of the ids; received scalar ids of shape {tuple(ids.shape)}")
        ids = self._in_range(ids)
        out = self.combine_rows([jnp.take(table.value, idx, axis=0) for table, idx in
                                 zip(self.tables, self.partition_indices(ids))])
        out = out.astype(self.compute_dtype)
        return out if self.combiner is None else combine_last_axis(out, None, self.combiner)
