"""`layers.HashStrings` under Keras's JAX backend. JAX arrays hold no
strings, so no jitted step (a model's `fit`, `predict`) can take string
ids: the layer hashes NumPy string arrays on the host, with the NumPy
FarmHash of `keras_rec_emb._farmhash` (TensorFlow's keys to the bit), and
returns NumPy int64 keys, before the model. Keras's JAX backend has no
ragged tensors either, so `''` is expressed as `-1` (`missing="pad"`)."""

import keras
import numpy as np

from keras_rec_emb._farmhash import PAD_ID, hash_buckets


def _no_ragged(layer, received):
    return ValueError(
        f"HashStrings '{layer.name}' under Keras's JAX backend returns dense keys: ragged ids "
        "(missing='drop', rows of different lengths) have no form there. Use "
        "missing='pad' on rows of one length ('' fills a short row): the input's shape with "
        "-1 for '', which GroupEmbedding and EmbeddingVariable(combiner=..., "
        f"prune_invalid_ids=True) drop as missing. Received: {received}")


def hash_on_host(layer, inputs):
    """`layer(inputs)`: NumPy int64 keys of NumPy strings (or nested lists of
    them), `-1` for `''`."""
    if isinstance(inputs, keras.KerasTensor):
        raise ValueError(
            f"HashStrings '{layer.name}' cannot be part of a model under Keras's JAX backend: "
            "JAX arrays hold no strings, so a model's (jitted) step cannot take string ids. "
            "Hash them on the host before the model, in the input pipeline or before "
            "`model.predict`: `HashStrings(missing='pad')(np.array(strings))` gives NumPy "
            "int64 keys (-1 for ''), for a model whose `keras.Input` is int64. Received: a "
            f"symbolic input (KerasTensor) of dtype {inputs.dtype}")
    if isinstance(inputs, (list, tuple, str, bytes)):
        array = np.array(inputs, dtype=object)
        if any(isinstance(v, (list, tuple)) for v in array.reshape(-1).tolist()):
            raise _no_ragged(layer, "rows of different lengths")
        inputs = array
    inputs = np.asarray(inputs)  # a JAX array (numbers) becomes NumPy for the check
    if inputs.dtype.kind not in "USO":
        raise TypeError(layer.dtype_error(keras.backend.standardize_dtype(inputs.dtype)))
    layer.check_rank(inputs.ndim, "dense")
    if layer.missing == "drop":
        raise _no_ragged(layer, "missing='drop'")
    return hash_buckets(inputs, empty=PAD_ID)
