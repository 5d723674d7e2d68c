"""`export_for_serving`: a SavedModel that stock TensorFlow serves without this
package, from either backend (the work is the backend's `serving` module)."""

import os

import keras

from keras_rec_emb import _backend, _checks_core

__all__ = ["export_for_serving"]

# The most elements one input tensor of a request may have: some stock ops of
# the served graph end the process when their scratch does not fit
# (docs/semantics.md, 'Serving').
MAX_INPUT_SIZE = 2**24


def export_for_serving(model: keras.Model, filepath: str | os.PathLike,
                       input_signature: list | tuple | dict | None = None,
                       verbose: bool = False,
                       max_input_size: int | None = MAX_INPUT_SIZE,
                       timeout: float = 600) -> str:
    """Exports `model` for inference as a SavedModel that needs only TensorFlow.

    Each table becomes a stock `tf.lookup.experimental.MutableHashTable` and a
    dense matrix of its admitted rows, frozen; predictions equal
    `model(x, training=False)`. The export is atomic. See docs/semantics.md,
    'Serving'.

    Args:
        model: a built `keras.Model`.
        filepath: str or path-like. Directory to write the SavedModel to.
        input_signature: optional structure of `tf.TensorSpec` /
            `keras.InputSpec` for the endpoint, as in `model.export`
            (TensorFlow backend; under JAX `None` only). Defaults to
            `None`: taken from the model's inputs.
        verbose: bool. Print the endpoint's signature. Defaults to `False`.
        max_input_size: int or `None`. The most elements one input tensor
            of a request may have; `None` for no limit. Defaults to `2**24`
            (16,777,216: 128 MiB of int64 ids).
        timeout: seconds the TensorFlow process may take under the JAX
            backend (unused under TensorFlow). Defaults to 600.

    Returns:
        The path written.

    Example:

    >>> import os, sys, subprocess, tempfile
    >>> ev = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")
    >>> inputs = keras.Input((3,), dtype="int64")
    >>> model = keras.Model(inputs, keras.layers.Dense(1)(ev(inputs)))
    >>> _ = model(np.array([[1, 2, 3]]), training=True)  # insert some keys
    >>> path = os.path.join(tempfile.mkdtemp(), "serving")
    >>> _ = keras_rec_emb.export_for_serving(model, path)
    >>> code = ("import sys, tensorflow as tf; m = tf.saved_model.load(sys.argv[1]); "
    ...         "print(m.serve(tf.constant([[1, 2, 7]], tf.int64)).shape, "
    ...         "'keras_rec_emb' in sys.modules)")
    >>> print(subprocess.run([sys.executable, "-c", code, path], capture_output=True,
    ...                      text=True).stdout.strip())
    (1, 1) False
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model={model!r}")
    if not model.built:
        raise ValueError("`model` must be built (called once or given Inputs) before export.")
    filepath = os.fspath(filepath)
    if os.path.exists(filepath) and not os.path.isdir(filepath):
        raise ValueError(
            f"`filepath` must be a directory for the SavedModel. Received: "
            f"filepath={filepath!r}, an existing file")
    max_input_size = _checks_core.check_int("max_input_size", max_input_size, minimum=1,
                                            allow_none=True)
    if _backend.is_jax():
        from keras_rec_emb.backend.jax import serving as _impl

        return _impl.export(model, filepath, input_signature, verbose, max_input_size, timeout)
    from keras_rec_emb.backend.tensorflow import serving as _impl

    return _impl.export(model, filepath, input_signature, verbose, max_input_size)
