"""Saving under Keras's JAX backend in the TensorFlow backend's format.

One format for both backends: `EmbeddingVariable` is one class, whose
config and weights store are the same under both (its table's parts and
`slot:NAME` per slot; keras_rec_emb/layers/embedding_variable.py). What
is JAX's own:

* a table optimizer (SGD, Adagrad, Adam, Ftrl: ours or Keras's) is
  written as the TensorFlow backend's table optimizer of the same name
  (`optimizer_config`) and read back (`table_optimizer`);
* the table's slots are the layer's under both backends: under TensorFlow
  the optimizer's own variables hold only its step, learning rate and the
  dense weights' slots, never a table's; under JAX the optimizer leaves
  out the slots it makes for the layers' zero-size anchors
  (`save_optimizer` / `load_optimizer`), so its list is TensorFlow's.
"""

import warnings

import keras

# Table optimizers the JAX layer runs, by the name TensorFlow registers
# (subclasses first: Keras's AdamW is an Adam).
_OPTIMIZERS = {"SGD": keras.optimizers.SGD, "Adagrad": keras.optimizers.Adagrad,
               "Adam": keras.optimizers.Adam, "Ftrl": keras.optimizers.Ftrl}
# keras_rec_emb's own, without a Keras namesake (found by registered name).
_DEEPREC_OPTIMIZERS = ("AdamAsync", "AdagradDecay", "AdamW")


# -- config -------------------------------------------------------------------

def optimizer_config(optimizer):
    """`optimizer` (SGD, Adagrad, Adam, Ftrl: ours or Keras's; None: the
    model's) serialized as the TensorFlow backend's table optimizer of the
    same name."""
    if optimizer is None:
        return None
    registered = keras.saving.get_registered_name(type(optimizer))
    if registered.startswith("keras_rec_emb>"):
        name = registered.split(">", 1)[1]
    else:
        name = next(n for n, cls in _OPTIMIZERS.items() if isinstance(optimizer, cls))
    module = ("keras_rec_emb.optimizers.deeprec_optimizers" if name in _DEEPREC_OPTIMIZERS
              else "keras_rec_emb.optimizers.keras_optimizers")
    return {"module": module, "class_name": name,
            "config": optimizer.get_config(), "registered_name": f"keras_rec_emb>{name}"}


def table_optimizer(value):
    """The layer's own optimizer of `value` (an optimizer, None: the
    model's, or a config written by either backend)."""
    if isinstance(value, keras.optimizers.Optimizer):
        return value
    if value is None:
        return None  # the model's optimizer
    name = value.get("class_name") if isinstance(value, dict) else None
    if name not in (*_OPTIMIZERS, *_DEEPREC_OPTIMIZERS):
        raise ValueError(
            "Under the JAX backend an EmbeddingVariable supports optimizer=None, "
            f"{', '.join((*_OPTIMIZERS, *_DEEPREC_OPTIMIZERS))} only (so far): other values "
            f"are TensorFlow-only for now. Received: optimizer={value!r}")
    # keras_rec_emb/backend/jax/optimizers.py registers them (imported with the
    # package); looked up by name, since that module imports this one.
    cls = keras.saving.get_registered_object(f"keras_rec_emb>{name}")
    return cls.from_config(value.get("config") or {})


# -- the optimizer -------------------------------------------------------------
# Under TensorFlow a table's slots live in the table and the optimizer saves
# only its other variables (step, learning rate, the dense weights' slots).
# Under JAX the optimizer also makes a slot for each layer's zero-size
# `anchor`: those are left out of the store, so that both backends save
# and load the same list.

def mark_anchor_slot(optimizer, variable):
    """Records `variable` as a slot of a table's anchor (not saved)."""
    if not hasattr(optimizer, "_kre_anchor_slots"):
        optimizer._kre_anchor_slots = []
    optimizer._kre_anchor_slots.append(variable)


def saved_variables(optimizer):
    """The optimizer's variables as TensorFlow saves them (no anchor slot)."""
    skip = {id(v) for v in getattr(optimizer, "_kre_anchor_slots", ())}
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
