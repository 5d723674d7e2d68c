"""Which Keras backend this process runs: the one place the package asks.

Keras picks its backend when first imported: `KERAS_BACKEND`, else the
`"backend"` of `keras.json` in `KERAS_HOME` (`~/.keras`, or `/tmp/.keras`
when the home folder is not writable), else TensorFlow. Before Keras is
imported the same rule is applied here, because importing Keras imports the
backend, and JAX's 64-bit mode must be on before any array is made.
"""

import json
import os
import sys


def _configured():
    """Keras's own rule (keras/src/backend/config.py), without importing it."""
    if "KERAS_HOME" in os.environ:
        keras_dir = os.environ["KERAS_HOME"]
    else:
        base = os.path.expanduser("~")
        if not os.access(base, os.W_OK):
            base = "/tmp"
        keras_dir = os.path.join(base, ".keras")
    backend = "tensorflow"
    path = os.path.expanduser(os.path.join(keras_dir, "keras.json"))
    if os.path.exists(path):
        try:
            with open(path) as f:
                backend = json.load(f).get("backend", backend)
        except (OSError, ValueError, AttributeError):
            # Keras ignores an unreadable keras.json the same way.
            pass
    return os.environ.get("KERAS_BACKEND", backend)


def backend():
    """The name of the Keras backend ("tensorflow", "jax", ...)."""
    keras = sys.modules.get("keras")
    config = getattr(keras, "config", None)
    if config is not None and hasattr(config, "backend"):
        return config.backend()
    return _configured()


def is_jax():
    return backend() == "jax"
