"""MultiHashEmbedding's NumPy reference and cases, for
tests/layers/test_multi_hash_embedding.py (both backends) and
tests/jax_backend/test_multi_hash.py. No TensorFlow here."""

import math

import keras
import numpy as np

MASK64 = (1 << 64) - 1


def splitmix64(x):
    """The layer's documented fingerprint, in Python integers."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def in_range(ids, n):
    """Ids in [0, n) kept, others hashed into it."""
    return np.array([i if 0 <= i < n else splitmix64(int(i) & MASK64) % n
                     for i in np.ravel(ids)], np.int64).reshape(np.shape(ids))


def partition_indices(layer, ids):
    """The paper's formulas, from the tables' shapes."""
    sizes = [int(w.shape[0]) for w in layer.tables]
    if layer.complementary_strategy == "Q-R":
        if layer.qr_sizes is not None:
            q, r = layer.qr_sizes
            return [ids // q, ids % r]
        return [ids // sizes[1], ids % sizes[1]]
    if layer.complementary_strategy == "generalized_QR":
        return [(ids // math.prod(sizes[:j])) % sizes[j] for j in range(len(sizes))]
    return [ids % s for s in sizes]


def numpy_embed(layer, ids, combiner=None):
    """The layer's output for `ids` (out of range ones hashed), by NumPy."""
    ids = in_range(ids, layer.num_buckets)
    tables = [keras.ops.convert_to_numpy(w) for w in layer.tables]
    indices = partition_indices(layer, ids)
    assert all(((i >= 0) & (i < len(t))).all() for i, t in zip(indices, tables))
    rows = [t[i] for t, i in zip(tables, indices)]
    if layer.operation == "concat":
        out = np.concatenate(rows, axis=-1)
    elif layer.operation == "add":
        out = np.sum(rows, axis=0)
    else:
        out = np.prod(rows, axis=0)
    if combiner is None:
        return out
    total, length = out.sum(axis=-2), out.shape[-2]
    return {"sum": total, "mean": total / max(length, 1),
            "sqrtn": total / math.sqrt(max(length, 1))}[combiner]


CASES = [
    dict(complementary_strategy="Q-R", operation="add", embedding_dim=4),
    dict(complementary_strategy="Q-R", operation="mult", embedding_dim=4),
    dict(complementary_strategy="Q-R", operation="mult", embedding_dim=[4]),
    dict(complementary_strategy="Q-R", operation="concat", embedding_dim=[3, 2]),
    dict(complementary_strategy="Q-R", operation="add", embedding_dim=4, m=7),
    dict(complementary_strategy="Q-R", operation="add", embedding_dim=4, qr_sizes=(10, 7)),
    dict(complementary_strategy="generalized_QR", operation="mult", embedding_dim=4,
         num_partitions=3),
    dict(complementary_strategy="generalized_QR", operation="concat",
         embedding_dim=[2, 3, 1], moduli=[5, 4, 6]),
    dict(complementary_strategy="CRT", operation="add", embedding_dim=4, num_partitions=3),
    dict(complementary_strategy="CRT", operation="concat", embedding_dim=[2, 2],
         moduli=[11, 10]),
]


def case_id(kwargs):
    return "-".join(map(str, kwargs.values()))


# In range, and out of it (hashed): negative, >= num_buckets, int32 extremes.
IDS = np.array([[0, 99, 57], [-1, 100, 2**31 - 1], [-(2**31), 12, 3]], np.int32)
