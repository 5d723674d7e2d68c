"""HashStrings: string categories to int64 table keys, as DeepRec's string
embedding variables hash them (the same keys under either Keras backend)."""

import keras
import numpy as np

from keras_rec_emb import _backend
from keras_rec_emb._farmhash import NUM_BUCKETS, PAD_ID  # noqa: F401 (public constants)
from keras_rec_emb._keras_fixes import in_symbolic_build

if _backend.is_jax():
    from keras_rec_emb.backend.jax import string_ids as _impl
else:
    from keras_rec_emb.backend.tensorflow import string_ids as _impl

_MISSING_MODES = ("drop", "pad")
_STRING_TYPES = {str, bytes, np.str_, np.bytes_}


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class HashStrings(keras.layers.Layer):
    """Hashes string ids to int64 keys as DeepRec does, `''` as missing.

    Each string's key is `tf.strings.to_hash_bucket_fast(s, 2**63 - 1)`, as in
    DeepRec's string embedding variables; `''` gets no row, insert or gradient.
    Under JAX call it on the host, before the model. See docs/semantics.md,
    'Lookups'.

    Args:
        missing: `"drop"` (TensorFlow: ragged keys without it) or `"pad"` (`-1`
            in its place, the input's shape). Defaults to `"drop"`.
        name: str or `None`.
        **kwargs: other `keras.layers.Layer` arguments.

    Input shape:
        String ids: dense `[B]` or `[B, L]` (any rank with
        `missing="pad"`), or (TensorFlow) `[B, None]` ragged or sparse.

    Output shape:
        int64 keys: `[B, None]` ragged for dense input with `"drop"`;
        otherwise the input's shape and kind.

    Example:

    >>> hash_strings = keras_rec_emb.layers.HashStrings(missing="pad")
    >>> keys = hash_strings(np.array([["68fd1e64", ""], ["", "a"]]))
    >>> keras.ops.convert_to_numpy(keys).tolist()
    [[7920289447977470598, -1], [-1, 3694432073954588132]]
    >>> ids = keras.Input(shape=(2,), dtype="int64")
    >>> emb = keras_rec_emb.layers.EmbeddingVariable(4, combiner="mean",
    ...                                              prune_invalid_ids=True)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> keys = hash_strings(np.array([["a", "b"], ["a", ""], ["", ""]]))
    >>> history = model.fit(keys, np.ones((3, 1)), verbose=0)
    >>> emb.table_size()  # "a" and "b"; '' is no key
    2

    Under TensorFlow the layer can be part of the model instead:
    `keys = HashStrings()(keras.Input(shape=(2,), dtype="string"))` gives
    ragged keys with `''` dropped, for `EmbeddingVariable(combiner=...)`.
    """

    def __init__(self, missing: str = "drop", name: str | None = None, **kwargs):
        super().__init__(name=name, **kwargs)
        if missing not in _MISSING_MODES:
            raise ValueError(
                f"`missing` must be one of {_MISSING_MODES}. Received: missing={missing!r}")
        self.missing = missing
        # String ops have no XLA kernels: Keras's jit_compile="auto" then
        # chooses False.
        self.supports_jit = False
        self.built = True

    def __call__(self, inputs, *args, **kwargs):
        # A Python list or NumPy object array of mixed elements would fail in
        # the backend's conversion (or Keras's argument check), naming neither
        # this layer nor string ids.
        listed = isinstance(inputs, (list, tuple)) or (
            isinstance(inputs, np.ndarray) and inputs.dtype == object)
        if listed:
            self._check_elements(inputs)
        if _backend.is_jax():
            # Strings never enter JAX: hashed here, on the host (see the module).
            return _impl.hash_on_host(self, inputs)
        if listed:
            inputs = _impl.to_strings(inputs)
        return super().__call__(inputs, *args, **kwargs)

    def _check_elements(self, inputs):
        """Checks that every element of nested lists or an object array is a
        `str` or `bytes`."""
        stack = [inputs]
        while stack:
            item = stack.pop()
            flat = item.ravel().tolist() if isinstance(item, np.ndarray) else item
            if set(map(type, flat)) <= _STRING_TYPES:
                continue  # (one pass in C over a row of strings)
            for item in flat:
                if isinstance(item, (list, tuple, np.ndarray)):
                    stack.append(item)
                elif not isinstance(item, (str, bytes, np.str_, np.bytes_)):
                    raise TypeError(
                        f"HashStrings '{self.name}' takes string ids in `inputs`: every element "
                        f"a str or bytes ('' for a missing id), or a string tensor. Received "
                        f"an element of type {type(item).__name__}: {item!r}. Integer ids need "
                        "no hashing: feed them to the embedding layer directly (or convert "
                        "them all with str()).")

    @property
    def ids_input_dtype(self):
        """`"string"`: the dtype of the `keras.Input` a `keras.Sequential`
        without one makes for this layer (Keras would make it float32)."""
        return "string"

    def dtype_error(self, dtype):
        """The TypeError message for ids of `dtype` (its name), one for both
        backends."""
        return (
            f"HashStrings '{self.name}' expects string ids (str/bytes arrays or tf.string "
            f"tensors). Received ids of dtype {dtype}. Integer ids need no hashing: feed "
            "them to the embedding layer directly. (Exporting a subclassed model under "
            "TensorFlow? Keras records only its input shapes: pass `input_signature` with "
            "tf.string tf.TensorSpecs.)")

    def check_rank(self, rank, kind):
        """Raises the ValueError for `kind` ("dense", "ragged", "sparse")
        strings of `rank` this layer does not take."""
        if self.missing == "drop" and kind == "dense" and rank is not None \
                and rank not in (1, 2):
            raise ValueError(
                f"HashStrings '{self.name}' with missing='drop' takes dense strings "
                f"of shape [batch] or [batch, L] (it returns [batch, None] ragged "
                f"keys). Received rank {rank}. Use missing='pad' for other ranks.")
        if kind != "dense" and rank is not None and rank != 2:
            raise ValueError(
                f"HashStrings '{self.name}' takes {kind} strings of shape "
                f"[batch, None]. Received rank {rank}.")

    def call(self, inputs):
        return _impl.call(self, inputs)  # Keras's TensorFlow backend only (see __call__)

    def compute_output_spec(self, inputs):
        dtype = getattr(inputs, "dtype", None)
        if dtype is not None and keras.backend.standardize_dtype(dtype) != "string" \
                and not in_symbolic_build():
            raise TypeError(self.dtype_error(keras.backend.standardize_dtype(dtype)))
        shape = tuple(inputs.shape)
        sparse = bool(getattr(inputs, "sparse", False))
        ragged = bool(getattr(inputs, "ragged", False))
        kind = "sparse" if sparse else "ragged" if ragged else "dense"
        self.check_rank(len(shape), kind)
        if kind == "dense" and self.missing == "drop":
            return keras.KerasTensor((shape[0], None), dtype="int64", ragged=True)
        return keras.KerasTensor(shape, dtype="int64", sparse=sparse, ragged=ragged)

    def get_config(self):
        config = super().get_config()
        config["missing"] = self.missing
        return config
