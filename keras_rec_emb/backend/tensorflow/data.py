"""The TensorFlow side of `keras_rec_emb.data`: tf.data pipelines over the
backend-neutral readers (pyarrow for Parquet, confluent-kafka for Kafka).

`python_dataset` makes a `tf.data.Dataset` of a Python iterator of NumPy
batches (not `from_generator`: its per-component checks are costly on wide
batches). `WrappedDataset` lets a public class be a real `tf.data.Dataset`
whose pipeline is built in its constructor, as `tf.data.TFRecordDataset` is.
"""

import collections
import itertools
import threading

import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops

# A batch size that gathers a whole (finite) dataset of filenames.
_ALL_FILES = 2**62


class _Passes:
    """The live Python iterators of one dataset, one per pass, keyed by id."""

    def __init__(self, make_iterator):
        self._make_iterator = make_iterator
        self._iterators = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def start(self, *args):
        iterator = self._make_iterator(*args)
        with self._lock:
            pass_id = next(self._ids)
            self._iterators[pass_id] = iterator
        return np.int64(pass_id)

    def next(self, pass_id):
        # StopIteration becomes OutOfRange, which ends the pass.
        return next(self._iterators[int(pass_id)])

    def finish(self, pass_id):
        with self._lock:
            iterator = self._iterators.pop(int(pass_id), None)
        if iterator is not None:
            iterator.close()
        return np.int64(0)


def python_dataset(make_iterator, args, component_dtypes, to_element,
                   element_spec):
    """A dataset whose elements are built from a Python iterator.

    Args:
        make_iterator: callable; called with the NumPy values of `args` once
            per pass (each new TF iterator) and returns an iterator of lists
            of NumPy arrays, one list per element, matching `component_dtypes`.
            It is closed when the pass ends.
        args: tuple of tensors handed to `make_iterator`.
        component_dtypes: list of `tf.DType`, one per array.
        to_element: graph function from the list of component tensors (shape
            unknown) to the element (tensors, ragged tensors, nested).
        element_spec: the `tf.TypeSpec` structure `to_element` returns.
    """
    passes = _Passes(make_iterator)

    @tf.autograph.experimental.do_not_convert
    def init(*arg_tensors):
        return tf.numpy_function(passes.start, list(arg_tensors), tf.int64)

    @tf.autograph.experimental.do_not_convert
    def next_element(pass_id):
        components = tf.numpy_function(passes.next, [pass_id],
                                       component_dtypes)
        return to_element(components)

    @tf.autograph.experimental.do_not_convert
    def finalize(pass_id):
        return tf.numpy_function(passes.finish, [pass_id], tf.int64)

    return _compat.GeneratorDataset(
        tuple(args), init, next_element, finalize, element_spec)


class WrappedDataset(tf.data.Dataset):
    """A `tf.data.Dataset` that is the pipeline `impl` built by a subclass."""

    def __init__(self, impl):
        self._impl = impl
        super().__init__(_compat.dataset_variant(impl))

    def _inputs(self):
        return _compat.dataset_inputs(self._impl)

    @property
    def element_spec(self):
        return self._impl.element_spec


Dataset = WrappedDataset


def as_dtype(value):
    """`value` as a `tf.DType` (TypeError if it names none): what a
    `DataFrame.Field`'s `type` holds under this backend."""
    return tf.as_dtype(value)


# -- Parquet ----------------------------------------------------------------------


def parquet_source(filenames):
    """(a dataset of 1-D string tensors of paths or None, the `filenames` to
    check as paths): tensors and datasets of filenames are this backend's."""
    if isinstance(filenames, tf.data.Dataset):
        if filenames.element_spec != tf.TensorSpec([], tf.string):
            raise TypeError(
                "A dataset of `filenames` must have scalar tf.string elements. "
                f"Received: element_spec={filenames.element_spec}")
        return filenames.batch(_ALL_FILES), None
    if isinstance(filenames, tf.Tensor):
        if filenames.dtype != tf.string or filenames.shape.rank not in (0, 1):
            raise TypeError(
                "A `filenames` tensor must be a 0-D or 1-D tf.string tensor. "
                f"Received: {filenames!r}")
        if not tf.executing_eagerly():
            return tf.data.Dataset.from_tensors(tf.reshape(filenames, [-1])), None
        filenames = [f.decode() for f in filenames.numpy().reshape([-1])]
    return None, filenames


def _component_dtypes(column):
    """What `KRE>ArrowBatchToTensors` returns for a column: values, then one
    row_splits vector per ragged level."""
    return [tf.as_dtype(column.dtype)] + [tf.int64] * column.ragged_rank


