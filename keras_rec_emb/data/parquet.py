"""`ParquetDataset`: Parquet files read by pyarrow, batched for either backend
(docs/semantics.md, 'Input pipelines')."""

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import operator
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from keras_rec_emb import _backend
from keras_rec_emb._checks_core import check_bool
from keras_rec_emb.data.dataframe import DataFrame
from keras_rec_emb.data.dataframe import dtype_name

if _backend.is_jax():
    from keras_rec_emb.backend.jax import data as _impl
else:
    from keras_rec_emb.backend.tensorflow import data as _impl


@dataclasses.dataclass(frozen=True)
class _Column:
    """How one column is read: output dtype name, ragged levels, dense inner shape."""

    name: str
    dtype: str
    ragged_rank: int
    shape: tuple[int, ...]


def _has_nulls(array):
    """Whether `array` (or, conservatively, any level below it) has nulls."""
    while True:
        if array.null_count:
            return True
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
                or pa.types.is_fixed_size_list(array.type)):
            return False
        array = array.values


def _fill_nulls(array):
    """`array` (same type) with null values as 0, False or b"" and null
    lists as empty lists (fixed-size lists keep their values)."""
    arrow_type = array.type
    n = len(array)
    if pa.types.is_fixed_size_list(arrow_type):
        size = arrow_type.list_size
        values = array.values.slice(array.offset * size, n * size)
        return pa.FixedSizeListArray.from_arrays(_fill_nulls(values), type=arrow_type)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        if array.null_count:
            lengths = pc.list_value_length(array).fill_null(0).to_numpy()
            offsets = np.zeros(n + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            values = array.flatten()
        else:
            offsets = array.offsets.to_numpy().astype(np.int64)
            values = array.values.slice(offsets[0], offsets[-1] - offsets[0])
            offsets -= offsets[0]
        width = pa.int64() if pa.types.is_large_list(arrow_type) else pa.int32()
        cls = pa.LargeListArray if pa.types.is_large_list(arrow_type) else pa.ListArray
        return cls.from_arrays(pa.array(offsets, width), _fill_nulls(values),
                               type=arrow_type)
    if not array.null_count:
        return array
    if pa.types.is_boolean(arrow_type):
        return array.fill_null(False)
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return array.fill_null(pa.scalar(0, arrow_type))
    return array.fill_null(pa.scalar(b"", pa.binary()).cast(arrow_type))


def _list_levels(arrow_type):
    """(list sizes outermost first, `None` for variable length; leaf type)."""
    levels = []
    while pa.types.is_list(arrow_type) or pa.types.is_large_list(
            arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        levels.append(arrow_type.list_size
                      if pa.types.is_fixed_size_list(arrow_type) else None)
        arrow_type = arrow_type.value_type
    return tuple(levels), arrow_type


def _leaf_dtype(arrow_type, name, source):
    if (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or pa.types.is_binary(arrow_type)
            or pa.types.is_large_binary(arrow_type)
            or pa.types.is_string_view(arrow_type)
            or pa.types.is_binary_view(arrow_type)):
        return "string"
    if (pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
            or pa.types.is_boolean(arrow_type)):
        # The NumPy dtype of an empty array of the type: to_pandas_dtype()
        # imports pandas (not a dependency) under pyarrow 21, the lowest we allow.
        return pa.array([], type=arrow_type).to_numpy(zero_copy_only=False).dtype.name
    raise TypeError(
        f"Column '{name}' of Parquet file '{source}' has type {arrow_type}, "
        "which ParquetDataset does not support. Supported: integers "
        "(int8..int64, uint8..uint64), floats (float16, float32, float64), "
        "bool, string/binary, and (nested) lists of those.")


def _arrow_leaf(dtype):
    if dtype == "string":
        return pa.large_string()
    return pa.from_numpy_dtype(np.dtype(dtype))


def _with_leaf(arrow_type, leaf):
    """`arrow_type` with its innermost value type replaced by `leaf`."""
    if pa.types.is_fixed_size_list(arrow_type):
        return pa.list_(_with_leaf(arrow_type.value_type, leaf),
                        arrow_type.list_size)
    if pa.types.is_large_list(arrow_type):
        return pa.large_list(_with_leaf(arrow_type.value_type, leaf))
    if pa.types.is_list(arrow_type):
        return pa.list_(_with_leaf(arrow_type.value_type, leaf))
    return leaf


def _output_type(arrow_type, dtype, name, source):
    """`arrow_type` with its leaf cast to `dtype` if that differs."""
    _, leaf = _list_levels(arrow_type)
    if _leaf_dtype(leaf, name, source) == dtype and not (
            pa.types.is_string_view(leaf) or pa.types.is_binary_view(leaf)):
        return arrow_type
    return _with_leaf(arrow_type, _arrow_leaf(dtype))


def _layout(levels, ragged_rank, shape, name, source):
    """(ragged_rank, shape) for a column with list `levels`, checked."""
    depth = len(levels)
    if shape is None:
        if ragged_rank is None:
            ragged_rank = depth
            while ragged_rank and levels[ragged_rank - 1] is not None:
                ragged_rank -= 1
        shape = levels[ragged_rank:]
        if None in shape:
            raise ValueError(
                f"Column '{name}' of Parquet file '{source}' has "
                f"variable-length list levels {levels} (None = variable) "
                f"below ragged_rank={ragged_rank}; give the field a `shape` "
                "for them or a larger `ragged_rank`.")
    elif ragged_rank is None:
        ragged_rank = depth - len(shape)
    if ragged_rank < 0 or ragged_rank + len(shape) != depth or any(
            level not in (None, size)
            for level, size in zip(levels[ragged_rank:], shape)):
        raise ValueError(
            f"Column '{name}' of Parquet file '{source}' has list levels "
            f"{levels} (None = variable length), which ragged_rank="
            f"{ragged_rank} and shape={tuple(shape)} do not describe: they "
            "must account for every level, and fixed sizes must match.")
    return ragged_rank, tuple(shape)


def _resolve(path):
    """(pyarrow filesystem, path in it) for a local path or a URI; URIs pyarrow
    does not know go through fsspec, which caches its filesystems itself."""
    if "://" not in path:
        return pafs.LocalFileSystem(), os.path.abspath(path)
    try:
        return pafs.FileSystem.from_uri(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        arrow_error = e
    allowed = ("Use a local path, a URI pyarrow.fs understands (file://, "
               "s3://, gs://, hdfs://, abfs://)")
    try:
        import fsspec
    except ImportError:
        raise ValueError(
            f"`filenames`: pyarrow has no filesystem for '{path}' "
            f"({arrow_error}), and fsspec is not installed. {allowed}, or "
            "`pip install fsspec` to read any fsspec URI.") from arrow_error
    try:
        filesystem, fs_path = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise ValueError(
            f"`filenames`: neither pyarrow nor fsspec has a filesystem for "
            f"'{path}' (pyarrow: {arrow_error}; fsspec: {e}). {allowed}, or "
            "a URI of an installed fsspec protocol.") from e
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), fs_path


def _open(path):
    filesystem, fs_path = _resolve(path)
    info = filesystem.get_file_info(fs_path)
    if info.type != pafs.FileType.File:
        raise ValueError(
            f"`filenames`: Parquet file '{path}' "
            f"{'does not exist' if info.type == pafs.FileType.NotFound else 'is not a file'}.")
    try:
        if isinstance(filesystem, pafs.LocalFileSystem):
            # Read, not memory-mapped: a file truncated or rewritten while it
            # is read then gives an error instead of SIGBUS.
            return pq.ParquetFile(fs_path, memory_map=False)
        return pq.ParquetFile(fs_path, filesystem=filesystem)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(
            f"`filenames`: '{path}' is not a readable Parquet file: {e}") from e


def _columns(fields, schema, source):
    """`_Column`s for `fields`, completed from `schema` when it is known."""
    if fields is None:
        if schema is None:
            raise ValueError(
                "`fields` is required when `filenames` is a symbolic tensor "
                "or a dataset: name the columns with `DataFrame.Field(name, "
                "type, ragged_rank, shape)`. Received: fields=None")
        fields = schema.names
    if isinstance(fields, (str, DataFrame.Field)):
        fields = [fields]
    if not isinstance(fields, (list, tuple)) or not fields:
        raise TypeError(
            "`fields` must be a column name, a `DataFrame.Field`, or a "
            f"non-empty list of them. Received: fields={fields!r}")
    columns = []
    for field in fields:
        if isinstance(field, str):
            field = DataFrame.Field(field)
        if not isinstance(field, DataFrame.Field):
            raise TypeError(
                "`fields` items must be column names or `DataFrame.Field`s. "
                f"Received: {field!r} in fields={fields!r}")
        columns.append(_column(field, schema, source))
    names = [c.name for c in columns]
    if len(set(names)) != len(names):
        raise ValueError(f"`fields` names a column twice. Received: {names}")
    return columns


def _column(field, schema, source):
    if schema is None:
        if field.type is None:
            raise ValueError(
                f"`fields`: field '{field.name}' needs a `type` because "
                "`filenames` is a symbolic tensor or a dataset (no schema "
                f"to read it from). Received: {field}")
        return _Column(field.name, dtype_name(field.type), field.ragged_rank or 0,
                       field.shape or ())
    if field.name not in schema.names:
        raise ValueError(
            f"`fields` names column '{field.name}', which is not in Parquet "
            f"file '{source}'. Available columns: {schema.names}")
    levels, leaf = _list_levels(schema.field(field.name).type)
    dtype = (dtype_name(field.type) if field.type is not None
             else _leaf_dtype(leaf, field.name, source))
    ragged_rank, shape = _layout(levels, field.ragged_rank, field.shape,
                                 field.name, source)
    return _Column(field.name, dtype, ragged_rank, shape)


@dataclasses.dataclass(frozen=True)
class _ReadOptions:
    batch_size: int
    drop_remainder: bool
    partition_count: int
    partition_index: int
    num_parallel_reads: int
    num_sequential_reads: int


def _integer(name, value, low, high=None, context=""):
    """`value` as an int in [low, high), else a ValueError naming `name`."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if (isinstance(value, bool) or number is None or number < low
            or (high is not None and number >= high)):
        allowed = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"`{name}` must be an integer {allowed}{context}. "
                         f"Received: {name}={value!r}")
    return number


def _read_options(batch_size, drop_remainder, partition_count,
                  partition_index, num_parallel_reads, num_sequential_reads):
    drop_remainder = check_bool("drop_remainder", drop_remainder)
    partition_count = _integer("partition_count", partition_count, 1)
    return _ReadOptions(
        batch_size=_integer("batch_size", batch_size, 1),
        drop_remainder=drop_remainder,
        partition_count=partition_count,
        partition_index=_integer(
            "partition_index", partition_index, 0, partition_count,
            f" (partition_count={partition_count})"),
        num_parallel_reads=1 if num_parallel_reads is None else _integer(
            "num_parallel_reads", num_parallel_reads, 1),
        num_sequential_reads=_integer("num_sequential_reads",
                                      num_sequential_reads, 1))


def _filenames(filenames):
    """(a dataset of 1-D string tensors of paths or None, the paths if known now)."""
    source, filenames = _impl.parquet_source(filenames)
    if source is not None:
        return source, None
    if isinstance(filenames, str):
        filenames = [filenames]
    if (not isinstance(filenames, (list, tuple)) or not filenames
            or not all(isinstance(f, str) for f in filenames)):
        raise TypeError(
            "`filenames` must be a path, a non-empty list of paths, a "
            "tf.string tensor or a dataset of filenames. "
            f"Received: filenames={filenames!r}")
    for path in filenames:
        _open(path).close()
    return None, list(filenames)


def _use_arrow_threads():
    """Applies ARROW_NUM_THREADS (>0: that many, 0: none, <0: all cores)."""
    value = os.environ.get("ARROW_NUM_THREADS")
    if value is None:
        return True
    try:
        threads = int(value)
    except ValueError:
        raise ValueError("ARROW_NUM_THREADS must be an integer. "
                         f"Received: ARROW_NUM_THREADS={value!r}") from None
    if threads == 0:
        return False
    pa.set_cpu_count(threads if threads > 0 else os.cpu_count())
    return True


class _FileReader:
    """The selected row groups of one file, read ahead in a pool, each through
    its own handle (a pyarrow reader is not shared between threads)."""

    _READ_AHEAD = 2

    def __init__(self, pool, parquet_files, row_groups, read_row_group):
        self._pool = pool
        self._files = parquet_files
        self._row_groups = collections.deque(enumerate(row_groups))
        self._read_row_group = read_row_group
        self._table = pa.table({})
        self._futures = collections.deque()
        self._fill()

    def _fill(self):
        while self._row_groups and len(self._futures) < len(self._files):
            i, row_group = self._row_groups.popleft()
            self._futures.append(self._pool.submit(
                self._read_row_group, self._files[i % len(self._files)], row_group))

    @property
    def exhausted(self):
        return not self._futures and self._table.num_rows == 0

    def take(self, rows):
        """Tables with up to `rows` rows in all (fewer at the end)."""
        tables = []
        while rows > 0 and not self.exhausted:
            if self._table.num_rows == 0:
                self._table = self._futures.popleft().result()
                self._fill()
                continue
            table = self._table.slice(0, rows)
            self._table = self._table.slice(table.num_rows)
            tables.append(table)
            rows -= table.num_rows
        if self.exhausted:
            self.close()
        return tables

    def close(self):
        for future in self._futures:
            future.cancel()
        for parquet_file in self._files:
            parquet_file.close()


def _partition(paths, options):
    """(path, open `ParquetFile`, its row groups in this partition) per file."""
    first_row_group = 0
    for path in paths:
        parquet_file = _open(path)
        count = parquet_file.num_row_groups
        yield path, parquet_file, [
            i for i in range(count)
            if (first_row_group + i) % options.partition_count == options.partition_index]
        first_row_group += count


def _file_readers(paths, columns, options, use_threads, pool):
    """`_FileReader`s of the files with row groups in this partition."""
    names = [c.name for c in columns]
    schema = None  # output Arrow schema, fixed by the first file
    for path, parquet_file, row_groups in _partition(paths, options):
        file_schema = parquet_file.schema_arrow
        for column in columns:
            if column.name not in file_schema.names:
                raise ValueError(
                    f"Column '{column.name}' is not in Parquet file '{path}'. "
                    f"Available columns: {file_schema.names}")
            levels, _ = _list_levels(file_schema.field(column.name).type)
            _layout(levels, column.ragged_rank, column.shape, column.name, path)
        if schema is None:
            schema = pa.schema([
                pa.field(c.name, _output_type(file_schema.field(c.name).type,
                                              c.dtype, c.name, path))
                for c in columns
            ])
        if not row_groups:
            parquet_file.close()
            continue
        handles = [parquet_file] + [
            _open(path) for _ in range(min(len(row_groups), _FileReader._READ_AHEAD) - 1)]
        yield _FileReader(
            pool, handles, row_groups,
            functools.partial(_read_row_group, names=names, schema=schema,
                              path=path, use_threads=use_threads))


def _num_batches(paths, options):
    """Batches one pass yields, from the files' metadata: the rows of this
    partition's row groups, in batches of `batch_size` across row group and
    file boundaries."""
    rows = 0
    for _, parquet_file, row_groups in _partition(paths, options):
        try:
            rows += sum(parquet_file.metadata.row_group(i).num_rows for i in row_groups)
        finally:
            parquet_file.close()
    if options.drop_remainder:
        return rows // options.batch_size
    return -(-rows // options.batch_size)


def _read_row_group(parquet_file, index, names, schema, path, use_threads):
    try:
        table = parquet_file.read_row_group(index, columns=names,
                                            use_threads=use_threads)
    except (pa.ArrowException, OSError) as e:  # corrupt pages, truncated file
        raise ValueError(
            f"Parquet file '{path}' cannot be read (row group {index}): {e}. "
            "The file is corrupt or truncated; rewrite it or leave it out") from e
    arrays = []
    for field in schema:
        column = table.column(field.name)
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValueError(
                    f"Column '{field.name}' of Parquet file '{path}' cannot be "
                    f"read as {field.type}: {e}") from e
        if any(_has_nulls(chunk) for chunk in column.chunks):
            column = pa.chunked_array([_fill_nulls(c) for c in column.chunks],
                                      type=field.type)
        arrays.append(column)
    return pa.Table.from_arrays(arrays, schema=schema)


def _tables(paths, columns, options, use_threads):
    """Tables of the partition's row groups: `num_sequential_reads` batches'
    rows from each of the `num_parallel_reads` open files in turn."""
    block_rows = options.num_sequential_reads * options.batch_size
    with concurrent.futures.ThreadPoolExecutor(
            options.num_parallel_reads * _FileReader._READ_AHEAD) as pool:
        files = _file_readers(paths, columns, options, use_threads, pool)
        active = collections.deque(
            itertools.islice(files, options.num_parallel_reads))
        try:
            while active:
                reader = active.popleft()
                yield from reader.take(block_rows)
                active.extend(itertools.islice(files, 1) if reader.exhausted
                              else [reader])
        finally:  # also when the pass is abandoned early
            for reader in active:
                reader.close()


def _table_batches(paths, columns, options):
    """Lists of `batch_size`-row Arrow tables, one list per table read (a
    backend hands them over once per table); only the last batch is short."""
    leftover = None
    for table in _tables(paths, columns, options, _use_arrow_threads()):
        if leftover is not None and leftover.num_rows:
            table = pa.concat_tables([leftover, table])
        start, batches = 0, []
        while table.num_rows - start >= options.batch_size:
            batches.append(table.slice(start, options.batch_size))
            start += options.batch_size
        if batches:
            yield batches
        leftover = table.slice(start)
    if leftover is not None and leftover.num_rows and not options.drop_remainder:
        yield [leftover]


class ParquetDataset(_impl.Dataset):
    """Batches read from Parquet files: a `tf.data.Dataset` under Keras's
    TensorFlow backend, an iterable of NumPy batches under JAX.

    Each element is a dict from column name to a batch of `batch_size` rows,
    taken in file order across row groups and files. See docs/semantics.md,
    'Input pipelines'.

    Args:
        filenames: Parquet files: a path or URI (`str`) or a list/tuple of
            them; under TensorFlow also a 0-D/1-D `tf.string` tensor, or a
            dataset of scalar `tf.string` (finite: it is read in full when
            iteration starts). Local paths, any URI of `pyarrow.fs`
            (file://, s3://, gs://, hdfs://), and, when fsspec is installed,
            any other fsspec URI (memory://, ...).
        batch_size: int. Rows per batch. Defaults to `1`.
        fields: column name, `DataFrame.Field`, or a list of them, optional.
            Defaults to `None`: every column. Required (as `Field`s with a
            `type`) when `filenames` is a symbolic tensor or a dataset.
        partition_count: int. Number of row-group partitions. Defaults to `1`.
        partition_index: int. Partition to read, in
            `[0, partition_count)`. Defaults to `0`.
        drop_remainder: bool. Drop the last batch if it is short. Defaults to
            `False`.
        num_parallel_reads: int, optional. Files read at once, each by its own
            thread. Defaults to `None`: one file after the other.
        num_sequential_reads: int. With several files open, how many batches
            worth of rows to take from one before moving to the next.
            Defaults to `1`.

    Example:

    >>> import os, tempfile
    >>> import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    >>> from keras_rec_emb.data import ParquetDataset
    >>> path = os.path.join(tempfile.mkdtemp(), "clicks.parquet")
    >>> pq.write_table(pa.table({"user": [1, 2, 3],
    ...                          "items": [[10, 11], [], [12]]}), path)
    >>> batch = next(iter(ParquetDataset(path, batch_size=2)))
    >>> np.asarray(batch["user"]).tolist()
    [1, 2]
    """

    def __init__(self, filenames, batch_size=1, fields=None, partition_count=1,
                 partition_index=0, drop_remainder=False, num_parallel_reads=None,
                 num_sequential_reads=1):
        options = _read_options(batch_size, drop_remainder, partition_count, partition_index,
                                num_parallel_reads, num_sequential_reads)
        source, paths = _filenames(filenames)
        schema = _open(paths[0]).schema_arrow if paths else None
        columns = _columns(fields, schema, paths[0] if paths else None)
        super().__init__(_impl.parquet_dataset(
            source if paths is None else paths, columns, options,
            functools.partial(_table_batches, columns=columns, options=options),
            None if paths is None else _num_batches(paths, options)))


def read_parquet(batch_size, fields=None, partition_count=1, partition_index=0,
                 drop_remainder=False, num_parallel_reads=None, num_sequential_reads=1):
    """A transformation reading a dataset of filenames as a `ParquetDataset`
    (TensorFlow backend: a tf.data transformation; under JAX give
    `ParquetDataset` the list of paths).

    Args:
        batch_size, partition_count, partition_index, drop_remainder,
        num_parallel_reads, num_sequential_reads: as in `ParquetDataset`.
        fields: `DataFrame.Field` or list of them (each with a `type`),
            required because the files are only known at run time.

    Returns:
        A function `Dataset -> ParquetDataset` for `Dataset.apply`.

    Example:

    >>> import os, tempfile
    >>> import pyarrow as pa, pyarrow.parquet as pq, tensorflow as tf
    >>> from keras_rec_emb.data import DataFrame, read_parquet
    >>> path = os.path.join(tempfile.mkdtemp(), "part-0.parquet")
    >>> pq.write_table(pa.table({"a": [1, 2, 3]}), path)
    >>> ds = tf.data.Dataset.from_tensor_slices([path]).apply(
    ...     read_parquet(2, fields=[DataFrame.Field("a", tf.int64)]))
    >>> [b["a"].numpy().tolist() for b in ds]
    [[1, 2], [3]]
    """
    if _backend.is_jax():
        raise _impl.tensorflow_only(
            "read_parquet (a transformation of a tf.data dataset of filenames)",
            "ParquetDataset(list_of_paths, ...)")

    def apply(filenames):
        return ParquetDataset(filenames, batch_size, fields, partition_count, partition_index,
                              drop_remainder, num_parallel_reads, num_sequential_reads)

    return apply
