"""The package's version: the one place it is written.

`pyproject.toml` reads it for the distribution's metadata
(`[tool.setuptools.dynamic]`), and `keras_rec_emb.__version__` re-exports it.
"""

__version__ = "0.2.0"
