"""Optimizers that update dense variables as Keras does and embedding tables
with a fused sparse kernel."""

from keras_rec_emb.optimizers.keras_optimizers import SGD, Adagrad, Adam, Ftrl

__all__ = ["SGD", "Adagrad", "Adam", "Ftrl"]
