"""The backend-free half of `AdaptiveEmbedding`: its arguments, inner
EmbeddingVariable, static table, promotion state and config, the same under
both backends; the forward is the backend's `adaptive` module."""

import math

import keras
import numpy as np

from keras_rec_emb import options as options_lib
from keras_rec_emb._checks_core import check_combiner
from keras_rec_emb._checks_core import positive_int
from keras_rec_emb._multi_hash_spec import MultiHashSpec, output_shape
from keras_rec_emb.options import deserialize_ev_option, ev_option_or_default


class AdaptiveSpec:
    """The backend-free half of AdaptiveEmbedding (a mixin of
    `keras.layers.Layer`)."""

    def init_spec(self, embedding_dim, hash_bucket_size, promote_threshold, initializer,
                  ev_option, combiner, embedding_variable):
        """Checks and keeps the arguments; `embedding_variable` is the
        backend's EmbeddingVariable class, of which `dynamic` is made."""
        positive_int("embedding_dim", embedding_dim)
        positive_int("hash_bucket_size", hash_bucket_size)
        t = promote_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, np.integer))
                              or t < 1):
            raise ValueError(
                "`promote_threshold` must be None or an integer >= 1. Received: "
                f"promote_threshold={t!r}"
            )
        check_combiner(combiner)
        ev_option = ev_option_or_default(ev_option)
        if ev_option.filter_option is not None:
            raise ValueError(
                "AdaptiveEmbedding counts ids for promotion itself; set "
                "`promote_threshold` instead of a filter. Received: "
                f"ev_option.filter_option={ev_option.filter_option!r}"
            )
        if ev_option.init_option != options_lib.InitializerOption():
            raise ValueError(
                "AdaptiveEmbedding initializes EV rows from the static table; "
                "`ev_option.init_option` must be left unset. Received: "
                f"ev_option.init_option={ev_option.init_option!r}"
            )
        self.embedding_dim = int(embedding_dim)
        self.hash_bucket_size = int(hash_bucket_size)
        self.promote_threshold = None if t is None else int(t)
        self.initializer = keras.initializers.get(initializer)
        self.ev_option = ev_option
        self.combiner = combiner
        # The EV's own option: +inf initial rows and NaN no-permission
        # values are the sentinels that tell promotion states apart.
        init_option = options_lib.InitializerOption(
            initializer=keras.initializers.Constant(math.inf), default_value_dim=1)
        # Set past the check that refuses NaN from users: here it is a sentinel.
        init_option.default_value_no_permission = math.nan
        inner = options_lib.EmbeddingVariableOption(
            init_option=init_option,
            filter_option=(None if t is None else options_lib.CounterFilter(int(t))),
            evict_option=ev_option.evict_option, storage_option=ev_option.storage_option,
            num_shards=ev_option.num_shards, track_meta=True,
            save_filtered=ev_option.save_filtered,
            # Promoted ids keep counting (their `promoted_freqs`).
            record_freq=True,
        )
        self.dynamic = embedding_variable(self.embedding_dim, ev_option=inner,
                                         name=f"{self.name}_dynamic")
        self.static_embeddings = None

    ids_input_dtype = MultiHashSpec.ids_input_dtype

    def build(self, input_shape=None):
        if self.built:
            return
        self.static_embeddings = self.add_weight(
            shape=(self.hash_bucket_size, self.embedding_dim), initializer=self.initializer,
            name="static_embeddings")
        self.dynamic.build()
        self.built = True

    def _require_built(self, what):
        if not self.built:
            raise ValueError(
                f"AdaptiveEmbedding '{self.name}' is not built yet; call it on ids "
                f"(or build it) before {what}."
            )

    def promoted_ids(self):
        """The ids with an EV row (promoted), sorted, as a NumPy array."""
        self._require_built("promoted_ids()")
        return np.sort(self.dynamic.export()["keys"])

    def promotion_state(self):
        """dict of NumPy arrays: `promoted_ids` and their `promoted_freqs`
        (training lookups seen), `counting_ids` and their `counting_freqs`
        (ids counted but not promoted yet), each sorted by id."""
        self._require_built("promotion_state()")
        data = self.dynamic.export()
        order = np.argsort(data["keys"])
        order_f = np.argsort(data["keys_filtered"])
        return {
            "promoted_ids": data["keys"][order],
            "promoted_freqs": data["freqs"][order],
            "counting_ids": data["keys_filtered"][order_f],
            "counting_freqs": data["freqs_filtered"][order_f],
        }

    def compute_output_shape(self, input_shape, adaptive_mask_shape=None):
        return output_shape(input_shape, self.combiner, self.embedding_dim)

    def get_config(self):
        config = super().get_config()
        config.update({
            "embedding_dim": self.embedding_dim,
            "hash_bucket_size": self.hash_bucket_size,
            "promote_threshold": self.promote_threshold,
            "initializer": keras.initializers.serialize(self.initializer),
            "ev_option": keras.saving.serialize_keras_object(self.ev_option),
            "combiner": self.combiner,
        })
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**deserialize_ev_option(config))
