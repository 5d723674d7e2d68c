"""`export_for_serving` under Keras's JAX backend.

The stock-TensorFlow SavedModel is written by tracing the model with
TensorFlow, and a process runs one Keras backend: the model is saved to a
`.keras` file, which a child process under the TensorFlow backend loads
(`compile=False`) and exports with that backend's `export_for_serving`.
This process never imports TensorFlow.

The child must know the model's classes and its inputs:
- Classes of the user's own (a custom layer, a subclassed model, any
  registered custom object) are imported in the child from their modules,
  with this process's `sys.path`. Those defined in the script being run
  (`__main__`) have no module to import: their source, with what the
  script binds at top level (modules, imported names, simple constants,
  its other classes and functions), is run in the child's `__main__`,
  without running the script itself.
- The endpoint's signature is this process's (`_keras_fixes.input_specs`:
  a subclassed model's ids keep their dtype), sent to the child as JSON.
"""

import base64
import inspect
import json
import os
import pickle
import subprocess
import sys
import tempfile
import types
import zipfile


_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CHILD = """
import importlib
import json
import sys
import keras
import tensorflow as tf
import keras_rec_emb
with open(sys.argv[5]) as f:
    setup = json.load(f)
exec(compile(setup["main"], "<__main__ of the exporting process>", "exec"), globals())
custom_objects = {}
for module, name, registered in setup["classes"]:
    found = globals() if module == "__main__" else vars(importlib.import_module(module))
    for part in name.split("."):
        found = found[part] if isinstance(found, dict) else getattr(found, part)
    custom_objects[registered] = found
def spec(s):
    if isinstance(s, dict) and s.get("kre_spec"):
        return tf.TensorSpec([None if d is None else d for d in s["shape"]], s["dtype"], s["name"])
    if isinstance(s, dict):
        return {k: spec(v) for k, v in s.items()}
    return [spec(v) for v in s]
# The file is the one the parent wrote from its model a moment ago: its
# file-tier folders are the parent's own, wherever they are.
with keras_rec_emb.storage_root("/"):
    model = keras.saving.load_model(sys.argv[1], compile=False, custom_objects=custom_objects)
keras_rec_emb.export_for_serving(model, sys.argv[2], input_signature=spec(setup["signature"]),
                                 verbose=sys.argv[3] == "1",
                                 max_input_size=None if sys.argv[4] == "none" else int(sys.argv[4]))
"""

# Modules whose classes the child imports anyway (the package's, Keras's) or
# that hold no Keras objects.
_KNOWN = ("keras", "keras_rec_emb", "builtins", "numpy", "jax", "jaxlib", "tensorflow")


def _is_known(module):
    return module is None or module.split(".")[0] in _KNOWN


def _saved_names(path):
    """Every `registered_name` and `class_name` the `.keras` file's config
    holds (the objects the child must find to load it)."""
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    names, todo = set(), [config]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in ("registered_name", "class_name"):
                if isinstance(node.get(key), str):
                    names.add(node[key])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return names


def _user_classes(model, saved):
    """`(module, name, registered name)` of the user's classes the saved
    model holds (its layers', the model's, and any registered custom object
    its config names): the child imports each from its module (`__main__`:
    `_main_source`'s code) and loads with them as `custom_objects`, as
    Keras finds a class whose registration it was not told."""
    import keras

    from keras_rec_emb import _keras_fixes

    names = _saved_names(saved)
    objects = [type(layer) for layer in _keras_fixes.flatten_layers(model)]
    objects += [obj for name, obj in keras.saving.get_custom_objects().items()
                if name in names]
    found = {}
    for obj in objects:
        module = getattr(obj, "__module__", None)
        if not _is_known(module) and isinstance(obj, type):
            found[keras.saving.get_registered_name(obj)] = (module, obj.__qualname__)
    return [(module, name, registered) for registered, (module, name) in sorted(found.items())]


