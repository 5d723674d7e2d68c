"""Runs the `Example:` sections of a public object's docstrings under the
test's backend (tests/test_docstrings.py runs every one under TensorFlow)."""

import doctest

import keras
import numpy as np

import keras_rec_emb as kre


def assert_examples_run(obj, name=None, tests=None, attempted=1):
    """The docstrings of `obj` (a class, a function, a module: each doctest
    its finder gives) with examples, `tests` of them (one at least when
    None), `attempted` examples in all at least: none fails."""
    globs = {"keras": keras, "np": np, "keras_rec_emb": kre}
    found = [t for t in doctest.DocTestFinder().find(obj, name, globs=globs) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in found:
        runner.run(test, out=lambda text: None)
    result = runner.summarize(verbose=False)
    assert found and len(found) == (tests or len(found)), [t.name for t in found]
    assert result.attempted >= attempted and result.failed == 0, result
