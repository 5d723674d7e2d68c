"""MultiHashEmbedding's arguments, partitions, tables and config, shared by
the TensorFlow layer (keras_rec_emb/layers/multi_hash_embedding.py) and the
JAX one (keras_rec_emb/backend/jax/multi_hash.py): no TensorFlow here, so both
backends check the same arguments, make the same tables in the same order
and write the same config (private)."""

import itertools
import math

import keras
import numpy as np

from keras_rec_emb._checks_core import check_bool, check_combiner, positive_int

STRATEGIES = ("Q-R", "generalized_QR", "CRT")
OPERATIONS = ("add", "mult", "concat")

# splitmix64 (Steele, Lea & Flood; the finalizer of Java's SplittableRandom):
# the stable id hash of MultiHashEmbedding and AdaptiveEmbedding.
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def refuse_given(name, value, why):
    """Refuses argument `name` when given (not None): `why` it does not apply."""
    if value is not None:
        raise ValueError(f"{why} Received: {name}={value!r}")


def output_shape(input_shape, combiner, width):
    """The output shape of an id layer: a `width` row per id, or per example
    with a `combiner`."""
    input_shape = tuple(input_shape)
    return (input_shape if combiner is None else input_shape[:-1]) + (width,)


def int_root_ceil(n, k):
    """The smallest m >= 1 with m**k >= n."""
    m = max(1, int(round(n ** (1.0 / k))))
    while m ** k < n:
        m += 1
    while m > 1 and (m - 1) ** k >= n:
        m -= 1
    return m


def default_moduli(n, k, coprime):
    """k moduli near n**(1/k) with product >= n (pairwise coprime if asked)."""
    m = int_root_ceil(n, k)
    moduli = []
    for j in range(k):
        # The last one only needs to close the gap to n.
        c = max(1, -(-n // math.prod(moduli))) if j == k - 1 else m
        while coprime and any(math.gcd(c, p) != 1 for p in moduli):
            c += 1
        moduli.append(c)
    return moduli


class MultiHashSpec:
    """The backend-free half of MultiHashEmbedding (a mixin of
    `keras.layers.Layer`): `init_spec` checks and keeps the arguments;
    `build` makes the tables; the partitions, shapes and config follow."""

    def init_spec(self, num_buckets, embedding_dim, complementary_strategy, operation,
                  initializer, combiner, m, num_partitions, moduli, hash_input, output_dim,
                  qr_sizes):
        self.num_buckets = positive_int("num_buckets", num_buckets)
        if complementary_strategy not in STRATEGIES:
            raise ValueError(
                f"`complementary_strategy` must be one of {STRATEGIES}. Received: "
                f"complementary_strategy={complementary_strategy!r}"
            )
        if operation not in OPERATIONS:
            raise ValueError(
                f"`operation` must be one of {OPERATIONS}. Received: operation={operation!r}"
            )
        check_combiner(combiner)
        self.complementary_strategy = complementary_strategy
        self.operation = operation
        self.combiner = combiner
        self.hash_input = check_bool("hash_input", hash_input)
        self.initializer = keras.initializers.get(initializer)
        self.m = None if m is None else positive_int("m", m)
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
            refuse_given("moduli", self.moduli,
                         "`moduli` is for 'generalized_QR' and 'CRT'; 'Q-R' takes `m`.")
            if self.qr_sizes is not None:
                return self._deeprec_qr_partitions()
            m = self.m if self.m is not None else math.isqrt(n - 1) + 1
            return [(m, -(-n // m)), (1, m)]
        refuse_given("qr_sizes", self.qr_sizes, "`qr_sizes` is DeepRec's mapping of "
                     f"complementary_strategy='Q-R', not of {strategy!r}.")
        refuse_given("m", self.m, "`m` is the remainder modulus of 'Q-R'; use `moduli` "
                     f"with complementary_strategy={strategy!r}.")
        if self.moduli is not None:
            moduli = [positive_int("moduli", v) for v in self.moduli]
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
            for a, b in itertools.combinations(moduli if strategy == "CRT" else (), 2):
                if math.gcd(a, b) != 1:
                    raise ValueError(
                        "`moduli` must be pairwise coprime with complementary_strategy="
                        f"'CRT'; {a} and {b} share the factor {math.gcd(a, b)}. "
                        f"Received: moduli={self.moduli!r}")
            self.moduli = moduli
        else:
            k = k or 2
            moduli = default_moduli(n, k, coprime=strategy == "CRT")
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
        q, r = (positive_int("qr_sizes", v) for v in sizes)
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
            dims = [positive_int("embedding_dim", d) for d in embedding_dim]
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
            dims = positive_int("embedding_dim", embedding_dim)
            total = dims
        if self.output_dim is not None:
            if positive_int("output_dim", self.output_dim) != total:
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

    def combine_rows(self, rows):
        """The partitions' rows (one per table, `[..., width_j]`) combined
        by `operation`."""
        if self.operation == "concat":
            return keras.ops.concatenate(rows, axis=-1)
        out = rows[0]
        for r in rows[1:]:
            out = out + r if self.operation == "add" else out * r
        return out

    def compute_output_shape(self, input_shape):
        return output_shape(input_shape, self.combiner, self._total_dim)

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
