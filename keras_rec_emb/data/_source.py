"""tf.data plumbing shared by the Parquet and Kafka datasets.

`python_dataset` turns a Python iterator of NumPy batches into a
`tf.data.Dataset` with one `tf.numpy_function` call per element (TensorFlow's
`from_generator` adds per-component Python checks, costly on wide
batches). `WrappedDataset` lets a public class be a real `tf.data.Dataset`
whose pipeline is built in its constructor, as `tf.data.TFRecordDataset` is.
"""

import itertools
import threading

import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat


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
