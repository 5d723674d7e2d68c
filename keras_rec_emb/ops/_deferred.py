# Copyright keras_rec_emb authors. Apache-2.0.
"""Deferred lookups: the `EmbeddingVariable` calls of one traced step
looked up together, in one fused op.

A model written the natural way, one pooled layer per feature, would run
one fused-lookup op per layer (with its small ops around it) and, under
`MultiWorkerMirroredStrategy`, one exchange per layer. A `GroupEmbedding`
over the same tables runs one op and one exchange. So that the natural
code costs what the group costs, a layer with a combiner (or without one,
on dense ids: each id a row, a "sum" of one id) called while a
`tf.function` is traced (Keras's `fit`, `evaluate` and `predict` steps
among them) returns a `DeferredRows` instead of a tensor: its shape and
dtype are known, its rows are not looked up yet. The first time any of
them is used (converted to a tensor: by any TensorFlow op, Keras op or
layer), every deferred call of that graph made so far in this thread is
looked up in one `KRE>GroupLookup` (`embedding_ops.layers_lookup`).
`tf.concat` of exactly those calls takes the op's own side-by-side output
(no concatenation copy), and stacked ids split with `tf.unstack` are read
where they are, as a `GroupEmbedding` reads them. Calls whose rows are
never used are looked up when the traced function ends (before its
automatic control dependencies are drawn), as an eager call would have
been: a training call's inserts and counts are never dropped.

Not deferred (looked up at the call, as before): eager calls, Keras's
symbolic shape inference, XLA-compiled functions (which refuse the
lookup), graphs traced for stock serving, graphs without automatic
control dependencies (TF1-style graphs), and layers with an activity
regularizer (Keras computes it on the output tensor).
"""

import threading
import typing
import weakref

import numpy as np
import tensorflow as tf

from keras_rec_emb import _compat, _serving_context


class LayerCall:
    """One pooled layer call: what `embedding_ops.layers_lookup` needs to
    look it up (`insert`: a training call of a trainable layer) and, when
    deferred, its graph, shape and dtype, and its rows once looked up
    (`value`, or `source`: (side-by-side output, first column, end column)
    when they were looked up for a concatenation)."""

    __slots__ = ("layer", "table", "inputs", "weights", "insert", "single", "combiner", "prune",
                 "graph", "shape", "dtype", "value", "source")

    def __init__(self, layer, table, inputs, weights, insert, single=False):
        self.layer, self.table, self.inputs, self.weights = layer, table, inputs, weights
        self.insert = insert
        # `single`: a layer without a combiner, each id its own row (a "sum"
        # of one id, every id a key), rows `ids.shape + [dim]`.
        self.single = single
        self.combiner = "sum" if single else layer.combiner
        self.prune = False if single else layer.prune_invalid_ids
        self.graph = self.shape = self.dtype = self.value = self.source = None


# `embedding_ops.layers_lookup` (which imports this module): looks calls up.
layers_lookup = None

_LOCAL = threading.local()  # .pending: {graph: [LayerCall, ...]} of this thread


def _pending(graph, create=False):
    pending = getattr(_LOCAL, "pending", None)
    if pending is None:
        pending = _LOCAL.pending = weakref.WeakKeyDictionary()
    calls = pending.get(graph)
    if calls is None and create:
        calls = pending[graph] = []
        # Calls never used are looked up before the function's control
        # dependencies are drawn (so that they run); see the module.
        _compat.before_control_dependencies(graph, lambda: _flush(graph, calls))
    return calls


def can_defer(layer):
    """Whether a pooled call of `layer` here may be deferred (see the
    module: a traced graph with automatic control dependencies)."""
    if tf.executing_eagerly() or _compat.in_symbolic_build() or _compat.in_xla_context():
        return False  # (under XLA the lookup refuses at the call, with its error)
    if _serving_context.tracing_stock() or getattr(layer, "activity_regularizer", None):
        return False
    return _compat.has_control_dependencies(tf.compat.v1.get_default_graph())


def defer(call, shape, dtype):
    """A `DeferredRows` for one pooled layer call (a `LayerCall`, its ids
    checked already) whose rows have `shape` and `dtype`."""
    call.graph = tf.compat.v1.get_default_graph()
    call.shape, call.dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
    _pending(call.graph, create=True).append(call)
    return DeferredRows(call)


