"""Vectorized decoders of record batches for `Dataset.map` (docs/semantics.md,
'Input pipelines')."""

import numpy as np

from keras_rec_emb import _backend
from keras_rec_emb.data.dataframe import DataFrame
from keras_rec_emb.data.dataframe import dtype_name

if _backend.is_jax():
    from keras_rec_emb.backend.jax import data as _impl
else:
    from keras_rec_emb.backend.tensorflow import data as _impl


def decode_csv(record_defaults, names=None, field_delim=",", use_quote_delim=True, na_value="",
               select_cols=None):
    """A function parsing a batch of CSV records (`tf.io.decode_csv`;
    TensorFlow backend).

    Args:
        record_defaults: list, one entry per (selected) column: a default
            value (its type is the column's type) or an empty list for a
            required column, as in `tf.io.decode_csv`.
        names: list of str, optional. Column names; the function then returns
            a dict instead of a tuple. Defaults to `None`.
        field_delim: str. One-character delimiter. Defaults to `","`.
        use_quote_delim: bool. Treat double quotes as quoting. Defaults to
            `True`.
        na_value: str. String read as a missing value. Defaults to `""`.
        select_cols: list of int, optional. Indices of the columns to keep.

    Returns:
        A function `records -> tuple | dict` of tensors shaped like
        `records`.

    Example:

    >>> import tensorflow as tf
    >>> from keras_rec_emb.data import decode_csv
    >>> decode = decode_csv([0, 0.0, ""], names=["id", "price", "tag"])
    >>> out = decode(tf.constant(["1,2.5,a", "2,,b"]))
    >>> out["id"].numpy().tolist(), out["price"].numpy().tolist()
    ([1, 2], [2.5, 0.0])
    """
    if names is not None and len(names) != len(record_defaults):
        raise ValueError(
            "`names` must have one entry per `record_defaults` entry. "
            f"Received: names={names!r}, record_defaults={record_defaults!r}")
    return _impl.decode_csv(record_defaults, names, field_delim, use_quote_delim,
                            na_value, select_cols)


def decode_example(features):
    """A function parsing a batch of serialized `tf.train.Example`s
    (TensorFlow backend).

    Args:
        features: dict from feature name to `tf.io.FixedLenFeature`,
            `tf.io.VarLenFeature`, `tf.io.RaggedFeature`, ... as in
            `tf.io.parse_example`.

    Returns:
        A function `records -> dict` (1-D `records`: batched outputs; a
        scalar: one example).

    Example:

    >>> import tensorflow as tf
    >>> from keras_rec_emb.data import decode_example
    >>> example = tf.train.Example(features=tf.train.Features(feature={
    ...     "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[7]))}))
    >>> decode = decode_example({"id": tf.io.FixedLenFeature([], tf.int64)})
    >>> decode(tf.constant([example.SerializeToString()]))["id"].numpy()
    array([7])
    """
    if not isinstance(features, dict) or not features:
        raise TypeError("`features` must be a non-empty dict of feature "
                        f"configs. Received: features={features!r}")
    return _impl.decode_example(features)


def decode_json(fields):
    """A function parsing a batch of JSON objects (one per record) with
    `pyarrow.json`.

    One Arrow call per batch; missing or `null` values read as 0, `False`, `""`
    or an empty list, a wrong type raises (docs/semantics.md, 'Input pipelines').

    Args:
        fields: list of `DataFrame.Field` (each with a `type`), or a dict
            from name to `tf.DType` for scalars.

    Returns:
        A function `records -> dict` with `records`' shape as batch shape:
        of tensors (ragged for lists) under TensorFlow, of NumPy arrays
        (lists padded as `ParquetDataset` pads them) under JAX, where
        `records` is an array or list of bytes or str.

    Example:

    >>> import tensorflow as tf
    >>> from keras_rec_emb.data import DataFrame, decode_json
    >>> decode = decode_json([DataFrame.Field("user", "int64"),
    ...                       DataFrame.Field("items", "int64", ragged_rank=1)])
    >>> out = decode(tf.constant(['{"user": 3, "items": [1, 2]}',
    ...                           '{"items": [], "user": 4}']))
    >>> out["user"].numpy().tolist(), out["items"].to_list()
    ([3, 4], [[1, 2], []])
    """
    if isinstance(fields, dict):
        fields = [DataFrame.Field(n, t) for n, t in fields.items()]
    if not isinstance(fields, (list, tuple)) or not fields or not all(
            isinstance(f, DataFrame.Field) for f in fields):
        raise TypeError("`fields` must be a non-empty list of DataFrame.Field "
                        f"or a dict name -> dtype. Received: fields={fields!r}")
    for field in fields:
        is_list = bool(field.ragged_rank or field.shape)
        if field.type is None or (is_list and (
                dtype_name(field.type) in ("string", "bool") or
                (field.ragged_rank or 0) + len(field.shape or ()) != 1)):
            raise TypeError(
                "`fields` entries need a `type`; lists must be flat lists of "
                f"numbers (ragged_rank=1 or shape=(n,)). Received: {field}")
    return _impl.decode_json(_JsonParser(fields), list(fields))


