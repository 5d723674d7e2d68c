"""The JAX side of `keras_rec_emb.data`: datasets are Python iterables of
NumPy batches (no TensorFlow), and Keras data adapters, so that `fit`,
`evaluate` and `predict` take them as they take a `tf.data.Dataset`.

Ragged values have no NumPy form: they come as dense arrays padded to the
batch's longest row rounded up to a power of two (so that a compiled step
sees few shapes), with -1 for signed integers (the layers' padding id), 0
for unsigned integers and floats, `False` and `b""`, at every ragged level.
"""

import numpy as np
import pyarrow as pa

from keras_rec_emb import _keras_fixes

# `fit`, `evaluate` and `predict` build the model from the batch
# `Dataset._kre_peek` gives, which the epoch then starts with (see
# `_keras_fixes`).
_keras_fixes.fix_symbolic_build_peek()
_keras_fixes.fix_predict_build_peek()

# Dtype names a `DataFrame.Field` may hold (its `type` under this backend).
_STRINGS = ("string", "str", "bytes")


def as_dtype(value):
    """The dtype name `value` (a name, a NumPy dtype or type) stands for;
    TypeError if none."""
    if isinstance(value, str):
        return "string" if value in _STRINGS else np.dtype(value).name
    if value in (str, bytes, np.str_, np.bytes_):
        return "string"
    return np.dtype(value).name


def tensorflow_only(what, alternative):
    """The error for a tf.data feature used under the JAX backend."""
    return NotImplementedError(
        f"{what} is a tf.data feature: it runs on Keras's TensorFlow backend only, and the "
        f"active backend is 'jax'. Under JAX: {alternative}.")


# tf.data.Dataset methods that the JAX datasets do not have (the error names
# what to do instead).
_TF_DATA_METHODS = frozenset((
    "apply", "batch", "bucket_by_sequence_length", "cache", "cardinality", "concatenate",
    "element_spec", "enumerate", "filter", "flat_map", "interleave", "padded_batch", "prefetch",
    "ragged_batch", "rebatch", "reduce", "scan", "shard", "shuffle", "skip", "snapshot",
    "unbatch", "window", "with_options", "zip"))


