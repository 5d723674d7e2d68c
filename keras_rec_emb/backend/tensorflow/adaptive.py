"""`AdaptiveEmbedding`'s forward in TF ops (`AdaptiveBackend`); how promotion
counts, copies and serves: docs/semantics.md, 'AdaptiveEmbedding'."""

import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import variables
from keras_rec_emb._hashing import hash_to_range
from keras_rec_emb.backend.tensorflow.ids import embed_ids, output_spec

_NOT_PROMOTED, _NEWLY_PROMOTED, _PROMOTED = 0, 1, 2


class AdaptiveBackend:
    """What `AdaptiveEmbedding` does its own way under TensorFlow (dense,
    ragged and sparse ids through `embed_ids`)."""

    # No XLA kernels: Keras's jit_compile="auto" picks False (True warns).
    SUPPORTS_JIT = False

    count_params = variables.count_params  # tables count (ids admitted) x dim

    # -- helpers ----------------------------------------------------------------
    def static_bucket(self, ids):
        """Row of the static table of each id: `fingerprint64(id) mod
        hash_bucket_size` (int64, shape of `ids`)."""
        return hash_to_range(tf.cast(ids, tf.int64), self.hash_bucket_size)

    # -- forward ----------------------------------------------------------------
    def _copy_static_rows(self, keys, freqs):
        """Writes the current static rows of `keys` into the EV (in graph)."""
        values = tf.stop_gradient(tf.gather(self.static_embeddings.value,
                                            self.static_bucket(keys)))
        return self.dynamic.table.merge_rows(keys, values, freqs)

    def _embed_flat(self, ids, mask, training):
        table = self.dynamic.table
        dim = self.embedding_dim
        use_mask = None if mask is None else tf.not_equal(tf.cast(mask, tf.float32), 0.0)
        counting = self.promote_threshold is not None
        deps = []
        if training:
            # 1. Count (and tell states apart by the sentinels).
            probe = tf.stop_gradient(table.lookup(ids, insert=counting))[:, 0]
            finite = tf.math.is_finite(probe)
            if counting:
                # The admitting lookup still reads the no-permission NaN
                # (DeepRec's filter timing); a read-only probe after it
                # tells the newly admitted ids (+inf, their default row).
                with tf.control_dependencies([probe]):
                    after = tf.stop_gradient(table.lookup(ids, insert=False))[:, 0]
                newly = tf.logical_and(tf.math.is_nan(probe), tf.math.is_inf(after))
            else:
                newly = tf.zeros_like(finite)
            code = tf.where(finite, _PROMOTED, tf.where(newly, _NEWLY_PROMOTED, _NOT_PROMOTED))
            uniq, idx = tf.unique(ids)
            n = tf.size(uniq)
            status = tf.math.unsorted_segment_max(code, idx, n)
            # 2. Copy static rows into newly promoted (or newly masked) rows.
            to_copy = tf.equal(status, _NEWLY_PROMOTED)
            forced = tf.zeros_like(to_copy)
            if use_mask is not None:
                wants_ev = tf.math.unsorted_segment_max(tf.cast(use_mask, tf.int32), idx, n) > 0
                forced = tf.logical_and(tf.equal(status, _NOT_PROMOTED), wants_ev)
                to_copy = tf.logical_or(to_copy, forced)
            # Frequencies reached: an id admitted by this lookup keeps the
            # table's exact count (-1: keep); a forced id keeps the count of
            # this batch (its earlier count is not readable in graph).
            ones = tf.ones_like(idx, tf.int64)
            occurrences = tf.math.unsorted_segment_sum(ones, idx, n)
            if counting:
                freqs = tf.where(forced, occurrences, tf.fill([n], tf.constant(-1, tf.int64)))
            else:
                freqs = tf.zeros_like(occurrences)  # the serving lookup counts
            op = self._copy_static_rows(tf.boolean_mask(uniq, to_copy),
                                        tf.boolean_mask(freqs, to_copy))
            deps = [] if op is None or tf.executing_eagerly() else [op]
            use_ev = use_mask if use_mask is not None else tf.gather(status, idx) > 0
        else:
            probe_rows = table.lookup(ids, insert=False)
            present = tf.math.is_finite(probe_rows[:, 0])
            use_ev = present if use_mask is None else tf.logical_and(use_mask, present)
        # 3. Serve: each table only sees the ids it serves.
        positions = tf.range(tf.size(ids))
        ev_pos = tf.boolean_mask(positions, use_ev)
        static_pos = tf.boolean_mask(positions, tf.logical_not(use_ev))
        if training:
            with tf.control_dependencies(deps):
                ev_ids = tf.gather(ids, ev_pos)
                ev_rows = table.lookup(ev_ids, insert=not counting)
        else:
            ev_rows = tf.gather(probe_rows, ev_pos)
        static_rows = tf.gather(self.static_embeddings,
                                self.static_bucket(tf.gather(ids, static_pos)))
        rows = tf.dynamic_stitch([ev_pos, static_pos],
                                 [ev_rows, tf.cast(static_rows, tf.float32)])
        rows = tf.ensure_shape(rows, [None, dim])
        if rows.dtype != self.compute_dtype:
            rows = tf.cast(rows, self.compute_dtype)
        return rows

    def call(self, inputs, adaptive_mask=None, training=None):
        training = bool(_compat.resolve_training(training)) and self.trainable
        return embed_ids(self, inputs, lambda ids, mask: self._embed_flat(ids, mask, training),
                         self.combiner, extra=adaptive_mask)

    def compute_output_spec(self, inputs, adaptive_mask=None, training=None):
        return output_spec(self, inputs, self.embedding_dim, self.combiner)
