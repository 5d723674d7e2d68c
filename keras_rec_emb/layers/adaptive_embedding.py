"""AdaptiveEmbedding, written once for both backends: the arguments and state
are `AdaptiveSpec`'s, the forward the backend's (backend/tensorflow/adaptive.py
says how promotion works)."""

import keras

from keras_rec_emb import _backend
from keras_rec_emb import options as options_lib
from keras_rec_emb._adaptive_spec import AdaptiveSpec
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

if _backend.is_jax():
    from keras_rec_emb.backend.jax import adaptive as _impl
else:
    from keras_rec_emb.backend.tensorflow import adaptive as _impl


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class AdaptiveEmbedding(_impl.AdaptiveBackend, AdaptiveSpec, keras.layers.Layer):
    """Rare ids share a static hashed table; frequent ids get their own rows.

    Every id starts in a static `[hash_bucket_size, embedding_dim]` matrix at a
    hashed row; a training lookup that brings its count to `promote_threshold`
    gives it its own `EmbeddingVariable` row, copied from the static one. See
    docs/semantics.md, 'AdaptiveEmbedding'.

    Args:
        embedding_dim: int > 0. Width of each embedding row.
        hash_bucket_size: int > 0. Rows of the static table.
        promote_threshold: int >= 1 or `None`. Training lookups after which
            an id is promoted to the EV; `None` never promotes by frequency.
            Defaults to `None`.
        initializer: Keras initializer of the static table (EV rows are
            copies of static rows). Defaults to `"truncated_normal"`.
        ev_option: `keras_rec_emb.EmbeddingVariableOption` or `None`: the EV's
            eviction, shards and `save_filtered`; no `filter_option` or `init_option`.
        combiner: `None`, `"sum"`, `"mean"` or `"sqrtn"`, as in
            `EmbeddingVariable`. Defaults to `None`.
        name: str or `None`.
        **kwargs: other `keras.layers.Layer` arguments (e.g. `dtype`).

    Input shape:
        Integer ids of any shape; or (under TensorFlow) `[B, None]`
        ragged/sparse ids with a combiner. `adaptive_mask`, if given, has the structure of the ids.

    Output shape:
        `ids.shape + (embedding_dim,)` without a combiner;
        `ids.shape[:-1] + (embedding_dim,)` with one.

    Example:

    >>> layer = keras_rec_emb.layers.AdaptiveEmbedding(
    ...     4, hash_bucket_size=100, promote_threshold=2)
    >>> ids = np.array([7, 8, 7])
    >>> out = layer(ids, training=True)  # 7 is seen twice: promoted
    >>> layer.promoted_ids().tolist()
    [7]
    >>> routed = layer(ids, adaptive_mask=np.array([0, 1, 0]))  # 8 -> EV
    >>> inputs = keras.Input(shape=(2,), dtype="int64")
    >>> emb = keras_rec_emb.layers.AdaptiveEmbedding(
    ...     4, 100, promote_threshold=3, combiner="mean")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(1)(emb))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> history = model.fit(np.random.randint(0, 20, (64, 2)), np.ones((64, 1)),
    ...                     verbose=0)
    >>> model.layers[1].promoted_ids().size > 0
    True
    """

    def __init__(self, embedding_dim: int, hash_bucket_size: int,
                 promote_threshold: int | None = None,
                 initializer: str | dict | keras.initializers.Initializer = "truncated_normal",
                 ev_option: options_lib.EmbeddingVariableOption | None = None,
                 combiner: str | None = None, name: str | None = None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.supports_jit = self.SUPPORTS_JIT
        self.init_spec(embedding_dim, hash_bucket_size, promote_threshold, initializer,
                       ev_option, combiner, EmbeddingVariable)
