"""Functional API: fused embedding lookups over tables and variables."""

from keras_rec_emb.ops.embedding_ops import (
    embedding_lookup,
    embedding_lookup_sparse,
    group_embedding_lookup,
    group_embedding_lookup_sparse,
)
from keras_rec_emb.ops.multi_dim_ops import safe_embedding_lookup_multi_dim

__all__ = [
    "embedding_lookup",
    "embedding_lookup_sparse",
    "group_embedding_lookup",
    "group_embedding_lookup_sparse",
    "safe_embedding_lookup_multi_dim",
]


def __dir__():
    return list(__all__)  # the public names only, not the implementing modules
