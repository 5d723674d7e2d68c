# Copyright keras_rec_emb authors. Apache-2.0.
"""The `EmbeddingVariable` calls of one Functional model call, looked up in one
fused op (why that is the same program, and what is not fused: docs/semantics.md,
'Memory and speed')."""

import threading
import weakref

import keras
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context

# Filled by the modules that import this one: the layer class
# (`embedding_variable.register_layer_class`) and `embedding_ops`'s
# `(calls, training) -> rows` of a list of planned entries.
EMBEDDING_VARIABLE = None
lookup_entries = None

_LOCAL = threading.local()  # .plans: the stack of this thread's model calls
_NODES = weakref.WeakKeyDictionary()  # model -> [(layer, input index)] eligible


class _Entry:
    __slots__ = ("layer", "inputs", "rows")

    def __init__(self, layer, inputs):
        self.layer, self.inputs, self.rows = layer, inputs, None


class _Plan:
    """The eligible calls of one model call: `entries` by layer id; `training`
    once they are looked up."""

    __slots__ = ("entries", "looked_up", "training")

    def __init__(self, entries):
        self.entries, self.looked_up, self.training = entries, False, None


def _eligible(layer, tensor):
    if type(layer).call is not EMBEDDING_VARIABLE.call:
        return False  # a subclass's own call is its own code
    if getattr(layer, "activity_regularizer", None):
        return False  # Keras computes it on the output at the call
    shape = getattr(tensor, "shape", None)
    dtype = getattr(tensor, "dtype", None)
    if shape is None or dtype is None or len(shape) < 1:
        return False
    if not tf.as_dtype(dtype).is_integer:
        return False  # refused at the call, with its error
    if layer.combiner is None:
        return not (getattr(tensor, "sparse", False) or getattr(tensor, "ragged", False))
    return True


def _eligible_nodes(model):
    """`[(layer, input index)]` of the model's fusable nodes (see the module),
    or `[]`; cached per model (a Functional graph does not change)."""
    cached = _NODES.get(model)
    if cached is not None:
        return cached
    if EMBEDDING_VARIABLE is None:
        return []  # no table layer class loaded: nothing to fuse
    inputs = {id(x): i for i, x in enumerate(model.inputs)}
    nodes = _compat.functional_nodes(model)
    uses, candidates, held = {}, [], set()
    for node in nodes:
        op = node.operation
        uses[id(op)] = uses.get(id(op), 0) + 1
        args, kwargs = node.arguments.args, node.arguments.kwargs
        if kwargs.get("training") is not None:
            _NODES[model] = []
            return []
        if (isinstance(op, EMBEDDING_VARIABLE) and not kwargs and len(args) == 1
                and id(args[0]) in inputs and _eligible(op, args[0])):
            candidates.append((node, op, inputs[id(args[0])]))
            continue
        if isinstance(op, keras.layers.Layer):
            for sub in _compat.flatten_layers(op):
                held.add(id(sub))
    plan = [(op, index) for node, op, index in candidates
            if uses[id(op)] == 1 and id(op) not in held]
    if len(plan) < 2:
        plan = []
    _NODES[model] = plan
    return plan


def _may_fuse():
    return not (tf.executing_eagerly() or _compat.in_symbolic_build()
                or _compat.in_xla_context() or _serving_context.tracing_stock())


class _ModelCall:
    """The context `_compat.hook_functional_graph` enters around a Functional
    model's graph run: the plan of its fusable calls while it runs."""

    def __init__(self, model, flat_inputs):
        self.plan = None
        if not _may_fuse():
            return
        nodes = _eligible_nodes(model)
        if nodes:
            self.plan = _Plan({id(layer): _Entry(layer, flat_inputs[i]) for layer, i in nodes})

    def __enter__(self):
        if self.plan is not None:
            stack = getattr(_LOCAL, "plans", None)
            if stack is None:
                stack = _LOCAL.plans = []
            stack.append(self.plan)
        return self

    def __exit__(self, *exc):
        if self.plan is not None:
            _LOCAL.plans.pop()
        return False


def planned_rows(layer, inputs, training):
    """The rows of this call of `layer` when it is a fused node of the model
    call being run (see the module; `training` resolved): a `tf.Tensor`, the
    fused op run at the first of them; else None (look up at the call)."""
    stack = getattr(_LOCAL, "plans", None)
    if not stack:
        return None
    plan = stack[-1]
    entry = plan.entries.get(id(layer))
    if entry is None or entry.layer is not layer:
        return None
    training = bool(training)
    if not plan.looked_up:
        if inputs is not entry.inputs or not _may_fuse():
            plan.entries.clear()  # not the call planned: every layer at its call
            return None
        calls = list(plan.entries.values())
        for e, rows in zip(calls, lookup_entries(calls, training)):
            e.rows = rows
        plan.looked_up, plan.training = True, training
    elif inputs is not entry.inputs or training != plan.training or entry.rows is None:
        # The plan holds only calls whose ids and training are the model
        # call's; anything else here would be a Keras change the hook
        # does not know.
        raise RuntimeError(
            f"EmbeddingVariable '{layer.name}' was looked up with the other layers of its "
            f"model at the first of them, but is now called with other ids or training; "
            f"this Keras version ({keras.__version__}) runs Functional graphs "
            f"differently from the one the fusion was written for")
    rows, entry.rows = entry.rows, None
    del plan.entries[id(layer)]
    return rows


_compat.hook_functional_graph(_ModelCall)
