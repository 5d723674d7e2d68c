"""MultiHashEmbedding: compositional embeddings from complementary partitions
(DeepRec's Multi-Hash Variable; Shi et al., "Compositional Embeddings Using
Complementary Partitions for Memory-Efficient Recommendation Systems").

The stable id hash (`fingerprint64`, `hash_to_range`) lives in
`keras_rec_emb._hashing` and the input handling (`embed_ids`) in
`keras_rec_emb._ids`; both are re-exported here for old import paths.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb._checks import check_bool, check_combiner
from keras_rec_emb._hashing import fingerprint64, hash_to_range  # noqa: F401 (old path)
from keras_rec_emb._ids import embed_ids, output_spec

_STRATEGIES = ("Q-R", "generalized_QR", "CRT")
_OPERATIONS = ("add", "mult", "concat")

def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def _int_root_ceil(n, k):
    """The smallest m >= 1 with m**k >= n."""
    m = max(1, int(round(n ** (1.0 / k))))
    while m ** k < n:
        m += 1
    while m > 1 and (m - 1) ** k >= n:
        m -= 1
    return m


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class MultiHashEmbedding(keras.layers.Layer):
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
    optimizer (their gradients are `tf.IndexedSlices`).

    Ids outside `[0, num_buckets)` are hashed into it with
    `fingerprint64(id) mod num_buckets` (splitmix64, stable across runs and
    processes; see `fingerprint64`), unless `hash_input=False`: then they
    are an error (a `ValueError` when called eagerly, an
    `InvalidArgumentError` inside `model.fit` and other graphs).

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
    >>> layer(np.array([[3, 999_999]])).shape
    TensorShape([1, 2, 16])
    >>> [tuple(w.shape) for w in layer.weights]
    [(1000, 8), (1000, 8)]
    >>> deeprec = keras_rec_emb.layers.MultiHashEmbedding(25, 6, qr_sizes=(5, 3))
    >>> [t.numpy().tolist() for t in deeprec.partition_indices(np.array([4, 7]))]
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
        self.num_buckets = _positive_int("num_buckets", num_buckets)
        if complementary_strategy not in _STRATEGIES:
            raise ValueError(
                f"`complementary_strategy` must be one of {_STRATEGIES}. Received: "
                f"complementary_strategy={complementary_strategy!r}"
            )
        if operation not in _OPERATIONS:
            raise ValueError(
                f"`operation` must be one of {_OPERATIONS}. Received: operation={operation!r}"
            )
        check_combiner(combiner)
        self.complementary_strategy = complementary_strategy
        self.operation = operation
        self.combiner = combiner
        self.hash_input = check_bool("hash_input", hash_input)
        self.initializer = keras.initializers.get(initializer)
        self.m = None if m is None else _positive_int("m", m)
        self.num_partitions = num_partitions
        self.moduli = None if moduli is None else list(moduli)
        self.output_dim = output_dim
        self.qr_sizes = qr_sizes
        # (divisor, modulus) per table: index_j = (x // divisor_j) mod modulus_j,
        # and table j has modulus_j rows.
        self._partitions = self._make_partitions()
        k = len(self._partitions)
        self.embedding_dim = self._check_dims(embedding_dim, k)
        self.tables = []

    # -- argument checks --------------------------------------------------------
    def _make_partitions(self):
        n, strategy = self.num_buckets, self.complementary_strategy
        k = self.num_partitions
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2:
                raise ValueError(
                    "`num_partitions` must be an integer >= 2. Received: "
                    f"num_partitions={k!r}"
                )
            k = int(k)
            self.num_partitions = k
        if strategy == "Q-R":
            if k not in (None, 2):
                raise ValueError(
                    "`num_partitions` must be 2 (or None) with "
                    f"complementary_strategy='Q-R'. Received: num_partitions={k!r}"
                )
            if self.moduli is not None:
                raise ValueError(
                    "`moduli` is for 'generalized_QR' and 'CRT'; 'Q-R' takes `m`. "
                    f"Received: moduli={self.moduli!r}"
                )
            if self.qr_sizes is not None:
                return self._deeprec_qr_partitions()
            m = self.m if self.m is not None else math.isqrt(n - 1) + 1
            return [(m, -(-n // m)), (1, m)]
        if self.qr_sizes is not None:
            raise ValueError(
                "`qr_sizes` is DeepRec's mapping of complementary_strategy='Q-R'. "
                f"Received: qr_sizes={self.qr_sizes!r} with "
                f"complementary_strategy={strategy!r}"
            )
        if self.m is not None:
            raise ValueError(
                "`m` is the remainder modulus of 'Q-R'; use `moduli` with "
                f"complementary_strategy={strategy!r}. Received: m={self.m!r}"
            )
        if self.moduli is not None:
            moduli = [_positive_int("moduli", v) for v in self.moduli]
            if len(moduli) < 2:
                raise ValueError(
                    f"`moduli` must list at least 2 moduli. Received: moduli={self.moduli!r}"
                )
            if k is not None and k != len(moduli):
                raise ValueError(
                    f"`num_partitions` ({k}) must equal len(moduli) ({len(moduli)}). "
                    f"Received: num_partitions={k}, moduli={self.moduli!r}"
                )
            if math.prod(moduli) < n:
                raise ValueError(
                    "The product of `moduli` must be at least `num_buckets` "
                    f"({n}) for the partitions to be complementary. Received: "
                    f"moduli={self.moduli!r} (product {math.prod(moduli)})"
                )
            if strategy == "CRT":
                for i in range(len(moduli)):
                    for j in range(i + 1, len(moduli)):
                        if math.gcd(moduli[i], moduli[j]) != 1:
                            raise ValueError(
                                "`moduli` must be pairwise coprime with "
                                f"complementary_strategy='CRT'; {moduli[i]} and "
                                f"{moduli[j]} share the factor "
                                f"{math.gcd(moduli[i], moduli[j])}. Received: "
                                f"moduli={self.moduli!r}"
                            )
            self.moduli = moduli
        else:
            k = k or 2
            moduli = _default_moduli(n, k, coprime=strategy == "CRT")
        if strategy == "CRT":
            return [(1, mj) for mj in moduli]
        parts, divisor = [], 1
        for mj in moduli:
            parts.append((divisor, mj))
            divisor *= mj
        return parts

    def _deeprec_qr_partitions(self):
        sizes = self.qr_sizes
        if not isinstance(sizes, (list, tuple)) or len(sizes) != 2:
            raise ValueError(
                "`qr_sizes` must be a pair (quotient_rows, remainder_rows). "
                f"Received: qr_sizes={sizes!r}"
            )
        q, r = (_positive_int("qr_sizes", v) for v in sizes)
        if self.m is not None:
            raise ValueError(
                "`m` and `qr_sizes` are two Q-R mappings; give one. Received: "
                f"m={self.m!r}, qr_sizes={sizes!r}"
            )
        if self.num_buckets > q * q:
            raise ValueError(
                "With `qr_sizes`, ids in [0, num_buckets) read quotient row "
                f"id // {q}, so `num_buckets` must be at most {q}**2 = {q * q}. "
                f"Received: num_buckets={self.num_buckets}, qr_sizes={sizes!r}"
            )
        self.qr_sizes = [q, r]
        # DeepRec: quotient row id // q (< q for ids < q**2), remainder id mod r.
        return [(q, q), (1, r)]

    def _check_dims(self, embedding_dim, k):
        if self.operation == "concat":
            if (not isinstance(embedding_dim, (list, tuple)) or len(embedding_dim) != k):
                raise ValueError(
                    f"`embedding_dim` must be a list of {k} widths (one per table) "
                    "with operation='concat'. Received: "
                    f"embedding_dim={embedding_dim!r}"
                )
            dims = [_positive_int("embedding_dim", d) for d in embedding_dim]
            total = sum(dims)
        else:
            if isinstance(embedding_dim, (list, tuple)):
                if len(embedding_dim) != 1:
                    raise ValueError(
                        "`embedding_dim` must be one integer with "
                        f"operation={self.operation!r} (tables of equal width; a "
                        "list of widths needs operation='concat'). Received: "
                        f"embedding_dim={embedding_dim!r}"
                    )
                embedding_dim = embedding_dim[0]
            dims = _positive_int("embedding_dim", embedding_dim)
            total = dims
        if self.output_dim is not None:
            if _positive_int("output_dim", self.output_dim) != total:
                raise ValueError(
                    f"`embedding_dim` must sum to `output_dim` ({self.output_dim}). "
                    f"Received: embedding_dim={embedding_dim!r} (sum {total})"
                )
            self.output_dim = int(self.output_dim)
        self._total_dim = total
        return dims

    # -- partitions -------------------------------------------------------------
    @property
    def partition_sizes(self):
        """Rows of each table."""
        return [mod for _, mod in self._partitions]

    @property
    def table_dims(self):
        """Width of each table."""
        if self.operation == "concat":
            return list(self.embedding_dim)
        return [self.embedding_dim] * len(self._partitions)

    @property
    def output_width(self):
        """Width of each output embedding."""
        return self._total_dim

    def partition_indices(self, ids):
        """Row of each table for ids in `[0, num_buckets)`: a list of int64
        tensors `(ids // divisor_j) mod modulus_j`."""
        ids = tf.cast(ids, tf.int64)
        return [tf.math.floormod(tf.math.floordiv(ids, d) if d > 1 else ids, mod)
                for d, mod in self._partitions]

    @property
    def ids_input_dtype(self):
        """`"int64"`: the dtype of the `keras.Input` a `keras.Sequential`
        without one makes for this layer (Keras would make it float32)."""
        return "int64"

    def build(self, input_shape=None):
        if self.built:
            return
        if self.complementary_strategy == "Q-R":
            names = ["quotient_embeddings", "remainder_embeddings"]
        else:
            names = [f"partition_{j}_embeddings" for j in range(len(self._partitions))]
        self.tables = [
            self.add_weight(shape=(rows, dim), initializer=self._table_initializer(j),
                            name=name)
            for j, (name, rows, dim) in enumerate(zip(names, self.partition_sizes,
                                                      self.table_dims))
        ]
        self.built = True

    def _table_initializer(self, j):
        # A Keras random initializer draws the same values at every call, and
        # tables of equal shape must differ (with "add", equal tables give
        # ids (a, b) and (b, a) one embedding): table j gets its own seed.
        init = self.initializer
        config = init.get_config()
        if j == 0 or "seed" not in config:
            return init
        if isinstance(config["seed"], int):
            config["seed"] += j
        return type(init).from_config(config)  # unseeded: a fresh seed

    # -- forward ----------------------------------------------------------------
    def _in_range(self, ids):
        n = self.num_buckets
        if self.hash_input:
            inside = tf.logical_and(ids >= 0, ids < n)
            return tf.where(inside, ids, hash_to_range(ids, n))
        if tf.executing_eagerly():
            bad = ids.numpy()[(ids.numpy() < 0) | (ids.numpy() >= n)]
            if bad.size:
                raise ValueError(
                    f"MultiHashEmbedding '{self.name}' has hash_input=False and "
                    f"takes ids in [0, {n}). Received {bad.size} id(s) outside, "
                    f"e.g. {bad[0]}"
                )
            return ids
        message = (f"MultiHashEmbedding '{self.name}' has hash_input=False and takes "
                   f"ids in [0, {n}); received ids outside")
        checks = [tf.debugging.assert_non_negative(ids, message=message),
                  tf.debugging.assert_less(ids, tf.constant(n, tf.int64), message=message)]
        with tf.control_dependencies(checks):
            return tf.identity(ids)

    def _embed_flat(self, ids, _):
        ids = self._in_range(ids)
        rows = [tf.gather(table, idx) for table, idx in zip(self.tables,
                                                            self.partition_indices(ids))]
        if self.operation == "concat":
            out = tf.concat(rows, axis=-1)
        elif self.operation == "add":
            out = tf.add_n(rows)
        else:
            out = rows[0]
            for r in rows[1:]:
                out = out * r
        if out.dtype != self.compute_dtype:
            out = tf.cast(out, self.compute_dtype)
        return out

    def call(self, inputs):
        return embed_ids(self, inputs, self._embed_flat, self.combiner)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if self.combiner is not None:
            return input_shape[:-1] + (self._total_dim,)
        return input_shape + (self._total_dim,)

    def compute_output_spec(self, inputs):
        return output_spec(self, inputs, self._total_dim, self.combiner)

    def get_config(self):
        config = super().get_config()
        config.update({
            "num_buckets": self.num_buckets,
            "embedding_dim": (list(self.embedding_dim) if isinstance(self.embedding_dim, list)
                              else self.embedding_dim),
            "complementary_strategy": self.complementary_strategy,
            "operation": self.operation,
            "initializer": keras.initializers.serialize(self.initializer),
            "combiner": self.combiner,
            "m": self.m,
            "num_partitions": self.num_partitions,
            "moduli": self.moduli,
            "hash_input": self.hash_input,
            "output_dim": self.output_dim,
            "qr_sizes": self.qr_sizes,
        })
        return config


def _default_moduli(n, k, coprime):
    """k moduli near n**(1/k) with product >= n (pairwise coprime if asked)."""
    m = _int_root_ceil(n, k)
    moduli = []
    for j in range(k):
        # The last one only needs to close the gap to n.
        c = max(1, -(-n // math.prod(moduli))) if j == k - 1 else m
        while coprime and any(math.gcd(c, p) != 1 for p in moduli):
            c += 1
        moduli.append(c)
    return moduli
