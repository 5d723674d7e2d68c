"""keras_rec_emb: industrial sparse embeddings for Keras 3 (TensorFlow and JAX backends).

Dynamic hash-table embeddings (DeepRec's EmbeddingVariable) that train with
`model.fit`, sparse-aware optimizers that update them, saving with
`model.save`, and Parquet/Kafka input pipelines.
"""

import warnings as _warnings

from keras_rec_emb import _backend
from keras_rec_emb.backend.tensorflow import allocator as _allocator
from keras_rec_emb._version import __version__

# Under Keras's JAX backend the tables go through XLA's FFI (keras_rec_emb/backend/jax,
# `make jax-ops`) and TensorFlow is neither imported nor needed; `distribute` and
# `ops` are TensorFlow-only, and say so when asked for.
if _backend.is_jax():
    from keras_rec_emb.backend.jax import use_64_bit_ids

    # Before any array is made: ids are 64-bit (see use_64_bit_ids).
    use_64_bit_ids()
else:
    # Before anything runs a TensorFlow op: the CPU allocator is chosen when
    # TensorFlow creates its devices (see _allocator for why and how to opt out).
    _allocator.use_bfc_allocator()


    def _require_tensorflow_backend(backend):
        if backend != "tensorflow":
            raise ImportError(
                "keras_rec_emb runs on Keras's TensorFlow and JAX backends, but the "
                f"active backend is {backend!r} (from KERAS_BACKEND or keras.json). Set "
                "the environment variable KERAS_BACKEND=tensorflow (or jax) before "
                "importing keras."
            )


    # Checked before importing Keras too: another backend may fail to import.
    _require_tensorflow_backend(_backend.backend())

    # The TensorFlow distributions that provide the `tensorflow` module. None of
    # them is a dependency of keras-rec-emb: a dependency on one would install it
    # over another (`tensorflow-cpu` over a GPU `tensorflow`), so the user picks
    # one, or the extra `[cpu]` / `[gpu]` does.
    _TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu",
                                "tensorflow-intel", "tf-nightly", "tf-nightly-cpu")
    _INSTALL_TENSORFLOW = (
        "Install TensorFlow 2.21 with the package: `pip install \"keras-rec-emb[cpu]\"` "
        "(tensorflow-cpu) or `pip install \"keras-rec-emb[gpu]\"` (tensorflow, with "
        "CUDA), or install either distribution yourself.")


    def _require_tensorflow():
        """Imports TensorFlow, or raises an ImportError that says how to install
        it (a TensorFlow that is installed but fails to import raises as is)."""
        try:
            import tensorflow  # noqa: F401  (imported to find out whether it imports)
        except ModuleNotFoundError as e:
            if e.name != "tensorflow":
                raise
            raise ImportError(
                f"keras_rec_emb needs TensorFlow, which is not installed. {_INSTALL_TENSORFLOW}"
            ) from e


    def _installed_tensorflow_distributions():
        from importlib import metadata

        found = []
        for name in _TENSORFLOW_DISTRIBUTIONS:
            try:
                found.append(f"{name}=={metadata.version(name)}")
            except metadata.PackageNotFoundError:
                pass
        return found


    def _warn_if_several_tensorflows():
        """Two TensorFlow distributions share the `tensorflow` folder: whichever
        was installed last overwrote the other's files, and uninstalling one
        removes files the other needs. Said once at import, with the fix."""
        found = _installed_tensorflow_distributions()
        if len(found) > 1:
            _warnings.warn(
                f"Several TensorFlow distributions are installed ({', '.join(found)}); they "
                "write the same `tensorflow` package, so it is whichever was installed last, "
                "and uninstalling one breaks the other. Keep one: `pip uninstall "
                + " ".join(f.split("==")[0] for f in found)
                + "`, then install the one you want (`pip install \"keras-rec-emb[cpu]\"` or "
                "`[gpu]`).", RuntimeWarning, stacklevel=2)


    _require_tensorflow()
    _warn_if_several_tensorflows()

    import keras as _keras

    _require_tensorflow_backend(_keras.backend.backend())  # e.g. from keras.json


    def _check_keras_version(version):
        """Warns when Keras `version` is not one whose internals `_compat`'s
        corrections were checked against: those are then not installed, and the
        behaviours they fix are Keras's own."""
        from keras_rec_emb.backend.tensorflow import compat as _compat

        # Every `_compat.KERAS_*_FIX_VERSIONS`: the versions each correction is
        # installed for.
        lists = [v for k, v in vars(_compat).items()
                 if k.startswith("KERAS_") and k.endswith("_FIX_VERSIONS")]
        verified = sorted(set.intersection(*map(set, lists)))
        if version not in verified:
            _warnings.warn(
                f"keras_rec_emb {__version__} was checked with Keras {', '.join(verified)}, "
                f"but Keras {version} is installed: its corrections of Keras internals "
                "(int ids in a Sequential model without an Input, mixed-precision "
                "compile of our optimizers, export of subclassed models, logs under "
                "MultiWorkerMirroredStrategy) are not installed for this version. Install "
                f"keras=={verified[-1]}.", RuntimeWarning, stacklevel=2)


    _check_keras_version(_keras.__version__)

    from keras_rec_emb.backend.tensorflow import ops as _ops

    # Register the ops now, so that SavedModels using them load after import.
    _ops.gen()


from keras_rec_emb import callbacks, data, layers, optimizers
from keras_rec_emb.incremental import IncrementalCheckpointer, apply_to_saved_model
from keras_rec_emb.options import (CBFFilter, CounterFilter, EmbeddingVariableOption,
                                   GlobalStepEvict, InitializerOption, L2WeightEvict,
                                   StorageOption)
from keras_rec_emb.saving import load_model, save_model, storage_root
from keras_rec_emb.serving import export_for_serving

__all__ = ["__version__", "export_for_serving", "layers", "optimizers", "CBFFilter",
           "CounterFilter", "EmbeddingVariableOption", "GlobalStepEvict",
           "InitializerOption", "L2WeightEvict", "StorageOption", "save_model",
           "load_model", "storage_root", "callbacks", "data", "IncrementalCheckpointer",
           "apply_to_saved_model"]
if _backend.is_jax():
    from keras_rec_emb.backend.jax import tensorflow_only_getattr

    __getattr__ = tensorflow_only_getattr("keras_rec_emb", ("distribute", "ops"), __all__[1:])
else:
    from keras_rec_emb import distribute, ops

    __all__ += ["distribute", "ops"]


def __dir__():
    # dir() and completion list the public API only, not the modules that
    # implement it (`_ops`, `variables`, ...) nor this file's helpers.
    return list(__all__)