def _flush(graph, calls, concat=None):
    """Looks up every call not looked up yet of `calls` (a graph's pending
    list, emptied), in one op per insert flag; with `concat` (calls, in
    order, that are exactly those calls) returns their side-by-side rows."""
    todo = [c for c in calls if c.value is None and c.source is None]
    calls.clear()
    if not todo:
        return None
    with graph.as_default():
        by_insert = {}
        for c in todo:
            by_insert.setdefault(c.insert, []).append(c)
        if concat is not None and len(by_insert) == 1:
            width = 0
            out = layers_lookup(concat, concat=True)
            for c in concat:
                dim = c.shape[-1]
                c.source = (out, width, width + dim)
                width += dim
            return out
        for group in by_insert.values():
            for c, value in zip(group, layers_lookup(group)):
                c.value = value
    return None


def _rows(call):
    """The call's rows, looking it (and every other pending call of its
    graph in this thread) up first if needed."""
    if call.value is None and call.source is None:
        pending = _pending(call.graph)
        if pending is None or call not in pending:  # made in another thread
            pending = [call]
        _flush(call.graph, pending)
    if call.value is None:
        out, start, stop = call.source
        with call.graph.as_default():
            call.value = out[:, start:stop]
    return call.value


class DeferredRows:
    """The pooled rows of one `EmbeddingVariable` call in a traced graph,
    looked up when first used (see `keras_rec_emb.ops._deferred`). Converts
    to a tensor wherever one is expected; `shape` and `dtype` are known
    without a lookup."""

    def __init__(self, call):
        self._call = call

    @property
    def shape(self):
        return self._call.shape

    @property
    def dtype(self):
        return self._call.dtype

    @property
    def ndim(self):
        return self._call.shape.rank

    def get_shape(self):
        return self._call.shape

    def to_tensor(self):
        """The rows as a `tf.Tensor` (looked up now if not yet)."""
        return _rows(self._call)

    def __array__(self, dtype=None, copy=None):
        # Keras converts array-likes it is given through this attribute's
        # presence; a traced tensor has no values, as TensorFlow says.
        return np.asarray(self.to_tensor(), dtype=dtype)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.to_tensor(), name)

    def __repr__(self):
        state = "looked up" if self._call.value is not None else "deferred"
        return (f"<DeferredRows of {self._call.layer.name!r}: shape={self.shape}, "
                f"dtype={self.dtype.name}, {state}>")

    # Elementwise, as a tensor compares; the object itself stays hashable
    # (by identity), as the callers that keep outputs in sets need.
    def __eq__(self, other):
        return self.to_tensor() == other

    def __ne__(self, other):
        return self.to_tensor() != other

    __hash__ = object.__hash__

    def __bool__(self):
        return bool(self.to_tensor())

    def __len__(self):
        return len(self.to_tensor())

    def __iter__(self):
        return iter(self.to_tensor())


def _delegate(name):
    def method(self, *args):
        return getattr(self.to_tensor(), name)(*args)

    method.__name__ = name
    return method


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv",
              "rfloordiv", "mod", "rmod", "pow", "rpow", "matmul", "rmatmul", "neg", "pos",
              "abs", "getitem", "lt", "le", "gt", "ge", "and", "rand", "or", "ror", "xor",
              "rxor", "invert"):
    setattr(DeferredRows, f"__{_name}__", _delegate(f"__{_name}__"))


def _convert(value, dtype=None, name=None, as_ref=False):
    del name, as_ref
    t = value.to_tensor()
    if dtype is not None and not tf.as_dtype(dtype).is_compatible_with(t.dtype):
        return NotImplemented
    return t


def _concat(values, axis, name="concat"):
    """`tf.concat` of deferred calls: exactly the pending calls of one
    graph, pooled rows side by side on the last axis, are looked up by one
    op that writes them so; anything else is concatenated as tensors."""
    calls = [v._call if isinstance(v, DeferredRows) else None for v in values]
    if all(c is not None for c in calls) and calls:
        graph = calls[0].graph
        pending = _pending(graph)
        if (pending is not None and graph is tf.compat.v1.get_default_graph()
                and len(set(map(id, calls))) == len(calls)
                and {id(c) for c in pending if c.value is None and c.source is None}
                == set(map(id, calls))
                and len({c.insert for c in calls}) == 1
                and all(c.shape.rank == 2 and c.dtype == tf.float32 for c in calls)
                and isinstance(axis, int) and axis in (1, -1)):
            out = _flush(graph, pending, concat=calls)
            if out is not None:
                return out
    return tf.concat([tf.convert_to_tensor(v) for v in values], axis, name=name)


_compat.hook_control_dependencies()
tf.register_tensor_conversion_function(DeferredRows, _convert)
_compat.register_dispatchable_type(DeferredRows)
# Only lists of deferred rows and tensors (at least one deferred) come here.
tf.experimental.dispatch_for_api(
    tf.concat, {"values": typing.List[typing.Union[DeferredRows, tf.Tensor]]})(_concat)
