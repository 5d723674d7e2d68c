"""decode_json parses with pyarrow.json and refuses what it cannot represent:
malformed records, wrong types, ints that do not fit."""

import json

import numpy as np
import pytest
import tensorflow as tf

from keras_rec_emb.data import DataFrame
from keras_rec_emb.data import decode_json

FIELDS = [DataFrame.Field("user", tf.int32), DataFrame.Field("score", tf.float32),
          DataFrame.Field("name", tf.string), DataFrame.Field("ok", tf.bool),
          DataFrame.Field("items", tf.int64, ragged_rank=1),
          DataFrame.Field("pair", tf.float32, shape=(2,))]


def test_values_match_pythons_json_module():
    rng = np.random.default_rng(5)
    objects = []
    for i in range(50):
        obj = {"user": int(rng.integers(-2**31, 2**31)), "score": float(rng.normal()),
               "name": f'n"{i}\\é\n', "ok": bool(i % 2),
               "items": rng.integers(0, 10**12, size=int(rng.integers(0, 4))).tolist(),
               "pair": rng.normal(size=int(rng.integers(0, 4))).tolist(),
               "nested": {"user": 7, "items": ["x"]}}
        if i % 7 == 0:
            del obj["score"]
        if i % 5 == 0:
            obj["name"] = None
        objects.append(obj)
    records = [json.dumps(o, indent=1 if i % 3 == 0 else None).encode()
               for i, o in enumerate(objects)]
    out = decode_json(FIELDS)(tf.constant(records))
    np.testing.assert_array_equal(out["user"].numpy(), [o["user"] for o in objects])
    np.testing.assert_allclose(out["score"].numpy(), [o.get("score", 0.0) for o in objects],
                               rtol=1e-6)
    assert out["name"].numpy().tolist() == [(o["name"] or "").encode() for o in objects]
    assert out["ok"].numpy().tolist() == [o["ok"] for o in objects]
    assert out["items"].to_list() == [o["items"] for o in objects]
    want_pair = [(o["pair"] + [0.0, 0.0])[:2] for o in objects]
    np.testing.assert_allclose(out["pair"].numpy(), want_pair, rtol=1e-6)


@pytest.mark.parametrize("record, match", [
    (b'{"user": 3', r"record 1 .*"),
    (b'{"user": "3"}', r"field 'user' \(int32\) of record 1"),
    (b'{"user": 1.5}', r"field 'user' \(int32\) of record 1"),
    (b'{"user": 3000000000}', r"field 'user' \(int32\) of record 1.*3000000000"),
    (b'{"score": "high"}', r"field 'score' \(float32\) of record 1"),
    (b'{"items": [1, "a"]}', r"field 'items' \(int64\) of record 1"),
    (b'[1, 2]', r"record 1"),
    (b'{"user": 1}{"user": 2}', r"record 1 .* not one JSON object"),
    (b'', r"record 1 is empty"),
])
def test_malformed_or_mistyped_records_raise(record, match):
    decode = decode_json(FIELDS)
    batch = tf.constant([b'{"user": 1}', record, b'{"user": 2}'])
    with pytest.raises(ValueError, match=match):
        decode(batch)
    ds = tf.data.Dataset.from_tensors(batch).map(decode)
    with pytest.raises(tf.errors.InvalidArgumentError, match="decode_json"):
        list(ds)


def test_scalar_fields_keep_the_records_shape():
    out = decode_json({"user": tf.int64})(tf.constant([[b'{"user": 1}'], [b'{"user": 2}']]))
    assert out["user"].shape == (2, 1) and out["user"].numpy().tolist() == [[1], [2]]
    empty = decode_json(FIELDS)(tf.constant([], tf.string))
    assert empty["user"].shape == (0,) and empty["items"].to_list() == []