def _to_tensor(column, components, batch_dim):
    """Graph side of the components: a `tf.Tensor` or `tf.RaggedTensor`."""
    values, *splits = components
    outer = [batch_dim] if not splits else [None]
    values.set_shape(outer + list(column.shape))
    if not splits:
        return values
    splits[0].set_shape([None if batch_dim is None else batch_dim + 1])
    for inner in splits[1:]:
        inner.set_shape([None])
    return tf.RaggedTensor.from_nested_row_splits(values, splits, validate=False)


class _Exports:
    """Exports tables as Arrow C structs (ArrowArray then ArrowSchema) in
    memory kept here until `KRE>ArrowBatchToTensors` has moved them out."""

    _ARRAY_BYTES, _SCHEMA_BYTES = 80, 72
    # uint64 index of each struct's `release` pointer (0 once moved out).
    _ARRAY_RELEASE, _SCHEMA_RELEASE = 8, (80 + 56) // 8

    def __init__(self):
        self._live = collections.deque()

    def export(self, table):
        batches = table.to_batches()
        if len(batches) != 1:
            batches = table.combine_chunks().to_batches()
        memory = np.zeros((self._ARRAY_BYTES + self._SCHEMA_BYTES) // 8, np.uint64)
        array = memory.ctypes.data
        _compat.export_record_batch(batches[0], array, array + self._ARRAY_BYTES)
        _ops.arrow_register(array, array + self._ARRAY_BYTES)
        self._live.append(memory)
        while self._live and not self._pending(self._live[0]):
            _ops.arrow_unregister(self._live.popleft().ctypes.data)
        return np.array([array, array + self._ARRAY_BYTES], np.int64)

    def _pending(self, memory):
        return bool(memory[self._ARRAY_RELEASE] or memory[self._SCHEMA_RELEASE])

    def close(self):
        """Releases exported batches that were never consumed."""
        while self._live:
            memory = self._live.popleft()
            array = memory.ctypes.data
            _ops.arrow_unregister(array)
            if self._pending(memory):
                _compat.import_record_batch(array, array + self._ARRAY_BYTES)


def _exported_batches(table_batches):
    """The batch tables of `table_batches` as Arrow C structs: per table read, a
    1-element list of the `[k, 2]` addresses of its k batches (Python entered
    once per table, not per batch)."""
    exports = _Exports()
    try:
        for tables in table_batches:
            yield [np.stack([exports.export(table) for table in tables])]
    finally:
        exports.close()


def parquet_dataset(source, columns, options, table_batches, num_batches):
    """The tf.data pipeline of a `ParquetDataset`: each batch comes as two Arrow
    C data interface addresses, which `KRE>ArrowBatchToTensors` turns into
    column tensors (sharing aligned Arrow buffers). `source`: a dataset of
    1-D path tensors or a list of paths."""
    if not isinstance(source, tf.data.Dataset):
        source = tf.data.Dataset.from_tensors(tf.constant(source))
    batch_dim = options.batch_size if options.drop_remainder else None
    out_types = [d for c in columns for d in _component_dtypes(c)]

    @tf.autograph.experimental.do_not_convert
    def to_element(addresses):
        components = iter(_ops.gen().kre_arrow_batch_to_tensors(
            addresses, out_types=out_types,
            ragged_ranks=[c.ragged_rank for c in columns],
            inner_ranks=[len(c.shape) for c in columns],
            inner_shapes=[d for c in columns for d in c.shape]))
        return {
            c.name: _to_tensor(
                c, list(itertools.islice(components, 1 + c.ragged_rank)), batch_dim)
            for c in columns
        }

    @tf.autograph.experimental.do_not_convert
    def read(paths):
        @tf.autograph.experimental.do_not_convert
        def first(components):
            components[0].set_shape([None, 2])
            return components[0]

        def make_iterator(paths):
            return _exported_batches(table_batches([p.decode() for p in paths]))

        addresses = python_dataset(make_iterator, (paths,), [tf.int64], first,
                                   tf.TensorSpec([None, 2], tf.int64))
        return addresses.unbatch().map(to_element)

    dataset = source.flat_map(read)
    if num_batches is not None:
        # Known from the metadata: Keras shows progress with an ETA and
        # ends each epoch on the last batch ("ran out of data" otherwise).
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(num_batches))
    return dataset


