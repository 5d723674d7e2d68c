"""Helpers shared by the Parquet tests: dataset batches as Python rows."""

import tensorflow as tf


def to_python(value):
    if isinstance(value, tf.RaggedTensor):
        return value.to_list()
    return value.numpy().tolist()


def read_all(dataset):
    """Column -> list of rows, concatenating every batch."""
    rows = {}
    for batch in dataset:
        for name, value in batch.items():
            rows.setdefault(name, []).extend(to_python(value))
    return rows
