"""What differs between Keras's TensorFlow and JAX backends, one folder each.

`tensorflow/` is the TensorFlow binding of the table engine: the custom-op
library, the table resource, the private TensorFlow and Keras API the
package uses, the fused lookups of a Functional model call. `jax/` is the
JAX binding: XLA FFI calls and the lookups whose backward updates the
table. `keras_rec_emb._backend` says which one this process runs.
"""
