"""Embedding layers backed by dynamic hash tables."""

from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.layers.group_embedding import FeatureSpec, GroupEmbedding

__all__ = ["EmbeddingVariable", "FeatureSpec", "GroupEmbedding"]
