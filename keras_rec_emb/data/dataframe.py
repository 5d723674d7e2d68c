"""`DataFrame`: typed column selection for `ParquetDataset`."""

import dataclasses

from keras_rec_emb import _backend

if _backend.is_jax():
    from keras_rec_emb.backend.jax import data as _impl
else:
    from keras_rec_emb.backend.tensorflow import data as _impl

# Names of the output dtypes a column can have (also the dtypes a `Field` may
# ask for).
SUPPORTED_DTYPES = (
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "bool", "string",
)


def dtype_name(dtype):
    """The name of a `Field`'s `type` (a `tf.DType` or, under JAX, the name)."""
    return dtype if isinstance(dtype, str) else dtype.name


class DataFrame:
    """Named, typed columns read from Parquet.

    A column has a logical type (scalar, fixed-length list, variable-length
    list, nested list) and a physical type (integer, float, string); how each
    reads: docs/semantics.md, 'Input pipelines'.

    Example:

    >>> from keras_rec_emb.data import DataFrame
    >>> field = DataFrame.Field("clicks", "int64", ragged_rank=1)
    >>> DataFrame.Field.from_config(field.get_config()) == field
    True
    """

    @dataclasses.dataclass(frozen=True)
    class Field:
        """One column to read, optionally with its type and shape.

        Attributes left `None` are taken from the Parquet schema; they are
        required when the files are only known at run time (filenames given
        as a tensor or a dataset).

        Args:
            name: str. Name of the column.
            type: dtype name (`"int64"`, `"string"`, ...), NumPy dtype or
                `tf.DType`, optional: a `tf.DType` under TensorFlow, the
                name under JAX once the field is made. Output dtype. When the
                column's physical type differs, pyarrow casts it (safe cast:
                overflow is an error). Defaults to `None` (the column's type).
            ragged_rank: int, optional. Number of variable-length list levels
                (outermost first) returned as ragged dimensions. Defaults to
                `None`: all leading variable-length levels.
            shape: tuple of ints, optional. Shape of the innermost fixed-length
                list levels, e.g. `(4,)` for a list of exactly 4 values per
                row; variable-length lists read this way must have exactly
                that many values in every row. Defaults to `None`: the sizes of
                the trailing fixed-size list levels (`()` for scalars).

        Example:

        >>> from keras_rec_emb.data import DataFrame
        >>> DataFrame.Field("embedding", "float32", shape=(4,)).shape
        (4,)
        """

        name: str
        type: object = None
        ragged_rank: int | None = None
        shape: tuple[int, ...] | None = None

        def __post_init__(self):
            if not isinstance(self.name, str) or not self.name:
                raise TypeError(
                    "`name` must be a non-empty string. "
                    f"Received: name={self.name!r}")
            if self.type is not None:
                try:
                    dtype = _impl.as_dtype(self.type)
                except TypeError:
                    dtype = None
                if dtype is None or dtype_name(dtype) not in SUPPORTED_DTYPES:
                    raise TypeError(
                        f"`type` of field '{self.name}' must be one of "
                        f"{list(SUPPORTED_DTYPES)}. "
                        f"Received: type={self.type!r}")
                object.__setattr__(self, "type", dtype)
            if self.ragged_rank is not None and (
                    not isinstance(self.ragged_rank, int)
                    or isinstance(self.ragged_rank, bool)
                    or self.ragged_rank < 0):
                raise ValueError(
                    f"`ragged_rank` of field '{self.name}' must be a "
                    f"non-negative integer. Received: "
                    f"ragged_rank={self.ragged_rank!r}")
            if self.shape is not None:
                # A tf.TensorShape iterates as its dimensions (ints).
                shape = tuple(self.shape) if isinstance(self.shape, (list, tuple)) or (
                    type(self.shape).__name__ == "TensorShape") else None
                if shape is None or not all(
                        isinstance(d, int) and not isinstance(d, bool)
                        and d > 0 for d in shape):
                    raise ValueError(
                        f"`shape` of field '{self.name}' must be a tuple of "
                        f"positive integers. Received: shape={self.shape!r}")
                object.__setattr__(self, "shape", shape)

        def get_config(self):
            return {
                "name": self.name,
                "type": None if self.type is None else dtype_name(self.type),
                "ragged_rank": self.ragged_rank,
                "shape": None if self.shape is None else list(self.shape),
            }

        @classmethod
        def from_config(cls, config):
            return cls(**config)

    @staticmethod
    def to_sparse(num_parallel_calls=None):
        """A dataset transformation turning ragged values into sparse ones.

        Every `tf.RaggedTensor` in an element, at any nesting, becomes the
        equivalent `tf.SparseTensor`; other values pass through.

        Args:
            num_parallel_calls: int, optional. Passed to `Dataset.map`.
                Defaults to `None` (sequential).

        Returns:
            A function `Dataset -> Dataset` for `Dataset.apply` (TensorFlow
            backend; under JAX lists come padded and this raises).

        Example:

        >>> import tensorflow as tf
        >>> from keras_rec_emb.data import DataFrame
        >>> ds = tf.data.Dataset.from_tensors(
        ...     {"ids": tf.ragged.constant([[1, 2], [3]])})
        >>> batch = next(iter(ds.apply(DataFrame.to_sparse())))
        >>> batch["ids"].indices.numpy().tolist()
        [[0, 0], [0, 1], [1, 0]]
        """
        return _impl.to_sparse(num_parallel_calls)
