"""keras_rec_emb: industrial sparse embeddings for Keras 3 (TensorFlow backend)."""

from keras_rec_emb import data  # noqa: F401