def to_sparse(num_parallel_calls):
    """`DataFrame.to_sparse`: a `Dataset.apply` function mapping every
    `tf.RaggedTensor` of an element to a `tf.SparseTensor`."""

    def convert(*element):
        element = element[0] if len(element) == 1 else element
        return tf.nest.map_structure(
            lambda value: value.to_sparse()
            if isinstance(value, tf.RaggedTensor) else value, element)

    def apply(dataset):
        return dataset.map(convert, num_parallel_calls=num_parallel_calls)

    return apply


# -- Kafka ------------------------------------------------------------------------


class PositionBase(_compat.Trackable):
    """`KafkaPosition`'s base: its offsets are the state a
    `tf.train.Checkpoint` saves and restores."""

    def _serialize_to_tensors(self):
        items = sorted(self.offsets().items())
        return {
            "topics": tf.constant([t for (t, _), _ in items], tf.string),
            "partitions": tf.constant([p for (_, p), _ in items], tf.int64),
            "offsets": tf.constant([o for _, o in items], tf.int64),
        }

    def _restore_from_tensors(self, restored_tensors):
        topics, partitions, offsets = (
            restored_tensors[k].numpy() for k in ("topics", "partitions", "offsets"))
        self._set_offsets({(t.decode(), int(p)): int(o)
                           for t, p, o in zip(topics, partitions, offsets)})


def strings(value):
    """A `tf.string` tensor argument as a list of str (else `value`)."""
    if isinstance(value, tf.Tensor):
        return [v.decode() for v in value.numpy().reshape([-1])]
    return value


def kafka_dataset(make_pass, batch_size, message_key):
    """The tf.data pipeline of a Kafka dataset: one `make_pass()` iterator
    (see `data/kafka._Pass`) per pass, its components as string tensors."""
    spec = tf.TensorSpec([] if batch_size is None else [None], tf.string)
    spec = (spec, spec) if message_key else spec
    dtypes = [tf.string] * (2 if message_key else 1)
    shape = [] if batch_size is None else [None]

    def to_element(components):
        ok = tf.ensure_shape(components[0], [])
        tensors = [tf.ensure_shape(c, shape) for c in components[1:]]
        return ok, (tuple(tensors) if message_key else tensors[0])

    # Keep tf.data from reading ahead on its own (an injected prefetch,
    # maps made parallel), so `position` matches what was consumed.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    options.experimental_optimization.map_parallelization = False
    flagged = (tf.TensorSpec([], tf.bool), spec)
    # Placeholders of empty polls (see _Pass.elements) are dropped here.
    return (python_dataset(make_pass, (), [tf.bool] + dtypes, to_element, flagged)
            .filter(lambda ok, element: ok)
            .map(lambda ok, element: element)
            .with_options(options))


# -- Decoders ---------------------------------------------------------------------


def decode_csv(record_defaults, names, field_delim, use_quote_delim, na_value, select_cols):
    def decode(records):
        columns = tf.io.decode_csv(records, record_defaults, field_delim=field_delim,
                                   use_quote_delim=use_quote_delim, na_value=na_value,
                                   select_cols=select_cols)
        return dict(zip(names, columns)) if names else tuple(columns)

    return decode


def decode_example(features):
    def decode(records):
        if records.shape.rank == 0:
            return tf.io.parse_single_example(records, features)
        return tf.io.parse_example(records, features)

    return decode


def decode_json(parser, fields):
    """`decode_json`'s function over `tf.string` records: `parser` (NumPy)
    in one `tf.numpy_function` call per batch."""
    tout = []
    for f in fields:
        tout.append(tf.as_dtype(f.type))
        if f.ragged_rank or f.shape:
            tout.append(tf.int64)

    def decode(records):
        records = tf.convert_to_tensor(records, tf.string)
        if any(f.ragged_rank or f.shape for f in fields) and records.shape.rank != 1:
            raise ValueError("decode_json: list fields need 1-D `records`. "
                             f"Received shape {records.shape}")
        flat = tf.reshape(records, [-1])
        outs = tf.numpy_function(parser, [flat], tout, stateful=False)
        if not isinstance(outs, (list, tuple)):  # one output comes back bare
            outs = [outs]
        result, i = {}, 0
        for f in fields:
            values = outs[i]
            if f.ragged_rank or f.shape:
                splits = tf.ensure_shape(outs[i + 1], [None])
                values = tf.RaggedTensor.from_row_splits(
                    tf.ensure_shape(values, [None]), splits, validate=False)
                if f.shape:
                    values = values.to_tensor(shape=[None, *f.shape])
                i += 2
            else:
                values = tf.reshape(values, tf.shape(records))
                i += 1
            result[f.name] = values
        return result

    return decode
