"""`layers.HashStrings` on Keras's TensorFlow backend: the keys from
TensorFlow's own op, so that an exported model serves raw strings with stock
TensorFlow; ragged and sparse strings keep their kind."""

import tensorflow as tf

from keras_rec_emb._keras_fixes import in_symbolic_build
from keras_rec_emb._farmhash import NUM_BUCKETS, PAD_ID


def hash_strings(strings):
    """int64 keys of a string tensor: `tf.strings.to_hash_bucket_fast(s,
    2**63 - 1)` (FarmHash Fingerprint64 modulo 2**63 - 1), DeepRec's rule."""
    return tf.strings.to_hash_bucket_fast(strings, NUM_BUCKETS)


def to_strings(inputs):
    """Checked nested lists or an object array as a tf.string tensor (a
    ragged one for rows of different lengths)."""
    try:
        return tf.constant(inputs, tf.string)
    except ValueError:  # rows of different lengths
        return tf.ragged.constant(inputs, tf.string)


def _strings(layer, inputs):
    if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
        dtype = inputs.dtype
    else:
        inputs = tf.convert_to_tensor(inputs)
        dtype = inputs.dtype
    if dtype == tf.string:
        return inputs
    if in_symbolic_build():  # shapes only: see _keras_fixes.in_symbolic_build
        if isinstance(inputs, tf.RaggedTensor):
            return inputs.with_flat_values(tf.strings.as_string(inputs.flat_values))
        if isinstance(inputs, tf.SparseTensor):
            return inputs.with_values(tf.strings.as_string(inputs.values))
        return tf.strings.as_string(inputs)
    raise TypeError(layer.dtype_error(dtype.name))


def call(layer, inputs):
    """`layer.call`: keys of dense, ragged or sparse strings, `''` dropped
    or `-1` as `layer.missing` says."""
    strings = _strings(layer, inputs)

    def keys_of(values):
        keys = hash_strings(values)
        if layer.missing == "pad":
            keys = tf.where(tf.equal(values, ""), tf.constant(PAD_ID, tf.int64), keys)
        return keys

    if isinstance(strings, tf.RaggedTensor):
        layer.check_rank(strings.shape.rank, "ragged")
        keys = strings.with_flat_values(keys_of(strings.flat_values))
        if layer.missing == "drop":
            keys = tf.ragged.boolean_mask(keys, tf.not_equal(strings, ""))
        return keys
    if isinstance(strings, tf.SparseTensor):
        layer.check_rank(strings.shape.rank, "sparse")
        if layer.missing == "drop":
            strings = tf.sparse.retain(strings, tf.not_equal(strings.values, ""))
        return strings.with_values(keys_of(strings.values))
    layer.check_rank(strings.shape.rank, "dense")
    keys = keys_of(strings)
    if layer.missing == "pad":
        return keys
    if strings.shape.rank == 1:
        strings, keys = strings[:, None], keys[:, None]
    return tf.ragged.boolean_mask(keys, tf.not_equal(strings, ""))
