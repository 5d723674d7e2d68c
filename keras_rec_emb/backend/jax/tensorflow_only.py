"""The classes that run on Keras's TensorFlow backend only, under their
registered names: a `.keras` file holding one (saved under TensorFlow)
then fails to load under JAX with an error naming the class and saying it
is TensorFlow-only, not with Keras's "Could not locate class"."""

import keras

# Registered name (keras_rec_emb>NAME) -> the public path of the class.
CLASSES = {
    "HashStrings": "keras_rec_emb.layers.HashStrings",
    "LossScaleOptimizer": "keras_rec_emb.optimizers.LossScaleOptimizer",
}


def error(name):
    """The ValueError for a saved `keras_rec_emb>{name}` loaded under JAX."""
    return ValueError(
        f"{CLASSES[name]} (registered as 'keras_rec_emb>{name}') runs on Keras's TensorFlow "
        "backend only for now, and the active backend is 'jax': a model that holds one "
        "loads under KERAS_BACKEND=tensorflow. Received: a saved "
        f"'keras_rec_emb>{name}' config")


def _stub(name):
    # A ValueError, not a TypeError: Keras rewraps a TypeError of
    # `from_config` in its own advice about nested objects.
    def from_config(cls, config):
        raise error(name)

    def init(self, *args, **kwargs):
        raise error(name)

    def get_config(self):
        raise error(name)

    cls = type(name, (), {"__init__": init, "from_config": classmethod(from_config),
                          "get_config": get_config,
                          "__doc__": f"{CLASSES[name]} is TensorFlow-only (see the module)."})
    return keras.saving.register_keras_serializable(package="keras_rec_emb", name=name)(cls)


# Registered only under JAX: a TensorFlow process that imports this module
# (a test walking every module, say) must keep the real classes under
# these names.
STUBS = {name: _stub(name) for name in CLASSES} if keras.config.backend() == "jax" else {}
