"""Helpers of the model-form tests: a subclassed model as users write
them, and a model's whole state (tables, dense weights, optimizer) for
value-by-value comparison."""

import keras
import numpy as np

from keras_rec_emb import _keras_fixes
from keras_rec_emb.layers import EmbeddingVariable

FORMS = ["functional", "subclassed", "sequential", "sequential_input"]


@keras.saving.register_keras_serializable(package="kre_tests")
class ChainModel(keras.Model):
    """A subclassed model as users write them: layers made in `__init__`
    from its arguments, applied in `call`, nothing built before `fit`."""

    def __init__(self, chain, **kwargs):
        super().__init__(**kwargs)
        self.chain = [keras.saving.deserialize_keras_object(c) if isinstance(c, dict) else c
                      for c in chain]

    def call(self, x, training=None):
        for layer in self.chain:
            x = layer(x, training=training)
        return x

    def get_config(self):
        config = super().get_config()
        config["chain"] = [keras.saving.serialize_keras_object(c) for c in self.chain]
        return config


def model_in_form(form, layers, shape, dtype):
    """`layers` chained in one of `FORMS`: a functional model over
    `keras.Input(shape, dtype)`, a `ChainModel`, or a `Sequential` without
    or with that input."""
    if form == "functional":
        out = inp = keras.Input(shape, dtype=dtype)
        for layer in layers:
            out = layer(out)
        return keras.Model(inp, out)
    if form == "subclassed":
        return ChainModel(layers)
    if form == "sequential":
        return keras.Sequential(layers)
    return keras.Sequential([keras.Input(shape, dtype=dtype)] + layers)


def id_layers(model):
    return [layer for layer in _keras_fixes.flatten_layers(model)
            if isinstance(layer, EmbeddingVariable)]


def state(model):
    """Every table part, dense weight and optimizer variable, by name."""
    out = {}
    for layer in id_layers(model):
        data = layer.export()
        order = np.argsort(data["keys"])
        for part in ("keys", "values", "freqs", "versions"):
            out[f"{layer.name}/{part}"] = data[part][order]
        for slot, values in data["slots"].items():
            out[f"{layer.name}/slot:{slot}"] = values[order]
    # Dense weights and optimizer variables in model order (a reloaded
    # subclassed model's variable paths get other unique-name suffixes).
    tables = {id(v) for layer in id_layers(model) for v in layer.weights}
    dense = [v for v in model.weights if id(v) not in tables]
    for i, v in enumerate(dense):
        out[f"weight:{i}:{v.name}"] = keras.ops.convert_to_numpy(v)
    for i, v in enumerate(model.optimizer.variables):
        out[f"opt:{i}:{tuple(v.shape)}"] = keras.ops.convert_to_numpy(v)
    return out


def assert_state_equal(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
