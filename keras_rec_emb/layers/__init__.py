"""Embedding layers backed by dynamic hash tables."""

from keras_rec_emb import _backend
from keras_rec_emb._keras_fixes import (dispatch_jax_trainer_steps, fix_sequential_ids_input,
                                        record_model_input_dtypes)
# Written once for both backends.
from keras_rec_emb.layers.adaptive_embedding import AdaptiveEmbedding
from keras_rec_emb.layers.configs import FeatureConfig, TableConfig
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.layers.group_embedding import FeatureSpec, GroupEmbedding
from keras_rec_emb.layers.multi_hash_embedding import MultiHashEmbedding
from keras_rec_emb.layers.string_ids import HashStrings

# A Sequential without keras.Input gives our id layers int ids, not float32
# (see _keras_fixes.fix_sequential_ids_input).
fix_sequential_ids_input()
# A subclassed model exports its ids as ids (see _keras_fixes.input_specs).
record_model_input_dtypes()
if not _backend.is_jax():
    from keras_rec_emb.backend.tensorflow import compat as _compat

    # A subclassed model holding them exports (see _compat.fix_subclassed_save_signature).
    _compat.fix_subclassed_save_signature()
else:
    from keras_rec_emb.backend.jax import dispatch as _dispatch

    # Keras's jitted steps holding table calls skip JAX's Python dispatch
    # (see _keras_fixes.dispatch_jax_trainer_steps).
    dispatch_jax_trainer_steps(lambda jitted: _dispatch.OrderedJit(jitted))

__all__ = ["AdaptiveEmbedding", "EmbeddingVariable", "FeatureConfig", "FeatureSpec",
           "GroupEmbedding", "HashStrings", "MultiHashEmbedding", "TableConfig"]


def __dir__():
    return list(__all__)  # the public names only, not the implementing modules
