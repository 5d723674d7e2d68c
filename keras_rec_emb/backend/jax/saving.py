"""The JAX `EmbeddingVariable` in the TensorFlow backend's `.keras` format.

One format for both backends: a `.keras` file saved under TensorFlow loads
under JAX and the reverse. Three things make it so.

* The registered name: both classes are `keras_rec_emb>EmbeddingVariable`,
  so Keras resolves a saved layer to the class of the backend that loads it.
* The config (`layer_config` / `layer_kwargs`): the JAX layer writes the
  TensorFlow layer's arguments (its `EmbeddingVariableOption` with the
  initializer option, filter, eviction and storage, `combiner`,
  `prune_invalid_ids`, `restore_dim_mismatch`, the table `optimizer` as
  `keras_rec_emb>SGD` / `keras_rec_emb>Adagrad`), and reads them back,
  refusing with a ValueError what the JAX layer lacks so far
  (`restore_dim_mismatch` other than "error"). A file-tier table's rows
  are saved as a DRAM table's (exported), so its `.keras` file is the
  same under both backends.
* The weights (`save_table` / `load_table`): the layer's store holds the
  table's parts under the names of keras_rec_emb/backend/tensorflow/variables.py's
  `ARRAY_PARTS` (`keys`, `values`, `freqs`, `versions`, `default_values`,
  `keys_filtered`, `freqs_filtered`, `versions_filtered`, `bloom`;
  frequencies and versions int64 as TensorFlow writes them) and each
  optimizer slot as `slot:NAME` (`slot:accumulator` for Adagrad). As
  under TensorFlow, saving first evicts what the layer's eviction option
  names (DeepRec evicts at checkpoint; not with the option's
  `at_save=False` nor inside `keras_rec_emb.save_model(..., evict=False)`),
  logging each table's evicted and kept rows and warning when more than
  half went, and with `save_filtered` off (or
  `KRE_EV_SAVE_FILTERED_FEATURES=false`) the keys counted but not admitted
  are saved empty and the Bloom counters not at all. The
  table's slots are the layer's under both backends: under TensorFlow the
  optimizer's own variables hold only its step, learning rate and the
  dense weights' slots, never a table's; under JAX the optimizer leaves out
  the slots it makes for the layers' zero-size anchors
  (`save_optimizer` / `load_optimizer`), so its list is TensorFlow's.

The JAX layer's step counter (`iterations`, which drives learning-rate
schedules, Adam's bias correction and the versions) is saved beside the
parts as `iterations`, which the TensorFlow layer does not read (its
tables follow the model optimizer's step, saved with the optimizer): a
JAX model saved and loaded resumes at its step even when the last steps
stamped no version (ids all filtered, padding or evicted). A file without
it (saved under TensorFlow) takes the model optimizer's step, which
TensorFlow's tables follow (the step after the latest version, admitted or
filtered, when no optimizer loads).
"""

import warnings

import keras
import numpy as np

from keras_rec_emb import options
from keras_rec_emb import saving as kre_saving
from keras_rec_emb.backend.jax import ffi

# keras_rec_emb/backend/tensorflow/variables.py's ARRAY_PARTS (that module imports TensorFlow).
PARTS = ("keys", "values", "freqs", "versions", "default_values", "keys_filtered",
         "freqs_filtered", "versions_filtered", "bloom")
SLOT_PREFIX = "slot:"
# The JAX layer's step counter (`iterations`), beside the parts (see the top).
STEP = "iterations"
_INT64_PARTS = ("freqs", "versions", "freqs_filtered", "versions_filtered")

# Table optimizers the JAX layer runs, by the name TensorFlow registers
# (subclasses first: Keras's AdamW is an Adam).
_OPTIMIZERS = {"SGD": keras.optimizers.SGD, "Adagrad": keras.optimizers.Adagrad,
               "Adam": keras.optimizers.Adam, "Ftrl": keras.optimizers.Ftrl}
# keras_rec_emb's own, without a Keras namesake (found by registered name).
_DEEPREC_OPTIMIZERS = ("AdamAsync", "AdagradDecay", "AdamW")


def _slot_specs(layer):
    """(name, width) of the table's slots, in the order they were added."""
    specs = getattr(layer, "_kre_slot_specs", None)
    if specs is None:
        specs = [(name, layer.embedding_dim if width is None else width)
                 for name, _, width in layer.table_rule.slots]
    return specs


def save_table(layer, store):
    """Writes the table's parts into the layer's weights store, after the
    layer's eviction (see the top)."""
    if layer.handle is None:
        return
    rule = layer.ev_option.evict_option
    if rule is not None and rule.at_save and kre_saving.evicts_at_save():
        before = layer.table_size()
        evicted = layer.evict()
        kre_saving.report_save_eviction(layer.name, rule, before, layer.table_size(), evicted)
    parts = ffi.export_parts(layer.handle, layer.key_dtype, layer.embedding_dim,
                             _slot_specs(layer))
    ev = layer.ev_option
    if not (ev.save_filtered and options.save_filtered_from_env()):
        for name in ("keys_filtered", "freqs_filtered", "versions_filtered"):
            parts[name] = parts[name][:0]
        del parts["bloom"]
    for name in PARTS:
        if name not in parts:
            continue
        value = np.asarray(parts[name])
        store[name] = value.astype(np.int64) if name in _INT64_PARTS else value
    for name, value in parts["slots"].items():
        store[SLOT_PREFIX + name] = np.asarray(value)
    store[STEP] = np.asarray(int(layer.iterations.value), np.int64)


