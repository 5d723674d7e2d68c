"""The stable id hash (splitmix64) that MultiHashEmbedding and
AdaptiveEmbedding share (private; `fingerprint64` is also reachable as
`keras_rec_emb.layers.multi_hash_embedding.fingerprint64`)."""

import tensorflow as tf

from keras_rec_emb._multi_hash_spec import GOLDEN as _GOLDEN
from keras_rec_emb._multi_hash_spec import MIX1 as _MIX1
from keras_rec_emb._multi_hash_spec import MIX2 as _MIX2


def fingerprint64(ids):
    """A stable 64-bit fingerprint of integer ids (splitmix64), as uint64.

    The same in every run, process and machine (unlike Python's `hash`);
    int32 ids are sign-extended first. Returns a uint64 tensor of `ids`' shape.

    Example:

    >>> from keras_rec_emb._hashing import fingerprint64
    >>> fingerprint64(tf.constant([0, 1], tf.int64)).numpy().tolist()
    [16294208416658607535, 10451216379200822465]
    """
    ids = tf.convert_to_tensor(ids)
    if ids.dtype != tf.int64:
        ids = tf.cast(ids, tf.int64)
    z = tf.bitcast(ids, tf.uint64) + tf.constant(_GOLDEN, tf.uint64)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(30, tf.uint64)))
    z = z * tf.constant(_MIX1, tf.uint64)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(27, tf.uint64)))
    z = z * tf.constant(_MIX2, tf.uint64)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(31, tf.uint64)))


def hash_to_range(ids, num_buckets):
    """`fingerprint64(ids) mod num_buckets` as int64 (all ids hashed)."""
    h = tf.math.floormod(fingerprint64(ids), tf.constant(num_buckets, tf.uint64))
    return tf.cast(h, tf.int64)
