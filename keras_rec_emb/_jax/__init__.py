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
