"""keras_rec_emb.data under Keras's JAX backend: `ParquetDataset` reads NumPy
batches without TensorFlow (a child where importing it fails) and feeds
`fit` / `evaluate` / `predict` of a model with EmbeddingVariable and
GroupEmbedding; its batches are TensorFlow's (a TensorFlow child), ragged
lists padded with -1; the Kafka datasets read a real broker, feed `fit` and
record the consumed position."""

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import keras_rec_emb as kre
from keras_rec_emb.data import DataFrame, KafkaDataset, KafkaPosition, ParquetDataset
from keras_rec_emb.data import decode_json, read_parquet

ROOT = pathlib.Path(__file__).resolve().parents[2]


def write_files(folder):
    """Two files of 3-row row groups: scalar ids, ragged and nested ids
    (ids >= 0, empty lists and nulls included), a label."""
    rng = np.random.default_rng(0)
    paths = []
    for f, rows in enumerate((10, 7)):
        items = [list(rng.integers(0, 50, rng.integers(0, 6))) for _ in range(rows)]
        items[1] = None
        nested = [[list(rng.integers(0, 9, rng.integers(0, 3))) for _ in range(rng.integers(0, 3))]
                  for _ in range(rows)]
        table = pa.table({"user": np.arange(rows, dtype=np.int64) + 100 * f,
                          "items": pa.array(items, pa.list_(pa.int64())),
                          "nested": pa.array(nested, pa.list_(pa.list_(pa.int64()))),
                          "label": rng.integers(0, 2, rows).astype(np.float32)})
        paths.append(str(folder / f"part-{f}.parquet"))
        pq.write_table(table, paths[-1], row_group_size=3)
    return paths


_NO_TENSORFLOW = r"""
import sys


class NoTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ImportError("TensorFlow is not installed in this process")


sys.meta_path.insert(0, NoTensorFlow())
import json
import keras
import numpy as np
import pyarrow.parquet as pq
import keras_rec_emb as kre
from keras_rec_emb.data import ParquetDataset
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding

paths = json.loads(sys.argv[1])
rows = [r for p in paths for r in pq.read_table(p).to_pylist()]
ds = ParquetDataset(paths, batch_size=4, fields=["user", "items", "label"])
batches = list(ds)
assert ds.num_batches == len(batches) == 5, (ds.num_batches, len(batches))
for i, batch in enumerate(batches):  # against pyarrow's rows, padded here
    chunk = rows[4 * i:4 * i + 4]
    lists = [r["items"] or [] for r in chunk]
    longest = max(map(len, lists))
    width = 0 if longest == 0 else 1 << (longest - 1).bit_length()
    items = np.array([l + [-1] * (width - len(l)) for l in lists], np.int64).reshape(-1, width)
    assert batch["items"].dtype == np.int64 and np.array_equal(batch["items"], items), i
    assert np.array_equal(batch["user"], [r["user"] for r in chunk])
    assert np.array_equal(batch["label"], np.float32([r["label"] for r in chunk]))

user = keras.Input(shape=(), dtype="int64", name="user")
items = keras.Input(shape=(None,), dtype="int64", name="items")
table = EmbeddingVariable(4, name="items_table")
pooled = EmbeddingVariable(4, combiner="mean", prune_invalid_ids=True, name="mean_items")(items)
group = GroupEmbedding({"items": FeatureSpec(table, "sum")}, output_mode="concat")({"items": items})
joined = keras.layers.Concatenate()([EmbeddingVariable(4, name="users")(user), pooled, group])
model = keras.Model([user, items], keras.layers.Dense(1, activation="sigmoid")(joined))
model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="binary_crossentropy")
train = ds.map(lambda b: ({"user": b["user"], "items": b["items"]}, b["label"]))


class Count(keras.callbacks.Callback):
    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        Count.steps += 1


history = model.fit(train, epochs=3, verbose=0, callbacks=[Count()])
losses = history.history["loss"]
assert Count.steps == 15 and len(losses) == 3 and all(np.isfinite(losses)), (Count.steps, losses)
assert losses[-1] < losses[0], losses
ids = {i for r in rows for i in (r["items"] or [])}
assert int(table.table_size()) == len(ids), (int(table.table_size()), len(ids))
assert np.isfinite(model.evaluate(train, verbose=0))
assert model.predict(train, verbose=0).shape == (len(rows), 1)
assert "tensorflow" not in sys.modules
print("ok")
"""


