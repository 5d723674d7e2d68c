"""Saving under Keras's JAX backend in the TensorFlow backend's format.

`EmbeddingVariable`'s config and weights store are the same under both
backends. What is JAX's own: its optimizer also makes a slot for each
layer's zero-size `anchor`, which `save_optimizer` / `load_optimizer` leave
out, so that both backends save the same optimizer variables.
"""

import warnings


def mark_anchor_slot(optimizer, variable):
    """Records `variable` as a slot of a table's anchor (not saved)."""
    if not hasattr(optimizer, "_kre_anchor_slots"):
        optimizer._kre_anchor_slots = []
    optimizer._kre_anchor_slots.append(variable)


def saved_variables(optimizer):
    """The optimizer's variables a TensorFlow optimizer also has: no slot
    of a table's anchor, its own nor (a LossScaleOptimizer's) its inner
    optimizer's."""
    skip, inner = set(), optimizer
    while inner is not None:
        skip.update(id(v) for v in getattr(inner, "_kre_anchor_slots", ()))
        inner = getattr(inner, "inner_optimizer", None)
    return [v for v in optimizer.variables if id(v) not in skip]


def save_optimizer(optimizer, store):
    for i, variable in enumerate(saved_variables(optimizer)):
        store[str(i)] = variable.numpy()


def load_optimizer(optimizer, store):
    variables = saved_variables(optimizer)
    if len(store.keys()) != len(variables):
        # Keras's own rule (base_optimizer.load_own_variables).
        warnings.warn(
            f"Skipping variable loading for optimizer '{optimizer.name}', because it has "
            f"{len(variables)} variables whereas the saved optimizer has {len(store.keys())} "
            "variables.", stacklevel=2)
        return
    for i, variable in enumerate(variables):
        variable.assign(store[str(i)])