def load_table(layer, store):
    """Replaces the table's contents with the parts in the store (one the
    file lacks loads as empty; `keys` and `values` are required)."""
    if layer.handle is None:
        layer.build()
    names = list(store.keys())
    data = {name: np.asarray(store[name]) for name in PARTS if name in names}
    data["slots"] = {name[len(SLOT_PREFIX):]: np.asarray(store[name]) for name in names
                     if name.startswith(SLOT_PREFIX)}
    for name in ("keys", "values"):
        if name not in data:
            raise ValueError(f"The saved EmbeddingVariable '{layer.name}' has no `{name}` "
                             f"(the store holds {sorted(names)})")
    ffi.import_parts(layer.handle, layer.key_dtype, layer.embedding_dim, data)
    specs = _slot_specs(layer)
    known = {name for name, _ in specs}
    layer._kre_slot_specs = specs + [(name, value.shape[1]) for name, value in
                                     data["slots"].items() if name not in known]
    layer._kre_step_unsaved = STEP not in names  # pylint: disable=protected-access
    if STEP in names:
        layer.iterations.assign(int(np.asarray(store[STEP])))
        return
    # A file without the step (saved under TensorFlow, whose tables take
    # the model optimizer's): the model optimizer's step, when it loads
    # (TableOptimizer.load_own_variables); until then, or without one, the
    # step after the last one that stamped a version, admitted or filtered.
    versions = np.concatenate([np.asarray(data.get(name, np.zeros(0, np.int64)), np.int64)
                               .ravel() for name in ("versions", "versions_filtered")])
    layer.iterations.assign(int(versions.max()) + 1 if versions.size else 0)


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


def layer_config(layer, base_config):
    """The TensorFlow `EmbeddingVariable`'s config of `layer` (with
    `base_config`, Keras's Layer config: name, trainable, dtype)."""
    config = dict(base_config)
    config.update({
        "embedding_dim": layer.embedding_dim,
        "initializer": keras.initializers.serialize(layer.initializer),
        "key_dtype": layer.key_dtype,
        "combiner": layer.combiner,
        "prune_invalid_ids": layer.prune_invalid_ids,
        "ev_option": keras.saving.serialize_keras_object(layer.ev_option),
        "restore_dim_mismatch": "error",
        "optimizer": optimizer_config(layer.optimizer),
    })
    return config


def _unsupported(argument, value, allowed):
    return ValueError(f"Under the JAX backend an EmbeddingVariable supports {argument}="
                      f"{allowed} only (so far): other values are TensorFlow-only for now. "
                      f"Received: {argument}={value!r}")


def _inner(value, class_name, argument):
    """The config dict of a serialized option (None stays None)."""
    if value is None:
        return None
    if isinstance(value, dict) and value.get("class_name") == class_name:
        return value.get("config") or {}
    raise ValueError(f"`{argument}` must be a serialized {class_name} or None. "
                     f"Received: {argument}={value!r}")


def _option(value, class_names, argument):
    """The option object of a serialized option of one of `class_names`
    (an object of one of them stays as it is; None stays None)."""
    classes = tuple(getattr(options, name) for name in class_names)
    if value is None or isinstance(value, classes):
        return value
    name = value.get("class_name") if isinstance(value, dict) else None
    if name not in class_names:
        raise ValueError(f"`{argument}` must be a serialized {' or '.join(class_names)} or "
                         f"None. Received: {argument}={value!r}")
    # from_config: a StorageOption's folder is checked as under TensorFlow.
    return getattr(options, name).from_config(_inner(value, name, argument))


def ev_option(value):
    """`value` (an `EmbeddingVariableOption`, one serialized in a config,
    or None) as an `EmbeddingVariableOption` (None stays None); a
    ValueError names a part it cannot read."""
    if value is not None and not isinstance(value, options.EmbeddingVariableOption):
        config = dict(_inner(value, "EmbeddingVariableOption", "ev_option"))
        fields = {"init_option": ("InitializerOption",),
                  "filter_option": ("CounterFilter", "CBFFilter"),
                  "evict_option": ("GlobalStepEvict", "L2WeightEvict"),
                  "storage_option": ("StorageOption",)}
        for field, class_names in fields.items():
            config[field] = _option(config.get(field), class_names, f"ev_option.{field}")
        value = options.EmbeddingVariableOption(**config)
    return value


def _optimizer(value):
    if isinstance(value, keras.optimizers.Optimizer):
        return value
    if value is None:
        return None  # the model's optimizer
    name = value.get("class_name") if isinstance(value, dict) else None
    if name not in (*_OPTIMIZERS, *_DEEPREC_OPTIMIZERS):
        raise _unsupported("optimizer", value,
                           "None, " + ", ".join((*_OPTIMIZERS, *_DEEPREC_OPTIMIZERS)))
    # keras_rec_emb/backend/jax/optimizers.py registers them (imported with the
    # package); looked up by name, since that module imports this one.
    cls = keras.saving.get_registered_object(f"keras_rec_emb>{name}")
    return cls.from_config(value.get("config") or {})


def layer_kwargs(config):
    """The JAX layer's arguments for a config written by either backend's
    `EmbeddingVariable` (see `layer_config`)."""
    kwargs = dict(config)
    restore = kwargs.pop("restore_dim_mismatch", "error")
    if restore != "error":
        raise _unsupported("restore_dim_mismatch", restore, "'error'")
    kwargs["optimizer"] = _optimizer(kwargs.get("optimizer"))
    kwargs["ev_option"] = ev_option(kwargs.get("ev_option"))
    return kwargs


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