class Dataset(_keras_fixes.data_adapter_base()):
    """Batches as NumPy arrays: each iteration is a new pass (`make_iterator()`)
    of `num_batches` batches (None: until the pass ends), which `fit`, `evaluate`
    and `predict` iterate as a `tf.data.Dataset` (a pass per epoch, in order)."""

    # A pass whose first batch Keras read to build the model (`_kre_peek`),
    # that batch first again: the next iteration.
    _kre_peeked = None

    def __init__(self, make_iterator, num_batches=None):
        if isinstance(make_iterator, Dataset):
            # A public class wraps the pipeline built for it (as under TensorFlow).
            make_iterator, num_batches = make_iterator._make_iterator, make_iterator._length
        self._make_iterator = make_iterator
        self._length = num_batches

    def __iter__(self):
        peeked, self._kre_peeked = self._kre_peeked, None
        return iter(self._make_iterator()) if peeked is None else peeked

    def _kre_peek(self):
        """The first batch of a new pass, as `get_jax_iterator()` gives it,
        for Keras's symbolic build (`_keras_fixes.fix_symbolic_build_peek`);
        that pass, this batch first, is the next iteration, so that the
        epoch after the build trains on it (a stream, such as a Kafka
        dataset, has no second pass that would read it again).
        StopIteration when the pass is empty."""
        rest = iter(self)
        first = next(rest)
        self._kre_peeked = _replay(first, rest)
        return next(_keras_fixes.jax_iterator(iter([first])))

    def map(self, map_func):
        """A dataset of `map_func(element)` (a tuple element is passed as
        positional arguments, as `tf.data.Dataset.map` does)."""
        if not callable(map_func):
            raise TypeError(f"`map_func` must be callable. Received: map_func={map_func!r}")

        def mapped():
            for element in self:
                yield map_func(*element) if isinstance(element, tuple) else map_func(element)

        return Dataset(mapped, self._length)

    def take(self, count):
        """A dataset of the first `count` elements of each pass (-1: all)."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < -1:
            raise ValueError(f"`count` must be -1 or a non-negative integer. "
                             f"Received: count={count!r}")
        if count == -1:
            return Dataset(self._make_iterator, self._length)

        def taken():
            iterator = iter(self)
            try:
                for _ in range(count):
                    yield next(iterator)
            except StopIteration:
                return
            finally:
                getattr(iterator, "close", lambda: None)()

        length = count if self._length is None else min(count, self._length)
        return Dataset(taken, length if self._length is not None else None)

    def __getattr__(self, name):
        if name in _TF_DATA_METHODS:
            raise AttributeError(str(tensorflow_only(
                f"`{type(self).__name__}.{name}`", "this dataset is a Python iterable of NumPy batches that "
                "model.fit takes as it is; transform its elements with `.map(fn)`, limit it "
                "with `.take(n)`, repeat it with `fit(epochs=...)`")))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # Keras's DataAdapter interface.

    def get_numpy_iterator(self):
        return iter(self)

    def get_jax_iterator(self):
        return _keras_fixes.jax_iterator(iter(self))

    def get_tf_dataset(self):
        raise tensorflow_only("get_tf_dataset", "get_numpy_iterator() or get_jax_iterator()")

    def get_torch_dataloader(self):
        raise NotImplementedError("keras_rec_emb.data datasets run under the JAX backend "
                                  "here; use get_numpy_iterator()")

    @property
    def num_batches(self):
        return self._length

    @property
    def batch_size(self):
        return None

    @property
    def has_partial_batch(self):
        return None

    @property
    def partial_batch_size(self):
        return None


def _replay(first, rest):
    """`first`, then the rest of the pass; closing it closes the pass."""
    try:
        yield first
        yield from rest
    finally:
        getattr(rest, "close", lambda: None)()


def _pad_value(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        return -1
    if dtype.kind == "O":
        return b""
    return dtype.type(0)


def _width(lengths):
    longest = int(lengths.max()) if lengths.size else 0
    return 0 if longest == 0 else 1 << (longest - 1).bit_length()


def padded(values, nested_splits):
    """The dense form of a ragged value (`values`, outermost row splits
    first): each ragged level padded as the module docstring says."""
    pad = _pad_value(values.dtype)
    for splits in reversed(nested_splits):
        splits = np.asarray(splits, np.int64)
        lengths = np.diff(splits)
        out = np.full((len(lengths), _width(lengths), *values.shape[1:]), pad, values.dtype)
        rows = np.repeat(np.arange(len(lengths)), lengths)
        cols = np.arange(splits[-1] - splits[0]) - np.repeat(splits[:-1] - splits[0], lengths)
        out[rows, cols] = values[splits[0]:splits[-1]]
        values = out
    return values


def _leaf_numpy(array):
    if pa.types.is_large_string(array.type) or pa.types.is_string(array.type):
        # As TensorFlow's tf.string: bytes.
        return array.cast(pa.large_binary()).to_numpy(zero_copy_only=False)
    return array.to_numpy(zero_copy_only=False)


def _column_numpy(array, column):
    """One column of a batch (`pa.Array`, nulls filled) as NumPy."""
    rows = len(array)
    levels = []  # row splits of each list level, outermost first
    while (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
           or pa.types.is_fixed_size_list(array.type)):
        if pa.types.is_fixed_size_list(array.type):
            size = array.type.list_size
            splits = np.arange(len(array) + 1, dtype=np.int64) * size
            array = array.values.slice(array.offset * size, len(array) * size)
        else:
            splits = np.asarray(array.offsets, np.int64)
            array = array.values.slice(splits[0], splits[-1] - splits[0])
            splits = splits - splits[0]
        levels.append(splits)
    values = _leaf_numpy(array)
    ragged, dense = levels[:column.ragged_rank], levels[column.ragged_rank:]
    for splits, size in zip(dense, column.shape):
        if np.any(np.diff(splits) != size):
            raise ValueError(
                f"Column '{column.name}' has a row whose list does not have the "
                f"{size} values of its field's shape={column.shape}.")
    values = values.reshape(-1, *column.shape)
    if not ragged:
        return values.reshape(rows, *column.shape)
    return padded(values, ragged)


def parquet_dataset(source, columns, options, table_batches, num_batches):
    """The iterable of a `ParquetDataset`: `table_batches(paths)` (lists of
    batch tables) as dicts of NumPy arrays, column by column."""

    def batches():
        for tables in table_batches(source):
            for table in tables:
                yield {c.name: _column_numpy(table.column(c.name).combine_chunks(), c)
                       for c in columns}

    return Dataset(batches, num_batches)


def parquet_source(filenames):
    return None, filenames


def to_sparse(num_parallel_calls):
    raise tensorflow_only(
        "DataFrame.to_sparse()", "variable-length list columns come as dense arrays padded "
        "with -1 (see keras_rec_emb.data.ParquetDataset), which the layers take with "
        "prune_invalid_ids=True")


# -- Kafka ------------------------------------------------------------------------

# `KafkaPosition`'s base: its offsets (`offsets()`) are what a checkpoint saves.
PositionBase = object


def strings(value):
    return value


def kafka_dataset(make_pass, batch_size, message_key):
    """The iterable of a Kafka dataset: one `make_pass()` iterator (see
    `data/kafka._Pass`) per pass, its components as NumPy arrays of bytes
    (the placeholders of empty polls left out)."""

    def elements():
        messages = make_pass()
        try:
            for ok, *components in messages:
                if ok:
                    yield tuple(components) if message_key else components[0]
        finally:
            messages.close()

    return Dataset(elements)


# -- Decoders ---------------------------------------------------------------------


def decode_csv(record_defaults, names, field_delim, use_quote_delim, na_value, select_cols):
    raise tensorflow_only("decode_csv (tf.io.decode_csv)",
                          "decode_json, or pyarrow.csv over the message bytes in `.map(fn)`")


def decode_example(features):
    raise tensorflow_only("decode_example (tf.io.parse_example)",
                          "decode_json, or a parser of your records in `.map(fn)`")


def decode_json(parser, fields):
    """`decode_json`'s function over NumPy (or Python) batches of records."""

    def decode(records):
        records = np.asarray(records, dtype=object)
        if any(f.ragged_rank or f.shape for f in fields) and records.ndim != 1:
            raise ValueError("decode_json: list fields need 1-D `records`. "
                             f"Received shape {records.shape}")
        flat = np.array([r.encode() if isinstance(r, str) else bytes(r)
                         for r in records.reshape(-1)], dtype=object)
        outs = iter(parser(flat))
        result = {}
        for f in fields:
            values = next(outs)
            if f.ragged_rank or f.shape:
                splits = next(outs)
                if f.shape:  # padded with 0 or cut to the shape, as in TensorFlow
                    lengths, width = np.diff(splits), f.shape[0]
                    rows = np.repeat(np.arange(len(lengths)), lengths)
                    cols = np.arange(splits[-1]) - np.repeat(splits[:-1], lengths)
                    keep = cols < width
                    dense = np.zeros((len(lengths), width), values.dtype)
                    dense[rows[keep], cols[keep]] = values[keep]
                    values = dense
                else:
                    values = padded(values, [splits])
            else:
                values = values.reshape(records.shape)
            result[f.name] = values
        return result

    return decode
