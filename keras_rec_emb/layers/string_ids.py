"""HashStrings: string categories to int64 table keys, as DeepRec's string
embedding variables hash them."""

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat

# DeepRec's string EV hashes with `to_hash_bucket_fast(s, INT64_MAX)`: keys
# in [0, 2**63 - 2], so a negative pad value can never be a real key.
NUM_BUCKETS = 2**63 - 1
PAD_ID = -1
_MISSING_MODES = ("drop", "pad")


def hash_strings(strings):
    """int64 keys of a string tensor: `tf.strings.to_hash_bucket_fast(s,
    2**63 - 1)` (FarmHash Fingerprint64 modulo 2**63 - 1), DeepRec's rule."""
    return tf.strings.to_hash_bucket_fast(strings, NUM_BUCKETS)


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class HashStrings(keras.layers.Layer):
    """Hashes string ids to int64 keys as DeepRec does, `''` as missing.

    Real CTR data has string categories (Criteo's hex values). DeepRec's
    string embedding variables hash each string with
    `tf.strings.to_hash_bucket_fast(s, 2**63 - 1)` (a stock TensorFlow op:
    an exported model serves raw strings with TensorFlow alone) and treat
    the empty string as missing: no row is read or inserted for it and it
    gets no gradient. This layer does the same in front of
    `EmbeddingVariable` or `GroupEmbedding`. Null strings of a Parquet
    column read as `''` (`ParquetDataset`), so they are missing too.

    Unlike `keras.layers.Hashing(num_bins, mask_value="")`, keys are not
    shifted and `''` never becomes a key of the table.

    Args:
        missing: `"drop"` or `"pad"`. How a missing (`''`) id is expressed
            in the output. `"drop"` removes it: dense `[B]` or `[B, L]`
            strings give a `[B, None]` `tf.RaggedTensor` of keys (a row may
            be empty), ragged strings stay ragged and sparse strings stay
            sparse; every layer takes these (give `EmbeddingVariable` a
            `combiner`, under which an empty row embeds as zeros).
            `"pad"` keeps the input's shape and writes `-1` in its place:
            for `GroupEmbedding` and the sparse lookups of
            `keras_rec_emb.ops`, which drop ids `< 0` as padding (the form
            `GroupEmbedding` takes all its features in at once, `[B, F]` or
            `[B, F, L]`). `EmbeddingVariable` reads `-1` as a key like any
            other: use `"drop"` with it. Defaults to `"drop"`.
        name: str or `None`.
        **kwargs: other `keras.layers.Layer` arguments.

    Input shape:
        `tf.string` ids: dense `[B]` or `[B, L]` (any rank with
        `missing="pad"`), or `[B, None]` ragged or sparse.

    Output shape:
        int64 keys: `[B, None]` ragged for dense input with `"drop"`;
        otherwise the input's shape and kind.

    Example:

    >>> strings = tf.constant([["68fd1e64", ""], ["", ""]])
    >>> keras_rec_emb.layers.HashStrings()(strings).row_lengths().numpy().tolist()
    [1, 0]
    >>> keras_rec_emb.layers.HashStrings(missing="pad")(strings).numpy()[:, 1].tolist()
    [-1, -1]
    >>> ids = keras.Input(shape=(2,), dtype="string")
    >>> keys = keras_rec_emb.layers.HashStrings()(ids)
    >>> emb = keras_rec_emb.layers.EmbeddingVariable(4, combiner="mean")(keys)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(emb))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> x = tf.constant([["a", "b"], ["a", ""], ["", ""]])
    >>> history = model.fit(x, np.ones((3, 1)), verbose=0)
    >>> model.layers[2].table_size()  # "a" and "b"; '' is no key
    2
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
        # TensorFlow's conversion (or Keras's argument check), naming neither
        # this layer nor string ids.
        if isinstance(inputs, (list, tuple)) or (
                isinstance(inputs, np.ndarray) and inputs.dtype == object):
            inputs = self._checked_strings(inputs)
        return super().__call__(inputs, *args, **kwargs)

    def _checked_strings(self, inputs):
        """`inputs` (nested lists or an object array) as a tf.string tensor,
        after checking that every element is a `str` or `bytes`."""
        stack = [inputs]
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple, np.ndarray)):
                stack.extend(item.ravel().tolist() if isinstance(item, np.ndarray) else item)
            elif not isinstance(item, (str, bytes, np.str_, np.bytes_)):
                raise TypeError(
                    f"HashStrings '{self.name}' takes string ids in `inputs`: every element "
                    f"a str or bytes ('' for a missing id), or a tf.string tensor. Received "
                    f"an element of type {type(item).__name__}: {item!r}. Integer ids need "
                    "no hashing: feed them to the embedding layer directly (or convert "
                    "them all with str()).")
        try:
            return tf.constant(inputs, tf.string)
        except ValueError:  # rows of different lengths
            return tf.ragged.constant(inputs, tf.string)

    @property
    def ids_input_dtype(self):
        """`"string"`: the dtype of the `keras.Input` a `keras.Sequential`
        without one makes for this layer (Keras would make it float32)."""
        return "string"

    def _strings(self, inputs):
        if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
            dtype = inputs.dtype
        else:
            inputs = tf.convert_to_tensor(inputs)
            dtype = inputs.dtype
        if dtype == tf.string:
            return inputs
        if _compat.in_symbolic_build():  # shapes only: see _compat.in_symbolic_build
            if isinstance(inputs, tf.RaggedTensor):
                return inputs.with_flat_values(tf.strings.as_string(inputs.flat_values))
            if isinstance(inputs, tf.SparseTensor):
                return inputs.with_values(tf.strings.as_string(inputs.values))
            return tf.strings.as_string(inputs)
        raise TypeError(self._dtype_error(dtype))

    def _dtype_error(self, dtype):
        return (
            f"HashStrings '{self.name}' expects string ids (tf.string). Received "
            f"ids of dtype {tf.as_dtype(dtype).name}. Integer ids need no hashing: "
            "feed them to the embedding layer directly. (Exporting a subclassed "
            "model? Keras records only its input shapes: pass `input_signature` "
            "with tf.string tf.TensorSpecs.)")

    def _check_rank(self, rank, kind):
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
        strings = self._strings(inputs)
        if isinstance(strings, tf.RaggedTensor):
            self._check_rank(strings.shape.rank, "ragged")
            keys = strings.with_flat_values(self._keys(strings.flat_values))
            if self.missing == "drop":
                keys = tf.ragged.boolean_mask(keys, tf.not_equal(strings, ""))
            return keys
        if isinstance(strings, tf.SparseTensor):
            self._check_rank(strings.shape.rank, "sparse")
            if self.missing == "drop":
                strings = tf.sparse.retain(strings, tf.not_equal(strings.values, ""))
            return strings.with_values(self._keys(strings.values))
        self._check_rank(strings.shape.rank, "dense")
        keys = self._keys(strings)
        if self.missing == "pad":
            return keys
        if strings.shape.rank == 1:
            strings, keys = strings[:, None], keys[:, None]
        return tf.ragged.boolean_mask(keys, tf.not_equal(strings, ""))

    def _keys(self, strings):
        keys = hash_strings(strings)
        if self.missing == "pad":
            keys = tf.where(tf.equal(strings, ""), tf.constant(PAD_ID, tf.int64), keys)
        return keys

    def compute_output_spec(self, inputs):
        dtype = getattr(inputs, "dtype", None)
        if dtype is not None and keras.backend.standardize_dtype(dtype) != "string" \
                and not _compat.in_symbolic_build():
            raise TypeError(self._dtype_error(dtype))
        shape = tuple(inputs.shape)
        sparse = bool(getattr(inputs, "sparse", False))
        ragged = bool(getattr(inputs, "ragged", False))
        kind = "sparse" if sparse else "ragged" if ragged else "dense"
        self._check_rank(len(shape), kind)
        if kind == "dense" and self.missing == "drop":
            return keras.KerasTensor((shape[0], None), dtype="int64", ragged=True)
        return keras.KerasTensor(shape, dtype="int64", sparse=sparse, ragged=ragged)

    def get_config(self):
        config = super().get_config()
        config["missing"] = self.missing
        return config
