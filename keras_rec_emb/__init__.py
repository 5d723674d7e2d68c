"""keras_rec_emb: industrial sparse embeddings for Keras 3 (TensorFlow backend).

Dynamic hash-table embeddings (DeepRec's EmbeddingVariable) that train with
`model.fit`, sparse-aware optimizers that update them, saving with
`model.save`, and Parquet/Kafka input pipelines.
"""

import os as _os

from keras_rec_emb import _allocator

# Before anything runs a TensorFlow op: the CPU allocator is chosen when
# TensorFlow creates its devices (see _allocator for why and how to opt out).
_allocator.use_bfc_allocator()


def _require_tensorflow_backend(backend):
    if backend != "tensorflow":
        raise ImportError(
            "keras_rec_emb runs on Keras's TensorFlow backend, but the active "
            f"backend is {backend!r}. Set the environment variable "
            "KERAS_BACKEND=tensorflow before importing keras."
        )


# Checked before importing Keras too: another backend may fail to import.
if "KERAS_BACKEND" in _os.environ:
    _require_tensorflow_backend(_os.environ["KERAS_BACKEND"])

import keras as _keras  # noqa: E402

_require_tensorflow_backend(_keras.backend.backend())  # e.g. from keras.json

from keras_rec_emb import _ops  # noqa: E402

# Register the ops now, so that SavedModels using them load after import.
_ops.gen()

from keras_rec_emb import callbacks, data, distribute, layers, ops, optimizers  # noqa: E402,F401
from keras_rec_emb.options import (  # noqa: E402,F401
    CBFFilter,
    CounterFilter,
    EmbeddingVariableOption,
    GlobalStepEvict,
    InitializerOption,
    L2WeightEvict,
    StorageOption,
)
from keras_rec_emb.incremental import (  # noqa: E402,F401
    IncrementalCheckpointer,
    apply_to_saved_model,
)
from keras_rec_emb.saving import load_model, save_model  # noqa: E402,F401
from keras_rec_emb.serving import export_for_serving  # noqa: E402,F401

__version__ = "0.1.0"
