"""`export_for_serving` under TensorFlow: traced inside
`_serving_context.stock_tables`, where table lookups (fused ones through
`embedding_ops.stock_group_lookup`) read stock twins (a `MutableHashTable`
from key to row and a dense matrix)."""

import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from keras_rec_emb import _keras_fixes, saving
from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context


class _StockTable(tf.Module):
    """One table as stock TensorFlow state, with `KRE>TableLookup`'s inference
    semantics (docs/semantics.md, 'Serving')."""

    def __init__(self, table):
        super().__init__(name=_module_name(table.name))
        data = table.export(include_filtered=False)
        keys = np.asarray(data["keys"]).astype(np.int64)
        self._dim = table.dim
        self._key_dtype = table.key_dtype
        self._filtered = table.filters
        self._no_permission_value = table.no_permission_value
        self.index = tf.lookup.experimental.MutableHashTable(
            tf.int64, tf.int64, default_value=-1, name="index")
        if len(keys):
            self.index.insert(keys, np.arange(len(keys), dtype=np.int64))
        values = np.asarray(data["values"], np.float32).reshape(len(keys), self._dim)
        # A frozen table with no rows: every key reads its "other" row, and
        # the graph must not gather from an empty matrix (stock TF refuses).
        self._empty = len(keys) == 0
        # Made while the export's function traces: a plain tf.Variable
        # there would make tf.function trace the whole model once more.
        self.values = _compat.constant_variable(values, "values")
        defaults = np.asarray(data["default_values"], np.float32).reshape(-1, self._dim)
        self.default_values = _compat.constant_variable(defaults, "default_values")

    def lookup(self, keys):
        keys = tf.convert_to_tensor(keys)
        shape = tf.shape(keys)
        flat = tf.cast(tf.cast(tf.reshape(keys, [-1]), self._key_dtype), tf.int64)
        if self._filtered:
            other = tf.fill(tf.stack([tf.size(flat), self._dim]),
                            tf.constant(self._no_permission_value, tf.float32))
        else:
            dvd = tf.shape(self.default_values, out_type=tf.int64)[0]
            other = tf.gather(self.default_values, tf.math.floormod(flat, dvd))
        if self._empty:
            rows = other
        else:
            index = self.index.lookup(flat)
            found = index >= 0
            rows = tf.where(found[:, None], tf.gather(self.values, tf.maximum(index, 0)),
                            other)
        return tf.reshape(rows, tf.concat([shape, [self._dim]], 0))


def _module_name(name):
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in str(name or "table"))
    return cleaned if cleaned[:1].isalpha() else f"t_{cleaned}"


class _Untracked:
    """A plain holder that TensorFlow's object tracking does not look into."""

    def __init__(self):
        self.items = []


class _StockTables(tf.Module):
    """The stock tables of one export, made on first lookup of each table."""

    def __init__(self):
        super().__init__(name="embedding_tables")
        self.tables = []
        # The EmbeddingTables, in the order of `tables` (kept out of the
        # SavedModel: they need this package's ops).
        self._sources = _Untracked()

    def get(self, table):
        for source, stock in zip(self._sources.items, self.tables):
            if source is table:
                return stock
        with tf.init_scope():  # eager state, captured by the traced function
            stock = _StockTable(table)
        self._sources.items.append(table)
        self.tables.append(stock)
        return stock

    def release(self):
        """Frees the indexes made in this process, once written out: an eager
        stock `MutableHashTable` has no deleter and lives in TensorFlow's
        resource manager until deleted by name, and the SavedModel re-creates
        its tables when loaded."""
        for stock in self.tables:
            tf.raw_ops.DestroyResourceOp(resource=stock.index.resource_handle,
                                         ignore_lookup_error=True)


def _shape_checked(args, max_input_size=None):
    """The endpoint's input tensors, each checked against its traced shape
    when the graph runs (stock `EnsureShape`): a signature's callers skip
    tf.function's input check, and ids of another width or rank would be
    read as ids. With `max_input_size`, a larger tensor fails the request
    (InvalidArgument) before any op reads it."""
    def check(x):
        if not isinstance(x, tf.Tensor):
            return x
        name = (getattr(x, "name", None) or "input").split(":")[0]
        if x.shape.rank is not None:
            x = tf.ensure_shape(x, x.shape)
        if max_input_size is not None:
            size = tf.size(x, out_type=tf.int64)
            assertion = tf.debugging.Assert(
                size <= max_input_size,
                [f"export_for_serving: input {name} of the request has", size,
                 f"elements; this SavedModel serves at most {max_input_size} per input "
                 "(export_for_serving's max_input_size). Split the request."])
            with tf.control_dependencies([assertion]):
                x = tf.identity(x)
        return x

    return tf.nest.map_structure(check, args)


def _custom_ops(graph_def):
    """Op types of this package (prefix KRE>) in a GraphDef and its library."""
    found = {n.op for n in graph_def.node if n.op.startswith("KRE>")}
    for function in graph_def.library.function:
        found.update(n.op for n in function.node_def if n.op.startswith("KRE>"))
    return found


def export(model, filepath, input_signature, verbose, max_input_size):
    """`keras_rec_emb.export_for_serving` under TensorFlow (its arguments
    checked there): the model traced in this process, every table lookup
    reading its stock twin."""
    if input_signature is None:  # keras.export.ExportArchive wants it given
        input_signature = _keras_fixes.input_specs(model)
    stock = _StockTables()
    archive = keras.export.ExportArchive()
    parent = os.path.dirname(os.path.abspath(filepath))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-serving-", dir=parent)
    try:
        # Every trace (also any the save makes) reads the stock tables.
        with _serving_context.stock_tables(stock.get):
            endpoint = archive.add_endpoint(
                "serve",
                lambda *args: model(*_shape_checked(args, max_input_size), training=False),
                input_signature)
            concrete = endpoint.get_concrete_function()
            left = _custom_ops(concrete.graph.as_graph_def())
            if left:
                raise NotImplementedError(
                    "export_for_serving: the model still runs ops of keras_rec_emb "
                    f"({sorted(left)}) in inference; these layers cannot be served "
                    "without the package. Use model.export instead.")
            archive.track(stock)
            archive.write_out(tmp, verbose=verbose)
        # mkdtemp makes a 0700 folder; a server running as another user must
        # read it, as it could one written by tf.saved_model.save.
        os.chmod(tmp, saving.default_mode(directory=True))
        if os.path.isdir(filepath):
            old = tempfile.mkdtemp(prefix=".old-serving-", dir=parent)
            os.rmdir(old)
            os.replace(filepath, old)
            os.replace(tmp, filepath)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, filepath)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        stock.release()
    return filepath