def _main_source(needed):
    """What the script being run (`__main__`) binds at top level, as code
    that recreates it in the child without running it: its imports, simple
    constants, the source of its classes and functions, in order, then its
    other objects that pickle (not framework layers, variables, optimizers
    or arrays, nor any over 1 MiB). A definition whose source cannot be read
    (`python -c`, a REPL) is left out, unless it is one of `needed` (the
    model's classes defined there)."""
    import keras

    main = sys.modules.get("__main__")
    lines, defined, pickled = [], [], []
    stateful = (keras.layers.Layer, keras.Variable, keras.optimizers.Optimizer,
                keras.callbacks.Callback)
    for name, value in list(vars(main).items()) if main is not None else ():
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            lines.append(f"import {value.__name__} as {name}")
        elif isinstance(value, (type, types.FunctionType)):
            module = getattr(value, "__module__", None)
            if module == "__main__":
                defined.append((name, value))
            elif module and getattr(value, "__qualname__", None) == getattr(value, "__name__", 0):
                lines.append(f"from {module} import {value.__name__} as {name}")
        elif isinstance(value, (bool, int, float, str, bytes, type(None))):
            lines.append(f"{name} = {value!r}")
        elif not isinstance(value, stateful) and type(value).__module__.split(".")[0] not in (
                "jax", "jaxlib", "tensorflow"):
            try:
                data = pickle.dumps(value)
            except Exception:  # pylint: disable=broad-except  (not needed, or not picklable)
                continue
            if len(data) <= 1 << 20:
                pickled.append(f"{name} = __import__('pickle').loads("
                               f"__import__('base64').b64decode({base64.b64encode(data)!r}))")
    blocks = []
    for name, value in defined:
        try:
            source, start = inspect.getsourcelines(value)
        except (OSError, TypeError) as e:
            if name not in needed:
                continue
            raise ValueError(
                f"export_for_serving under the JAX backend runs the export in a TensorFlow "
                f"process, which needs the source of {name!r} (defined in __main__), but its "
                "source cannot be read (defined interactively?). Define it in a module file "
                f"or a script. ({e})") from None
        blocks.append((start, "".join(source)))
    return "\n".join(lines + [b for _, b in sorted(blocks, key=lambda b: b[0])] + pickled) + "\n"


def _signature(model):
    """The endpoint's signature as JSON: `{"kre_spec": 1, shape, dtype,
    name}` for each input, in the structure `input_specs` gives."""
    import keras

    from keras_rec_emb import _keras_fixes

    def encode(spec):
        if isinstance(spec, keras.InputSpec):
            return {"kre_spec": 1, "shape": list(spec.shape), "dtype": spec.dtype,
                    "name": spec.name}
        if isinstance(spec, dict):
            return {k: encode(v) for k, v in spec.items()}
        return [encode(v) for v in spec]

    return encode(_keras_fixes.input_specs(model))


def export(model, filepath, input_signature, verbose, max_input_size, timeout):
    """`keras_rec_emb.export_for_serving` under JAX (its arguments checked
    there): a TensorFlow child process writes the SavedModel (see the top)."""
    if input_signature is not None:
        raise ValueError(
            "Under the JAX backend `input_signature` must be None (the endpoint takes the "
            f"model's inputs). Received: input_signature={input_signature!r}")
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    # The package, then this process's own path: the child imports the
    # user's modules from where this process found them.
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys(p for p in (_PACKAGE_PARENT, *sys.path) if p and os.path.isdir(p)))
    with tempfile.TemporaryDirectory(prefix="kre-serving-") as tmp:
        saved = os.path.join(tmp, "model.keras")
        model.save(saved)
        setup = os.path.join(tmp, "setup.json")
        with open(setup, "w") as f:
            classes = _user_classes(model, saved)
            needed = {name for module, name, _ in classes if module == "__main__"}
            json.dump({"classes": classes, "main": _main_source(needed),
                       "signature": _signature(model)}, f)
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, saved, os.path.abspath(filepath),
             "1" if verbose else "0", "none" if max_input_size is None else str(max_input_size),
             setup],
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
