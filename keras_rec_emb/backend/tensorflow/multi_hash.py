"""`MultiHashEmbedding`'s TensorFlow half: partitions and the lookup in TF ops.

`keras_rec_emb.layers.MultiHashEmbedding` is written once; under Keras's
TensorFlow backend it takes `MultiHashBackend` below as its base (dense,
ragged and sparse ids through `embed_ids`; an out-of-range id with
`hash_input=False` an assertion in graphs).
"""

import tensorflow as tf

from keras_rec_emb._hashing import hash_to_range
from keras_rec_emb.backend.tensorflow.ids import embed_ids, output_spec


class MultiHashBackend:
    """What `MultiHashEmbedding` does its own way under TensorFlow."""

    # -- partitions -------------------------------------------------------------
    def partition_indices(self, ids):
        """Row of each table for ids in `[0, num_buckets)`: a list of int64
        tensors `(ids // divisor_j) mod modulus_j`."""
        ids = tf.cast(ids, tf.int64)
        return [tf.math.floormod(tf.math.floordiv(ids, d) if d > 1 else ids, mod)
                for d, mod in self._partitions]

    # -- forward ----------------------------------------------------------------
    def _in_range(self, ids):
        n = self.num_buckets
        if self.hash_input:
            inside = tf.logical_and(ids >= 0, ids < n)
            return tf.where(inside, ids, hash_to_range(ids, n))
        if tf.executing_eagerly():
            bad = ids.numpy()[(ids.numpy() < 0) | (ids.numpy() >= n)]
            if bad.size:
                raise ValueError(
                    f"MultiHashEmbedding '{self.name}' has hash_input=False and "
                    f"takes ids in [0, {n}). Received {bad.size} id(s) outside, "
                    f"e.g. {bad[0]}"
                )
            return ids
        message = (f"MultiHashEmbedding '{self.name}' has hash_input=False and takes "
                   f"ids in [0, {n}); received ids outside")
        checks = [tf.debugging.assert_non_negative(ids, message=message),
                  tf.debugging.assert_less(ids, tf.constant(n, tf.int64), message=message)]
        with tf.control_dependencies(checks):
            return tf.identity(ids)

    def _embed_flat(self, ids, _):
        ids = self._in_range(ids)
        out = self.combine_rows([tf.gather(table, idx) for table, idx in
                                 zip(self.tables, self.partition_indices(ids))])
        if out.dtype != self.compute_dtype:
            out = tf.cast(out, self.compute_dtype)
        return out

    def _call(self, inputs):
        return embed_ids(self, inputs, self._embed_flat, self.combiner)

    def compute_output_spec(self, inputs):
        return output_spec(self, inputs, self._total_dim, self.combiner)
