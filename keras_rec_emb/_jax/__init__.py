"""The JAX backend's binding of the table engine (see `ffi`)."""
