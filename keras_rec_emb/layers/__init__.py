"""Embedding layers backed by dynamic hash tables."""

from keras_rec_emb.layers.adaptive_embedding import AdaptiveEmbedding
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.layers.group_embedding import FeatureSpec, GroupEmbedding
from keras_rec_emb.layers.multi_hash_embedding import MultiHashEmbedding

__all__ = ["AdaptiveEmbedding", "EmbeddingVariable", "FeatureSpec", "GroupEmbedding",
           "MultiHashEmbedding"]
