"""`export_for_serving`: a SavedModel that stock TensorFlow serves without
this package, from a model trained under either backend (the work is the
backend's: backend/tensorflow/serving.py traces the model with stock
twins of its tables; backend/jax/serving.py hands it to a TensorFlow
process)."""

import os

import keras

from keras_rec_emb import _backend, _checks_core

__all__ = ["export_for_serving"]

# The most elements one input tensor of a request may have (2**24: a batch
# of 16,384 rows of 1,024 ids). Stock TensorFlow ops of the served graph
# size scratch by the request and some do not check that allocation (the
# CPU UnsortedSegmentSum's row counter, a std::vector): a request too large
# for the memory left ends the server process instead of failing alone.
MAX_INPUT_SIZE = 2**24


def export_for_serving(model: keras.Model, filepath: str | os.PathLike,
                       input_signature: list | tuple | dict | None = None,
                       verbose: bool = False,
                       max_input_size: int | None = MAX_INPUT_SIZE,
                       timeout: float = 600) -> str:
    """Exports `model` for inference as a SavedModel that needs only TensorFlow.

    `model.export` writes a SavedModel whose tables use this package's ops
    (so serving it needs `import keras_rec_emb`). This one does not: each
    embedding table becomes a stock `tf.lookup.experimental.MutableHashTable`
    (key to row number) and a dense `[N, dim]` matrix of its admitted rows,
    stored with the SavedModel's variables; fused group lookups become stock
    gathers and segment sums. Predictions equal `model(x, training=False)`:
    keys the table has read their rows, other keys read their initializer
    row (`default_values[key mod default_value_dim]`), or
    `no_permission_value` when the table has an admission filter. Keys
    counted by a filter but not admitted are not exported. The served
    tables are frozen: serving does not insert or count keys.

    A request whose input tensor has more than `max_input_size` elements
    fails alone with InvalidArgument, before any lookup: some stock ops the
    served graph runs end the process (not the request) when their scratch
    does not fit in memory.

    The export is atomic: it is written next to `filepath` and moved into
    place only once complete, so a failed export leaves a previous one
    intact.

    Under Keras's JAX backend the model is traced by TensorFlow in a child
    process (TensorFlow must be installed; this process never imports it):
    the model goes across as a `.keras` file, its signature as this
    process's, and the user's own classes from their modules, or those
    the script being run defines, from its source. A subclassed model's
    ids keep the dtypes of its first call under both backends, so no
    `input_signature` is needed once the model has been called on ids.

    Fresh rows for online serving: the stock export is frozen, so a TF
    Serving deployment picks up new rows the way TF Serving picks up any new
    model: export on a schedule (e.g. after each full or incremental
    checkpoint of `keras_rec_emb.callbacks.CheckpointCallback`) into a new
    numbered version folder of the model's base path
    (`export_for_serving(model, f"{base}/{int(time.time())}")`); TF
    Serving's file-system poller (`--file_system_poll_wait_seconds`) loads the
    newest version and, with the default version policy, unloads the older
    one once the new one serves. A server that runs this package's ops
    instead (a SavedModel from `model.export`, loaded with
    `tf.saved_model.load` after `import keras_rec_emb`) can apply each
    incremental checkpoint in place, without a reload:
    `keras_rec_emb.apply_to_saved_model(loaded, link_path)` (DeepRec's
    incremental model update).

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
