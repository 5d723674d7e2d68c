"""Whether the graph this thread traces is a serving graph of stock TensorFlow
ops: `export_for_serving` traces inside `stock_tables(read)`, where every
table lookup (decorated by `served`) reads the table's stock twin
`read(table)`, and layers leave out ops with no stock form (`tracing_stock()`).
Thread-local, so a trainer in another thread keeps the package's ops.
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
