"""Embedding layers backed by dynamic hash tables."""

from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

__all__ = ["EmbeddingVariable"]
