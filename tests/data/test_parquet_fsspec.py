"""ParquetDataset on URIs only fsspec knows: files written by pyarrow into
fsspec's in-memory filesystem (`memory://`, which pyarrow.fs does not
understand); expected values come from pyarrow directly."""

import sys

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from keras_rec_emb.data import DataFrame
from keras_rec_emb.data import ParquetDataset
from keras_rec_emb.data import read_parquet
from keras_rec_emb.data.parquet import _resolve

from _frames import read_all


@pytest.fixture(autouse=True)
def memory():
    """fsspec's process-wide memory filesystem, empty for each test."""
    fs = fsspec.filesystem("memory")

    def clear():
        fs.store.clear()
        fs.pseudo_dirs[:] = [""]

    clear()
    yield fs
    clear()


def arrow_memory():
    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))


def write(path, table, row_group_size):
    """Writes `table` to memory://`path`; returns that URI."""
    pq.write_table(table, path, row_group_size=row_group_size,
                   filesystem=arrow_memory())
    return "memory://" + path


def row_groups(uris):
    """Every row group's `x` values, numbered across files in order."""
    groups = []
    for uri in uris:
        f = pq.ParquetFile(uri[len("memory://"):], filesystem=arrow_memory())
        groups += [f.read_row_group(i).column("x").to_pylist()
                   for i in range(f.num_row_groups)]
    return groups


@pytest.fixture
def numbered_files():
    """Two memory:// files of consecutive ints; row groups of 3 and 4 rows."""
    uris, rows, start = [], [], 0
    for i, (n, group) in enumerate([(7, 3), (9, 4)]):
        values = list(range(start, start + n))
        start += n
        uris.append(write(f"bucket/f{i}.parquet",
                          pa.table({"x": pa.array(values, pa.int64())}),
                          row_group_size=group))
        rows.append(values)
    return uris, rows


def test_reads_columns_and_rows_of_a_memory_uri():
    table = pa.table({
        "user": pa.array([1, -2, 3, 2**40, 5], pa.int64()),
        "score": pa.array([0.5, -1.25, 3.0, 1e10, 0.0], pa.float32()),
        "items": pa.array([[10, 11], [], [12], [13, 14, 15], [16]],
                          pa.list_(pa.int32())),
        "name": pa.array(["a", "bc", "", "d", "é"], pa.string()),
    })
    uri = write("bucket/x.parquet", table, row_group_size=2)
    dataset = ParquetDataset(uri, batch_size=3)
    spec = dataset.element_spec
    assert list(spec) == table.column_names
    assert spec["user"] == tf.TensorSpec([None], tf.int64)
    assert spec["score"] == tf.TensorSpec([None], tf.float32)
    assert spec["items"] == tf.RaggedTensorSpec([None, None], tf.int32, 1,
                                                tf.int64)
    batches = list(dataset)
    assert [int(b["user"].shape[0]) for b in batches] == [3, 2]
    assert all(isinstance(b["items"], tf.RaggedTensor) for b in batches)
    got = read_all(batches)
    assert got["user"] == table.column("user").to_pylist()
    assert got["score"] == table.column("score").to_pylist()
    assert got["items"] == table.column("items").to_pylist()
    assert got["name"] == [s.encode() for s in table.column("name").to_pylist()]


def test_partitions_of_two_memory_files_are_disjoint(numbered_files):
    uris, rows = numbered_files
    groups = row_groups(uris)
    assert len(groups) == 6  # 3 + 3 row groups
    parts = [read_all(ParquetDataset(uris, batch_size=4, partition_count=2,
                                     partition_index=i))["x"]
             for i in range(2)]
    assert parts[0] == sum(groups[0::2], [])
    assert parts[1] == sum(groups[1::2], [])
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sum(rows, [])


def test_dataset_of_memory_uris_with_read_parquet(numbered_files):
    uris, rows = numbered_files
    dataset = tf.data.Dataset.from_tensor_slices(uris).apply(
        read_parquet(5, fields=[DataFrame.Field("x", tf.int64)]))
    assert isinstance(dataset, ParquetDataset)
    sizes = [int(b["x"].shape[0]) for b in dataset]
    assert sizes == [5, 5, 5, 1]
    assert read_all(dataset)["x"] == sum(rows, [])


def test_local_paths_keep_pyarrow_filesystems(tmp_path, memory):
    path = str(tmp_path / "a.parquet")
    filesystem, fs_path = _resolve(path)
    assert isinstance(filesystem, pafs.LocalFileSystem)
    assert fs_path == path
    filesystem, fs_path = _resolve("file://" + path)
    assert isinstance(filesystem, pafs.LocalFileSystem)
    assert fs_path == path
    filesystem, fs_path = _resolve("memory://bucket/x.parquet")
    assert isinstance(filesystem, pafs.PyFileSystem)
    assert filesystem.handler.fs is memory
    assert fs_path == "/bucket/x.parquet"


# Bad input: each error names the argument and the value.


def test_missing_memory_file(numbered_files):
    uris, _ = numbered_files
    missing = "memory://bucket/missing.parquet"
    with pytest.raises(ValueError, match="`filenames`.*'memory://bucket/"
                       "missing.parquet' does not exist"):
        ParquetDataset(missing)
    with pytest.raises(ValueError, match="missing.parquet' does not exist"):
        ParquetDataset([uris[0], missing])


def test_not_a_parquet_file_in_memory(memory):
    with memory.open("bucket/junk.parquet", "wb") as f:
        f.write(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match="'memory://bucket/junk.parquet' is "
                       "not a readable Parquet file"):
        ParquetDataset("memory://bucket/junk.parquet")


def test_unknown_scheme():
    with pytest.raises(ValueError, match="`filenames`: neither pyarrow nor "
                       "fsspec has a filesystem for 'nosuchproto://a/b.parquet'"
                       ".*Protocol not known.*installed fsspec protocol"):
        ParquetDataset("nosuchproto://a/b.parquet")


def test_without_fsspec_memory_uri_asks_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # `import fsspec` fails
    with pytest.raises(ValueError, match="`filenames`: pyarrow has no "
                       "filesystem for 'memory://bucket/x.parquet'.*fsspec is "
                       "not installed.*`pip install fsspec`"):
        ParquetDataset("memory://bucket/x.parquet")