class _JsonParser:
    """NumPy side of `decode_json`: a flat batch of records -> per field
    the values (and row splits for lists)."""

    def __init__(self, fields):
        self._fields = list(fields)

    @staticmethod
    def _arrow_type(field):
        import pyarrow as pa

        name = dtype_name(field.type)
        base = pa.string() if name == "string" else pa.from_numpy_dtype(np.dtype(name))
        return pa.list_(base) if (field.ragged_rank or field.shape) else base

    def _read(self, lines, fields):
        import pyarrow as pa
        import pyarrow.json as pj

        schema = pa.schema([(f.name, self._arrow_type(f)) for f in fields])
        options = pj.ParseOptions(explicit_schema=schema,
                                  unexpected_field_behavior="ignore")
        return pj.read_json(pa.py_buffer(b"\n".join(lines) + b"\n"),
                            parse_options=options)

    def _explain(self, lines, error):
        """The first record (and field) that fails, as a ValueError."""
        import pyarrow as pa

        for index, line in enumerate(lines):
            text = line.decode("utf-8", "replace")
            text = text if len(text) <= 200 else text[:200] + "..."
            try:
                table = self._read([line], self._fields)
            except pa.ArrowInvalid as e:
                field = None
                for f in self._fields:
                    try:
                        self._read([line], [f])
                    except pa.ArrowInvalid:
                        field = f
                        break
                where = (f"field {field.name!r} ({dtype_name(field.type)}) of " if field
                         else "")
                return ValueError(f"decode_json: cannot parse {where}record {index} "
                                  f"{text!r}: {e}")
            if table.num_rows != 1:
                return ValueError(f"decode_json: record {index} {text!r} is not one "
                                  "JSON object")
        return ValueError(f"decode_json: cannot parse the batch: {error}")

    def __call__(self, records):
        import pyarrow as pa

        # Raw newlines in a valid record can only be whitespace.
        lines = [r.replace(b"\n", b" ").replace(b"\r", b" ") for r in records.tolist()]
        for index, line in enumerate(lines):
            if not line.strip():
                raise ValueError(f"decode_json: record {index} is empty, not a JSON object")
        if not lines:
            table = None
        else:
            try:
                table = self._read(lines, self._fields)
            except pa.ArrowInvalid as e:
                raise self._explain(lines, e) from None
            if table.num_rows != len(lines):
                raise self._explain(lines, "records do not hold one object each")
        out = []
        for f in self._fields:
            name = dtype_name(f.type)
            dtype = np.dtype(object if name == "string" else name)
            is_list = bool(f.ragged_rank or f.shape)
            if table is None:
                out += [np.zeros(0, dtype), np.zeros(1, np.int64)] if is_list else [
                    np.zeros(0, dtype)]
                continue
            column = table.column(f.name).combine_chunks()
            if is_list:
                lengths = np.asarray(column.value_lengths().fill_null(0), np.int64)
                splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
                flat = column.flatten().fill_null(0)
                out += [np.asarray(flat.to_numpy(zero_copy_only=False), dtype), splits]
                continue
            fill = {"string": "", "bool": False}.get(name, 0)
            values = column.fill_null(fill).to_numpy(zero_copy_only=False)
            if name == "string":
                values = np.array([v.encode() for v in values], dtype=object)
            out.append(np.asarray(values, dtype))
        return out

