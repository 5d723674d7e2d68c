"""MultiHashEmbedding, written once for both backends: the arguments and tables
are `MultiHashSpec`'s, the lookup the backend's. `fingerprint64` and
`hash_to_range` stay importable from here under TensorFlow (old path)."""

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
    rows are combined by `operation`; every id keeps a distinct embedding
    with about `k * num_buckets**(1/k)` rows in all. See docs/semantics.md,
    'MultiHashEmbedding'.

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
        qr_sizes: `None` or a pair `(quotient_rows, remainder_rows)`: DeepRec's
            Q-R mapping (`x // q`, `x mod r`); only with `"Q-R"` and without `m`.
            Defaults to `None`.
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
