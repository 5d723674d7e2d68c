"""`EmbeddingVariable`'s TensorFlow half: its table, placement and lookups.

`keras_rec_emb.layers.EmbeddingVariable` takes `EmbeddingVariableBackend`
below as its base under TensorFlow: the table made at `build` (placed by
`distribute.placement`), tracked as the layer's `TableVariable`s, and the
call's lookup (fused with the model's other lookups: `model_fusion.py`).
"""

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb._checks_core import check_combiner_weights
from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import model_fusion as _model_fusion
from keras_rec_emb.backend.tensorflow import variables
from keras_rec_emb.backend.tensorflow.ids import embed_ids, output_spec
from keras_rec_emb.ops import embedding_ops


def default_key_dtype():
    return "int64"


def register_layer_class(cls):
    """The Functional-model fusion recognises this class's own calls."""
    _model_fusion.EMBEDDING_VARIABLE = cls


class EmbeddingVariableBackend:
    """What `EmbeddingVariable` does its own way under TensorFlow (its base
    there)."""

    # -- init and build -------------------------------------------------------
    def _init_backend(self):
        # No XLA kernels: Keras's jit_compile="auto" picks False (True warns).
        self.supports_jit = False

    def _resolve_optimizer(self, optimizer):
        """A fresh copy of the table's own optimizer (each table keeps its
        own state), or None (the model's)."""
        return None if optimizer is None else type(optimizer).from_config(optimizer.get_config())

    @staticmethod
    def _draw(initializer, shape):
        # Keras may build a layer inside the traced first step of `fit` or
        # symbolically: the matrix is drawn eagerly, once, outside any graph.
        with tf.init_scope():
            return keras.ops.convert_to_numpy(initializer(shape=shape, dtype="float32"))

    def _make_table(self, default_values):
        from keras_rec_emb.distribute import placement

        # Sharded over the PS tasks under `parameter_servers(...)`, over the
        # replicas in a (MultiWorker)MirroredStrategy's scope; else local.
        self.table = placement.make_table(
            self.embedding_dim, self.key_dtype, default_values, trainable=self.trainable,
            name=f"{self.name}/embeddings", restore_dim_mismatch=self.restore_dim_mismatch,
            **self.ev_option.table_kwargs(),
        )
        self.table.optimizer = self.table_optimizer
        for variable in self.table.variables:
            # (A distributed table's variables are its shards' tables.)
            variable.table.optimizer = self.table_optimizer
            _compat.track_variable(self, variable)

    def _table_for_lookup(self):
        """The table, built if need be (for the functional ops' `params`)."""
        if self.table is None:
            self.build()
        return self.table

    def _save_step(self, store):
        del store  # the tables follow the model optimizer's step, saved with it

    def _load_step(self, store, data):
        del store, data

    count_params = variables.count_params  # tables count (ids admitted) x dim

    # -- forward --------------------------------------------------------------
    def _lookup(self, ids, training):
        rows = self.table.lookup(ids, insert=bool(training) and self.trainable)
        if self.compute_dtype != "float32":
            rows = tf.cast(rows, self.compute_dtype)
        return rows

    def _call(self, inputs, weights, training):
        training = _compat.resolve_training(training)
        if weights is None:
            # One of the layers of a Functional model call looked up together.
            rows = _model_fusion.planned_rows(self, inputs, training)
            if rows is not None:
                return rows
        else:
            weights = self._checked_weights(inputs, weights)
        if self.combiner is not None:
            # A group of one: the fused lookup looks up and combines in one op
            # (its gradient over distinct keys), as GroupEmbedding does.
            return embedding_ops.pooled_layer_lookup(self, inputs, training, weights)
        return embed_ids(self, inputs, lambda ids, _: self._lookup(ids, training),
                         None, key_dtype=tf.as_dtype(self.key_dtype))

    def compute_output_spec(self, inputs, weights=None, training=None):
        return output_spec(self, inputs, self.embedding_dim, self.combiner)

    def _checked_weights(self, ids, weights):
        """`weights` as float32 of the ids' kind, after the JAX layer's checks."""
        dtype = getattr(weights, "dtype", None)
        if dtype is not None:
            dtype = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
        check_combiner_weights(self.name, self.combiner, self.prune_invalid_ids, dtype)
        kinds = (tf.RaggedTensor, tf.SparseTensor)
        kind = next((k for k in kinds if isinstance(ids, k)), None)
        if kind is not None or isinstance(weights, kinds):
            if not isinstance(weights, kind or ()):
                raise TypeError(
                    f"EmbeddingVariable '{self.name}': `weights` must be of the ids' kind "
                    f"({'dense' if kind is None else kind.__name__}). Received: weights of "
                    f"type {type(weights).__name__}")
            return tf.cast(weights, tf.float32) if kind is tf.RaggedTensor else (
                tf.SparseTensor(weights.indices, tf.cast(weights.values, tf.float32),
                                weights.dense_shape))
        weights = tf.convert_to_tensor(weights)
        weights = tf.cast(weights, tf.float32)
        ids_shape = tf.TensorShape(getattr(ids, "shape", np.shape(ids)))
        if not ids_shape.is_compatible_with(weights.shape):
            raise ValueError(
                f"EmbeddingVariable '{self.name}': `weights` must have the ids' shape "
                f"{tuple(ids_shape)} (one weight per id). Received: weights of shape "
                f"{tuple(weights.shape)}")
        return weights
