"""MultiHashEmbedding: compositional embeddings from complementary partitions
(DeepRec's Multi-Hash Variable; Shi et al., "Compositional Embeddings Using
Complementary Partitions for Memory-Efficient Recommendation Systems").

Written once for both Keras backends: the arguments, partitions, tables and
config are `keras_rec_emb._multi_hash_spec.MultiHashSpec`'s; the lookup is
the backend's (`keras_rec_emb/backend/tensorflow/multi_hash.py`,
`keras_rec_emb/backend/jax/multi_hash.py`). The stable id hash lives in
`keras_rec_emb._hashing`, re-exported here under TensorFlow for old import
paths.
"""

import keras

from keras_rec_emb import _backend
from keras_rec_emb._multi_hash_spec import MultiHashSpec

if _backend.is_jax():
    from keras_rec_emb.backend.jax import multi_hash as _impl
else:
    from keras_rec_emb._hashing import fingerprint64, hash_to_range  # noqa: F401 (old path)
    from keras_rec_emb.backend.tensorflow import multi_hash as _impl


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class MultiHashEmbedding(_impl.MultiHashBackend, MultiHashSpec, keras.layers.Layer):
    """Compositional embedding over complementary partitions (Multi-Hash).

    Instead of one `[num_buckets, dim]` matrix, `k` small tables are kept;
    id `x` in `[0, num_buckets)` picks row `p_j(x)` of table `j` and the
    rows are combined by `operation`. The partitions are complementary: no
    two ids in `[0, num_buckets)` pick the same rows in every table, so
    every id keeps a distinct embedding with about `k * num_buckets**(1/k)`
    rows in all.

    Strategies (`M_j` is the product of the moduli before `j`):

    * `"Q-R"` (quotient-remainder, 2 tables): `x // m` in a table of
      `ceil(num_buckets / m)` rows and `x mod m` in one of `m` rows;
      `m = ceil(sqrt(num_buckets))` unless given.
    * `"generalized_QR"` with moduli `m_1..m_k`: `(x // M_j) mod m_j`.
    * `"CRT"` (Chinese remainder) with pairwise-coprime moduli: `x mod m_j`.

    Unless given, `num_partitions` moduli near `num_buckets**(1/k)` are
    chosen whose product is at least `num_buckets` (pairwise coprime for
    `"CRT"`). The tables are ordinary Keras weights, trained by any
    optimizer (their gradients are `tf.IndexedSlices` under TensorFlow,
    dense under JAX: the same numbers for SGD, and for Adagrad where a batch
    reads each row once, as for `keras.layers.Embedding`).

    Ids outside `[0, num_buckets)` are hashed into it with
    `fingerprint64(id) mod num_buckets` (splitmix64, stable across runs and
    processes; see `fingerprint64`), unless `hash_input=False`: then they
    are an error (a `ValueError` when called eagerly; inside `model.fit`
    and other graphs an `InvalidArgumentError` under TensorFlow, a
    `JaxRuntimeError` carrying that ValueError under JAX). Under JAX the ids
    are dense (ragged and sparse ids are TensorFlow's), and int32 unless
    JAX's 64-bit mode is on (the package turns it on).

    Args:
        num_buckets: int > 0. Size of the id range `[0, num_buckets)` that
            embeds without collisions.
        embedding_dim: int > 0 for `"add"` and `"mult"` (every table has
            this width; a one-element list is accepted); for `"concat"` a
            list of one positive width per table, whose sum is the output
            width (DeepRec's `dims`).
        complementary_strategy: `"Q-R"`, `"generalized_QR"` or `"CRT"`.
            Defaults to `"Q-R"`.
        operation: `"add"`, `"mult"` (element-wise product) or `"concat"`.
            Defaults to `"add"`.
        initializer: Keras initializer of the tables; table `j` of a
            seeded random initializer uses `seed + j`. Defaults to
            `"truncated_normal"` (for `"mult"`, an initializer centred on 1,
            e.g. `RandomNormal(mean=1.0)`, keeps products from vanishing).
        combiner: `None`, `"sum"`, `"mean"` or `"sqrtn"`, as in
            `EmbeddingVariable`. Defaults to `None`.
        m: int > 0 or `None`. The remainder modulus of `"Q-R"`. Defaults to
            `ceil(sqrt(num_buckets))`.
        num_partitions: int >= 2 or `None`. Number of tables `k` of
            `"generalized_QR"` and `"CRT"` (`"Q-R"` has 2). Defaults to
            `len(moduli)`, else 2.
        moduli: list of ints > 0 or `None`. The moduli `m_1..m_k` of
            `"generalized_QR"` and `"CRT"`; their product must be at least
            `num_buckets`, and for `"CRT"` they must be pairwise coprime.
        hash_input: bool. Hash ids outside `[0, num_buckets)` into range
            instead of failing. Defaults to `True`.
        qr_sizes: `None` or a pair `(quotient_rows, remainder_rows)`:
            DeepRec's Q-R mapping (`get_multihash_variable` shapes
            `[[q, d], [r, d]]`, `categorical_column_with_multihash(dims=(q,
            r))`): id `x` reads row `x // q` of a `q`-row quotient table and
            row `x mod r` of an `r`-row remainder table, so a DeepRec model's
            numbers reproduce. `num_buckets` must be at most `q**2` (larger
            ids are hashed into range as above). Unlike our default (`x // m`
            and `x mod m`), the partitions are complementary only when
            `r >= q`: with DeepRec's `(5, 3)`, ids 0 and 3 share both rows.
            Only with `"Q-R"` and without `m`. Defaults to `None`.
        output_dim: int or `None`. If given, the output width the
            `embedding_dim` list of `"concat"` must sum to (for `"add"` and
            `"mult"`, must equal `embedding_dim`).
        name: str or `None`.
        **kwargs: other `keras.layers.Layer` arguments (e.g. `dtype`).

    Input shape:
        Integer ids of any shape; or `[B, None]` ragged/sparse ids with a
        combiner.

    Output shape:
        `ids.shape + (output_dim,)` without a combiner;
        `ids.shape[:-1] + (output_dim,)` with one.

    Example:

    >>> layer = keras_rec_emb.layers.MultiHashEmbedding(
    ...     num_buckets=10**6, embedding_dim=[8, 8], operation="concat")
    >>> tuple(layer(np.array([[3, 999_999]])).shape)
    (1, 2, 16)
    >>> [tuple(w.shape) for w in layer.weights]
    [(1000, 8), (1000, 8)]
    >>> deeprec = keras_rec_emb.layers.MultiHashEmbedding(25, 6, qr_sizes=(5, 3))
    >>> [keras.ops.convert_to_numpy(t).tolist() for t in deeprec.partition_indices(np.array([4, 7]))]
    [[0, 1], [1, 1]]
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> emb = keras_rec_emb.layers.MultiHashEmbedding(1000, 4, combiner="sum")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(emb))
    >>> model.compile(optimizer="adam", loss="mse")
    >>> history = model.fit(np.random.randint(0, 1000, (32, 2)),
    ...                     np.zeros((32, 1)), verbose=0)
    """

    def __init__(self, num_buckets: int, embedding_dim: int | None,
                 complementary_strategy: str = "Q-R", operation: str = "add",
                 initializer: str | dict | keras.initializers.Initializer = "truncated_normal",
                 combiner: str | None = None, m: int | None = None,
                 num_partitions: int | None = None, moduli: list[int] | None = None,
                 hash_input: bool = True, output_dim: int | None = None,
                 qr_sizes: tuple[int, int] | None = None, name: str | None = None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.init_spec(num_buckets, embedding_dim, complementary_strategy, operation,
                       initializer, combiner, m, num_partitions, moduli, hash_input,
                       output_dim, qr_sizes)

    def call(self, inputs):
        """The combined rows of `inputs` (integer ids; see the class)."""
        return self._call(inputs)
