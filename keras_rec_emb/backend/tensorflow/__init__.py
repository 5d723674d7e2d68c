"""The TensorFlow backend's binding of the table engine: the custom-op library
(`ops`), the table resource (`variables`), the private TensorFlow and Keras
API (`compat`), and the fused lookups of a model call (`model_fusion`)."""
