"""Vectorized decoders; expected values come from Python's csv/json."""

import csv
import io
import json

import numpy as np
import pytest
import tensorflow as tf

from keras_rec_emb.data import DataFrame
from keras_rec_emb.data import decode_csv
from keras_rec_emb.data import decode_example
from keras_rec_emb.data import decode_json

RECORDS = [
    {"user": 12, "price": 1.5, "name": 'quote " inside', "ok": True,
     "items": [1, 2, 3], "vec": [0.5, -1.0]},
    {"price": -2e3, "user": -7, "name": "back\\slash", "ok": False,
     "items": [], "vec": [2.0, 3.0], "nested": {"user": 99}},
    {"user": 0, "name": None, "items": [42], "vec": [1.0]},
]


def test_decode_json_matches_json_module():
    decode = decode_json([
        DataFrame.Field("user", tf.int64), DataFrame.Field("price", tf.float64),
        DataFrame.Field("name", tf.string), DataFrame.Field("ok", tf.bool),
        DataFrame.Field("items", tf.int32, ragged_rank=1),
        DataFrame.Field("vec", tf.float32, shape=(2,))])
    out = decode(tf.constant([json.dumps(r) for r in RECORDS]))
    parsed = [json.loads(json.dumps(r)) for r in RECORDS]
    assert out["user"].numpy().tolist() == [r["user"] for r in parsed]
    assert out["price"].numpy().tolist() == [r.get("price", 0.0) for r in parsed]
    assert out["name"].numpy().tolist() == [(r["name"] or "").encode()
                                            for r in parsed]
    assert out["ok"].numpy().tolist() == [r.get("ok", False) for r in parsed]
    assert out["items"].to_list() == [r["items"] for r in parsed]
    np.testing.assert_array_equal(out["vec"], [[0.5, -1.0], [2.0, 3.0],
                                               [1.0, 0.0]])


def test_decode_json_rejects_unsupported_fields():
    with pytest.raises(TypeError, match="need a `type`"):
        decode_json([DataFrame.Field("x")])
    with pytest.raises(TypeError, match="flat lists of numbers"):
        decode_json([DataFrame.Field("x", tf.string, ragged_rank=1)])


def test_decode_csv_matches_csv_module():
    rows = [[1, 0.25, "a,b"], [2, -1.5, "plain"], [3, 4.0, ""]]
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    lines = buffer.getvalue().splitlines()
    out = decode_csv([0, 0.0, "x"], names=["id", "w", "s"])(tf.constant(lines))
    parsed = list(csv.reader(lines))
    assert out["id"].numpy().tolist() == [int(r[0]) for r in parsed]
    assert out["w"].numpy().tolist() == [float(r[1]) for r in parsed]
    assert out["s"].numpy().tolist() == [b"a,b", b"plain", b"x"]  # "" -> default
    assert len(decode_csv([0, 0.0, ""])(tf.constant(lines))) == 3
    with pytest.raises(ValueError, match="`names`"):
        decode_csv([0], names=["a", "b"])


def test_decode_example_batch_and_scalar():
    def example(i):
        return tf.train.Example(features=tf.train.Features(feature={
            "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
            "w": tf.train.Feature(float_list=tf.train.FloatList(
                value=[i / 2] * i))})).SerializeToString()

    decode = decode_example({"id": tf.io.FixedLenFeature([], tf.int64),
                             "w": tf.io.RaggedFeature(tf.float32)})
    out = decode(tf.constant([example(i) for i in range(3)]))
    assert out["id"].numpy().tolist() == [0, 1, 2]
    assert out["w"].to_list() == [[], [0.5], [1.0, 1.0]]
    assert decode(tf.constant(example(2)))["id"].numpy() == 2
    with pytest.raises(TypeError, match="`features`"):
        decode_example([])