def test_parquet_feeds_fit_without_tensorflow(tmp_path):
    paths = write_files(tmp_path)
    env = dict(os.environ, KERAS_BACKEND="jax")
    run = subprocess.run([sys.executable, "-c", _NO_TENSORFLOW, json.dumps(paths)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]


_TENSORFLOW_BATCHES = r"""
import json, sys
import tensorflow as tf
from keras_rec_emb.data import ParquetDataset

out = []
for kwargs in json.loads(sys.argv[2]):
    batches = []
    for batch in ParquetDataset(json.loads(sys.argv[1]), **kwargs):
        dense = {k: (v.to_tensor(-1) if isinstance(v, tf.RaggedTensor) else v).numpy()
                 for k, v in batch.items()}
        batches.append({k: [v.tolist(), v.shape] for k, v in dense.items()})
    out.append(batches)
print(json.dumps(out))
"""

READS = [dict(batch_size=4),
         dict(batch_size=3, partition_count=2, partition_index=1, drop_remainder=True),
         dict(batch_size=2, num_parallel_reads=2, num_sequential_reads=2)]


@pytest.fixture(scope="module")
def tensorflow_batches(tmp_path_factory):
    paths = write_files(tmp_path_factory.mktemp("parquet"))
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    run = subprocess.run([sys.executable, "-c", _TENSORFLOW_BATCHES, json.dumps(paths),
                          json.dumps(READS)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return paths, json.loads(run.stdout.strip().splitlines()[-1])


def pow2_padded(values, shape):
    """TensorFlow's `to_tensor(-1)` with each ragged dimension padded on
    to the next power of two, the JAX form."""
    dense = np.asarray(values, np.int64).reshape(shape)
    widths = [0 if n == 0 else 1 << (n - 1).bit_length() for n in dense.shape[1:]]
    out = np.full((dense.shape[0], *widths), -1, np.int64)
    out[tuple(slice(0, n) for n in dense.shape)] = dense
    return out


@pytest.mark.parametrize("read", range(len(READS)))
def test_parquet_batches_are_tensorflows_in_order(tensorflow_batches, read):
    paths, expected = tensorflow_batches
    ds = ParquetDataset(paths, **READS[read])
    got = list(ds)
    assert ds.num_batches == len(got) == len(expected[read])
    for batch, want in zip(got, expected[read]):
        assert list(batch) == ["user", "items", "nested", "label"]
        assert np.array_equal(batch["user"], want["user"][0])
        assert np.array_equal(batch["label"], np.float32(want["label"][0]))
        for name in ("items", "nested"):
            np.testing.assert_array_equal(batch[name], pow2_padded(*want[name]), strict=True)


def test_parquet_arguments_and_tf_data_methods_say_what_to_do(tmp_path):
    paths = write_files(tmp_path)
    with pytest.raises(ValueError, match=r"`batch_size` must be an integer >= 1. Received: "
                       r"batch_size=0"):
        ParquetDataset(paths, batch_size=0)
    with pytest.raises(TypeError, match=r"`filenames` must be a path, a non-empty list"):
        ParquetDataset(3)
    with pytest.raises(ValueError, match=r"names column 'nope', which is not in"):
        ParquetDataset(paths, fields=["nope"])
    ds = ParquetDataset(paths, batch_size=5, fields=[DataFrame.Field("user", "int32")])
    assert next(iter(ds))["user"].dtype == np.int32
    assert [len(b["user"]) for b in ds.take(2)] == [5, 5] and ds.take(2).num_batches == 2
    with pytest.raises(AttributeError, match=r"ParquetDataset.prefetch` is a tf.data feature.*"
                       r"Under JAX: .*\.map\(fn\)"):
        ds.prefetch(1)
    with pytest.raises(NotImplementedError, match=r"Under JAX: ParquetDataset\(list_of_paths"):
        read_parquet(2, fields=[DataFrame.Field("user", "int64")])
    with pytest.raises(NotImplementedError, match="to_sparse.*padded with -1"):
        DataFrame.to_sparse()
    with pytest.raises(TypeError, match=r"`type` of field 'a' must be one of \['int8'"):
        DataFrame.Field("a", "complex64")
    assert DataFrame.Field("a", np.int64).type == "int64"
    assert kre.data.ParquetDataset is ParquetDataset
    assert ParquetDataset.__module__ == "keras_rec_emb.data.parquet"


def test_decode_json_gives_numpy_with_the_padding():
    decode = decode_json([DataFrame.Field("user", "int64"),
                          DataFrame.Field("items", "int64", ragged_rank=1),
                          DataFrame.Field("dense", "float32", shape=(2,))])
    out = decode([b'{"user": 3, "items": [1, 2, 3], "dense": [1.5]}',
                  '{"user": 4, "items": [], "dense": [1, 2, 3]}'])
    np.testing.assert_array_equal(out["user"], [3, 4])
    np.testing.assert_array_equal(out["items"], [[1, 2, 3, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(out["dense"], np.float32([[1.5, 0], [1, 2]]))


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    from tests.data._broker import Broker

    process = Broker(tmp_path_factory.mktemp("tansu") / "broker.log")
    yield process
    process.stop()


def test_kafka_feeds_fit_and_records_its_position(broker):
    topic = broker.create_topic()
    rng = np.random.default_rng(1)
    users = rng.integers(0, 20, 12)
    broker.produce(topic, [json.dumps({"user": int(u), "label": float(u % 2)}).encode()
                           for u in users])
    ds = KafkaDataset([f"{topic}:0:0:12"], servers=broker.address, eof=True, batch_size=5)
    assert [list(v) for v in ds] == [[json.dumps({"user": int(u), "label": float(u % 2)}).encode()
                                      for u in users[i:i + 5]] for i in (0, 5, 10)]
    decode = decode_json([DataFrame.Field("user", "int64"), DataFrame.Field("label", "float32")])

    def train():
        return KafkaDataset([f"{topic}:0:0:12"], servers=broker.address, eof=True, batch_size=4
                            ).map(decode).map(lambda d: (d["user"], d["label"]))

    np.testing.assert_array_equal(np.concatenate([x for x, _ in train()]), users)
    inputs = keras.Input(shape=(), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(kre.layers.EmbeddingVariable(3)(inputs)))
    model.compile(optimizer=kre.optimizers.SGD(0.1), loss="mse")
    history = model.fit(train(), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert ds.offsets() == {(topic, 0): 12}
    # A position restored into a new dataset resumes after it.
    broker.produce(topic, [b'{"user": 7, "label": 1}', b'{"user": 8, "label": 0}'])
    resumed = KafkaDataset([f"{topic}:0:0"], servers=broker.address, eof=True, batch_size=5)
    resumed.position._advance(KafkaPosition(ds.offsets()).offsets())
    assert [list(decode(v)["user"]) for v in resumed] == [[7, 8]]
    assert resumed.offsets() == {(topic, 0): 14}
    with pytest.raises(ValueError, match=r"Cannot reach a Kafka broker at "
                       r"servers='127.0.0.1:1'"):
        KafkaDataset([f"{topic}:0"], servers="127.0.0.1:1", timeout=200)
