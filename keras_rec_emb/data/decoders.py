"""Vectorized decoders for batches of raw records (e.g. Kafka messages).

Each `decode_*` returns a function for `Dataset.map` that parses a whole
`tf.string` batch with TensorFlow ops (no Python per record).
"""

import tensorflow as tf

from keras_rec_emb.data.dataframe import DataFrame

_NUMBER = {
    "int": r"(-?\d+)\s*[,}\]]",
    "float": r"(-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*[,}\]]",
    "bool": r"(true|false)\s*[,}\]]",
}
# A JSON string: the contents between unescaped quotes.
_STRING = r'"((?:[^"\\]|\\.)*)"'


def decode_csv(record_defaults,
               names=None,
               field_delim=",",
               use_quote_delim=True,
               na_value="",
               select_cols=None):
    """A function parsing a batch of CSV records (`tf.io.decode_csv`).

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

    def decode(records):
        columns = tf.io.decode_csv(records, record_defaults,
                                   field_delim=field_delim,
                                   use_quote_delim=use_quote_delim,
                                   na_value=na_value, select_cols=select_cols)
        return dict(zip(names, columns)) if names else tuple(columns)

    return decode


def decode_example(features):
    """A function parsing a batch of serialized `tf.train.Example`s.

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

    def decode(records):
        if records.shape.rank == 0:
            return tf.io.parse_single_example(records, features)
        return tf.io.parse_example(records, features)

    return decode


def decode_json(fields):
    """A function extracting fields from a batch of flat JSON objects.

    Each field is found with one RE2 regular expression over the whole batch
    (`tf.strings.regex_replace`), so parsing is vectorized. Supported:
    scalars (numbers, `true`/`false`, strings) and lists of numbers
    (`ragged_rank=1`: ragged; `shape=(n,)`: dense, padded with 0 or cut to
    `n`; list fields need 1-D `records`). Missing or
    `null` values read as 0, `False`, `""` or an empty list. Limits: a key is
    taken at its first occurrence after `{` or `,`, including inside nested
    objects, so use flat objects with unique keys; string escapes other than
    `\\"` and `\\\\` (e.g. `\\n`, `\\u00e9`) stay as written.

    Args:
        fields: list of `DataFrame.Field` (each with a `type`), or a dict
            from name to `tf.DType` for scalars.

    Returns:
        A function `records -> dict` of tensors (ragged for lists) with
        `records`' shape as batch shape.

    Example:

    >>> import tensorflow as tf
    >>> from keras_rec_emb.data import DataFrame, decode_json
    >>> decode = decode_json([DataFrame.Field("user", tf.int64),
    ...                       DataFrame.Field("items", tf.int64, ragged_rank=1)])
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
                field.type in (tf.string, tf.bool) or
                (field.ragged_rank or 0) + len(field.shape or ()) != 1)):
            raise TypeError(
                "`fields` entries need a `type`; lists must be flat lists of "
                f"numbers (ragged_rank=1 or shape=(n,)). Received: {field}")

    def decode(records):
        return {f.name: _json_field(records, f) for f in fields}

    return decode


def _json_field(records, field):
    key = rf'(?s)^.*?[{{,]\s*"{_re_escape(field.name)}"\s*:\s*'
    if field.ragged_rank or field.shape:
        value = r"\[([^\]]*)\]"
    elif field.type == tf.string:
        value = _STRING
    elif field.type == tf.bool:
        value = _NUMBER["bool"]
    else:
        value = _NUMBER["int" if field.type.is_integer else "float"]
    found = tf.strings.regex_full_match(records, key + value + ".*$")
    text = tf.where(found,
                    tf.strings.regex_replace(records, key + value + ".*$",
                                             r"\1"), "")
    if field.type == tf.string:
        text = tf.strings.regex_replace(text, r'\\"', '"')
        return tf.strings.regex_replace(text, r"\\\\", "\\\\")
    if field.type == tf.bool:
        return tf.equal(text, "true")
    if not (field.ragged_rank or field.shape):
        return _to_number(tf.where(found, text, "0"), field.type)
    items = tf.strings.split(tf.strings.regex_replace(text, r"\s", ""), ",")
    items = tf.ragged.boolean_mask(items, tf.not_equal(items, ""))
    values = items.with_flat_values(_to_number(items.flat_values, field.type))
    if field.shape:
        return values.to_tensor(shape=[None, *field.shape])
    return values


def _to_number(text, dtype):
    wide = tf.int64 if dtype.is_integer else tf.float64
    return tf.cast(tf.strings.to_number(text, out_type=wide), dtype)


def _re_escape(text):
    """`text` with RE2 metacharacters escaped."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in text)
