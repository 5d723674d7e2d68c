"""The JAX backend's binding of the table engine (see `ffi`)."""


def register(**kwargs):
    """`keras.saving.register_keras_serializable(**kwargs)` under Keras's JAX
    backend, and nothing under another: the JAX classes take the TensorFlow
    classes' registered names (one `.keras` file loads under either
    backend), and a TensorFlow process that imports this package's JAX
    modules (a test, a tool) must keep deserializing the TensorFlow ones."""
    import keras

    if keras.config.backend() != "jax":
        return lambda cls: cls
    return keras.saving.register_keras_serializable(**kwargs)


def tensorflow_only_getattr(module, names, available):
    """A module `__getattr__` for Keras's JAX backend: a name of `names` (API
    the TensorFlow backend has) raises an AttributeError saying so and
    listing `available`; any other, Python's usual error."""

    def __getattr__(name):
        if name in names:
            raise AttributeError(
                f"{module}.{name} runs on Keras's TensorFlow backend only for now, and the "
                f"active backend is 'jax'. Under JAX: {', '.join(available)}.")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
