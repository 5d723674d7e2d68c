"""The `Example:` of every public docstring runs (doctest).

Modules are discovered, not listed: every module of the package whose
docstrings hold examples runs them, and every public name (the packages'
`__all__` and the top level) must have an example of its own.
"""

import doctest
import importlib
import inspect
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb

PACKAGE_DIR = pathlib.Path(keras_rec_emb.__file__).parent
PUBLIC_NAMESPACES = ["keras_rec_emb", "keras_rec_emb.callbacks", "keras_rec_emb.data",
                     "keras_rec_emb.distribute", "keras_rec_emb.layers", "keras_rec_emb.ops",
                     "keras_rec_emb.optimizers"]


def _globs():
    return {"keras": keras, "np": np, "tf": tf, "keras_rec_emb": keras_rec_emb}


def _module_names():
    names = [".".join(("keras_rec_emb", *p.relative_to(PACKAGE_DIR).with_suffix("").parts))
             for p in sorted(PACKAGE_DIR.rglob("*.py"))]
    return [n.removesuffix(".__init__") for n in names]


def _examples(module):
    finder = doctest.DocTestFinder()
    return [t for t in finder.find(module, globs=_globs()) if t.examples]


MODULES = [n for n in _module_names() if _examples(importlib.import_module(n))]


def test_discovery_finds_the_modules_with_examples():
    # A floor, not the list: each of these holds public examples today.
    assert {"keras_rec_emb.layers.embedding_variable", "keras_rec_emb.optimizers.deeprec_optimizers",
            "keras_rec_emb.data.parquet", "keras_rec_emb.ops.embedding_ops",
            "keras_rec_emb.callbacks", "keras_rec_emb.serving"} <= set(MODULES)
    # Modules whose every docstring example is counted (test_examples_run runs them).
    counts = {"keras_rec_emb.ops.embedding_ops": 4, "keras_rec_emb.ops.multi_dim_ops": 1,
              "keras_rec_emb.layers.group_embedding": 2}
    for name, count in counts.items():
        assert len(_examples(importlib.import_module(name))) == count, name
    assert {"keras_rec_emb.layers.multi_hash_embedding",
            "keras_rec_emb.layers.adaptive_embedding"} <= set(MODULES)


def _public_objects():
    for space in PUBLIC_NAMESPACES:
        module = importlib.import_module(space)
        names = getattr(module, "__all__", None) or [n for n in dir(module)
                                                     if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if ((inspect.isclass(obj) or inspect.isfunction(obj))
                    and obj.__module__.startswith("keras_rec_emb")):
                yield f"{space}.{name}", obj


def test_every_public_name_has_an_example():
    missing = [name for name, obj in _public_objects()
               if not [t for t in doctest.DocTestFinder(recurse=False).find(obj, globs={})
                       if t.examples]]
    assert not missing, f"public names without an `Example:` in their docstring: {missing}"


@pytest.mark.parametrize("module_name", MODULES)
def test_examples_run(module_name):
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = _examples(module)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= len(tests) and result.failed == 0
