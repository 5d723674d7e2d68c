"""The JAX backend's binding of the table engine (see `ffi`)."""

import os


def use_64_bit_ids():
    """Turns on JAX's 64-bit mode (`jax_enable_x64`) unless the environment
    variable JAX_ENABLE_X64 says otherwise: in JAX's default 32-bit mode
    int64 ids become int32 with a warning at most, so distinct ids beyond
    the int32 range would silently share rows. Float weights stay float32.
    With JAX_ENABLE_X64=0 the keys are int32 and key_dtype="int64" is refused."""
    if "JAX_ENABLE_X64" in os.environ:
        return
    import jax

    jax.config.update("jax_enable_x64", True)


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
