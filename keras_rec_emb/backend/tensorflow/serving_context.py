"""How the graph this thread traces reads embedding tables: the one place
that says whether it is a serving graph of stock TensorFlow ops.

A model is served from one of two graphs, both its inference path
(`model(x, training=False)`: nothing inserted or counted):

- `model.export` (Keras) traces it with the package's own ops: the state
  outside `stock_tables`, where this module changes nothing.
- `serving.export_for_serving` traces it inside `stock_tables(read)`: there,
  in the tracing thread only, every table lookup (each table kind's
  `lookup` is decorated by `served`) and every fused group lookup read the
  table's stock twin `read(table)` (an object with `lookup(keys)`), and
  layers leave out the package's ops that have no stock form
  (`tracing_stock()`).

The state is thread-local, not an attribute of the tables: a trainer in
another thread keeps the package's ops while a model is exported.
"""

import contextlib
import functools
import threading

_STATE = threading.local()

INSERT_ERROR = "export_for_serving traces inference only (insert=False)."


@contextlib.contextmanager
def stock_tables(read):
    """Inside (in this thread), tables are read through `read(table)`, their
    stock twin; nested uses restore the outer one on exit."""
    previous = getattr(_STATE, "read", None)
    _STATE.read = read
    try:
        yield
    finally:
        _STATE.read = previous


def stock_reader():
    """The `read` of the innermost `stock_tables` of this thread, or None
    (the package's own ops)."""
    return getattr(_STATE, "read", None)


def tracing_stock():
    """Whether this thread traces a graph that must hold stock TensorFlow
    ops only (inside `stock_tables`)."""
    return stock_reader() is not None


def served(lookup):
    """Declares a table kind's `lookup(self, keys, insert=False)` as read
    through its stock twin inside `stock_tables` (an inference lookup only:
    `insert=True` is refused there); elsewhere it runs as written."""

    @functools.wraps(lookup)
    def wrapper(self, keys, insert=False):
        read = stock_reader()
        if read is None:
            return lookup(self, keys, insert)
        if insert:
            raise ValueError(INSERT_ERROR)
        return read(self).lookup(keys)

    return wrapper
