"""AdaptiveEmbedding: a static hashed table for rare ids and an
EmbeddingVariable for frequent ones (DeepRec's Adaptive Embedding).

Written once for both Keras backends: the arguments, the inner
EmbeddingVariable, the static table, the promotion state and the config
are `keras_rec_emb._adaptive_spec.AdaptiveSpec`'s; the forward (count, copy
newly promoted rows, serve each id from one table) is the backend's
(`keras_rec_emb/backend/tensorflow/adaptive.py`, which says how promotion
works, and `keras_rec_emb/backend/jax/adaptive.py`).
"""

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

    Every id starts in a static `[hash_bucket_size, embedding_dim]` matrix
    (a Keras weight), at row `fingerprint64(id) mod hash_bucket_size` (see
    `keras_rec_emb.layers.multi_hash_embedding.fingerprint64`), shared with
    the ids that collide there. Training lookups count each id; the one
    that brings its count to `promote_threshold` promotes it: it gets a
    collision-free row in an `EmbeddingVariable`, initialized with its
    current static row (so what it learnt carries over), and from then on is
    served and trained by that row only. With `promote_threshold=None`,
    ids move only by an explicit mask.

    `layer(ids, adaptive_mask=mask)` (a 0/1 tensor shaped like the ids; 1 =
    EV, 0 = static) routes ids by the mask instead of their promotion state,
    as DeepRec's `adaptive_mask_tensors`. In training an id masked 1 that
    has no EV row yet gets one, copied from its static row (its count
    restarts from that batch); in inference it reads its static row. Counting
    and frequency promotion go on under a mask.

    Under JAX the ids are dense (ragged and sparse ids are TensorFlow's),
    and ids < 0 (the JAX tables' padding) are always served by the static
    table: never counted or promoted.

    Train with an optimizer from `keras_rec_emb.optimizers`. `model.save`
    keeps both tables and the promotion state: which ids are promoted, their
    frequencies, and the counts of ids not promoted yet (unless
    `ev_option.save_filtered` is off).

    Args:
        embedding_dim: int > 0. Width of each embedding row.
        hash_bucket_size: int > 0. Rows of the static table.
        promote_threshold: int >= 1 or `None`. Training lookups after which
            an id is promoted to the EV; `None` never promotes by frequency.
            Defaults to `None`.
        initializer: Keras initializer of the static table (EV rows are
            copies of static rows). Defaults to `"truncated_normal"`.
        ev_option: `keras_rec_emb.EmbeddingVariableOption` or `None`: the
            EV's eviction (an evicted id falls back to the static table),
            shards and `save_filtered`. Its `filter_option` and
            `init_option` must be left unset: the layer uses them to count
            and copy.
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
