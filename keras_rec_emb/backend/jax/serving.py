"""`export_for_serving` under Keras's JAX backend.

The stock-TensorFlow SavedModel is TensorFlow's own format, written by
tracing the model with TensorFlow. A process runs one Keras backend, so
the model goes across in the one format both backends read: it is saved
to a `.keras` file, and a child process under the TensorFlow backend loads
it (`compile=False`: serving needs no optimizer) and runs the TensorFlow
backend's `export_for_serving`. TensorFlow is needed for that step only,
in the child; this process never imports it.
"""

import os
import subprocess
import sys
import tempfile

from keras_rec_emb._checks_core import check_int

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CHILD = """
import sys
import keras
import keras_rec_emb
# The file is the one the parent wrote from its model a moment ago: its
# file-tier folders are the parent's own, wherever they are.
with keras_rec_emb.storage_root("/"):
    model = keras.saving.load_model(sys.argv[1], compile=False)
keras_rec_emb.export_for_serving(model, sys.argv[2], verbose=sys.argv[3] == "1",
                                 max_input_size=None if sys.argv[4] == "none" else int(sys.argv[4]))
"""

# As the TensorFlow backend's MAX_INPUT_SIZE (that module imports TensorFlow).
MAX_INPUT_SIZE = 2**24


def export_for_serving(model, filepath, input_signature=None, verbose=False, timeout=600,
                       max_input_size=MAX_INPUT_SIZE):
    """Exports `model`, trained under Keras's JAX backend, for inference as
    the SavedModel that the TensorFlow backend's `export_for_serving`
    writes: stock TensorFlow only, each table a stock hash table and a
    matrix of its rows (see that function). TensorFlow must be installed:
    a child process under the TensorFlow backend writes the export.

    Args:
        model: a built `keras.Model` whose layers save in the format both
            backends read (`model.save`).
        filepath: str or path-like. Directory to write the SavedModel to.
        input_signature: `None` only: the endpoint's signature is taken
            from the model's inputs (a `tf.TensorSpec` cannot be made
            under the JAX backend).
        verbose: bool. Print the endpoint's signature.
        timeout: seconds the child may take.
        max_input_size: int or `None`. The most elements one input tensor
            of a request may have (a larger one fails alone with
            InvalidArgument); `None` for no limit. Defaults to `2**24`.

    Returns:
        The path written.
    """
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model={model!r}")
    if not model.built:
        raise ValueError("`model` must be built (called once or given Inputs) before export.")
    if input_signature is not None:
        raise ValueError(
            "Under the JAX backend `input_signature` must be None (the endpoint takes the "
            f"model's inputs). Received: input_signature={input_signature!r}")
    max_input_size = check_int("max_input_size", max_input_size, minimum=1, allow_none=True)
    filepath = os.fspath(filepath)
    if os.path.exists(filepath) and not os.path.isdir(filepath):
        raise ValueError("`filepath` must be a directory for the SavedModel. Received: "
                         f"filepath={filepath!r}, an existing file")
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH"))
                                        if p)
    with tempfile.TemporaryDirectory(prefix="kre-serving-") as tmp:
        saved = os.path.join(tmp, "model.keras")
        model.save(saved)
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, saved, os.path.abspath(filepath),
             "1" if verbose else "0", "none" if max_input_size is None else str(max_input_size)],
            env=env, capture_output=True, text=True, timeout=timeout)
    if verbose and run.stdout:
        print(run.stdout, end="")
    if run.returncode != 0:
        if "No module named 'tensorflow'" in run.stderr:
            raise ImportError("export_for_serving writes a TensorFlow SavedModel: it needs "
                              "TensorFlow installed (pip install tensorflow-cpu), in a process "
                              "of its own under the JAX backend")
        raise RuntimeError("export_for_serving: the TensorFlow process that writes the "
                           f"SavedModel failed:\n{run.stderr[-4000:]}")
    return filepath
