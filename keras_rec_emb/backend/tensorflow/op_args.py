"""The inputs and outputs of an op by the names its registration in csrc/ops
gives them, read from the op's `OpDef`, so that no caller counts list
arguments by position (private)."""

from keras_rec_emb.backend.tensorflow import compat as _compat


def _by_name(op, kind, tensors):
    """`op`: a graph op, or the stand-in a gradient function gets in eager
    mode (type, attributes and tensors only)."""
    args = getattr(_compat.op_def(op.type), kind)
    out, i = {}, 0
    for arg in args:
        if arg.number_attr:
            n = op.get_attr(arg.number_attr)
        elif arg.type_list_attr:
            n = len(op.get_attr(arg.type_list_attr))
        else:
            n = 1
        out[arg.name] = list(tensors[i:i + n])
        i += n
    if i != len(tensors):
        raise ValueError(f"op {op.type} has {len(tensors)} tensors where its OpDef names {i}")
    return out


def named_inputs(op):
    """{input name: [its tensors]} of `op` (a list input gives all of its
    tensors, a single input a list of one)."""
    return _by_name(op, "input_arg", list(op.inputs))


def named_outputs(op):
    """{output name: [its tensors]} of `op`, as `named_inputs`."""
    return _by_name(op, "output_arg", list(op.outputs))
