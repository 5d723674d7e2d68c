"""Which public names each Keras backend offers, for the API reference.

`make docs` renders the docstrings under the TensorFlow backend, where every
name exists; this script asks the package itself under each backend, so the
reference's availability table is what `import keras_rec_emb` does, not a
list kept by hand. Run by docs/hooks.py in child processes (Keras picks its
backend once per process):

    KERAS_BACKEND=tensorflow python docs/api_backends.py
        prints {module: [public names]} (each module's `__all__`)
    KERAS_BACKEND=jax python docs/api_backends.py < that JSON
        prints {module: {name: null | the error asking for it raises}}
"""

import json
import sys

MODULES = ("keras_rec_emb", "keras_rec_emb.layers", "keras_rec_emb.optimizers",
           "keras_rec_emb.callbacks", "keras_rec_emb.ops", "keras_rec_emb.data",
           "keras_rec_emb.distribute")


def _public_names():
    import importlib

    out = {}
    for name in MODULES:
        module = importlib.import_module(name)
        out[name] = [n for n in module.__all__
                     if n != "__version__" and f"{name}.{n}" not in MODULES]
    return out


def _reached(path):
    """The object at dotted `path`, reached by attribute access from the
    package as a user's code reaches it (never importing a submodule that
    the package does not offer under this backend)."""
    import keras_rec_emb

    obj = keras_rec_emb
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _availability(names):
    out = {}
    for module, members in names.items():
        try:
            _reached(module)
            reason = None
        except AttributeError as e:
            reason = str(e)
        if reason is not None:
            out[module] = {name: reason for name in members}
            continue
        out[module] = {}
        for name in members:
            try:
                _reached(f"{module}.{name}")
                out[module][name] = None
            except AttributeError as e:
                out[module][name] = str(e)
    return out


def main():
    import keras

    backend = keras.config.backend()
    if backend == "tensorflow":
        json.dump(_public_names(), sys.stdout)
    else:
        result = _availability(json.load(sys.stdin))
        if backend == "jax" and "tensorflow" in sys.modules:
            raise SystemExit("importing keras_rec_emb under JAX imported TensorFlow")
        json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
