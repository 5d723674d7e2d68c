"""The Arrow C data interface handoff behind ParquetDataset: the
`KRE>ArrowBatchToTensors` kernel against pyarrow's own values, its errors on
bad input, and the release of every exported batch (consumed or not)."""

import gc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.data import ParquetDataset
from keras_rec_emb.backend.tensorflow import data as parquet_lib


def convert(batch, out_types, ragged_ranks, inner_ranks=None, inner_shapes=()):
    """Exports `batch` (a pa.Table) and runs the kernel on it."""
    exports = parquet_lib._Exports()
    addresses = exports.export(batch)
    try:
        return _ops.gen().kre_arrow_batch_to_tensors(
            tf.constant(addresses), out_types=out_types, ragged_ranks=ragged_ranks,
            inner_ranks=inner_ranks or [0] * len(ragged_ranks),
            inner_shapes=list(inner_shapes))
    finally:
        exports.close()


def test_every_leaf_type_and_offsets_of_a_sliced_batch():
    rng = np.random.default_rng(0)
    n = 40
    columns = {
        "i8": pa.array(rng.integers(-100, 100, n), pa.int8()),
        "u16": pa.array(rng.integers(0, 60000, n), pa.uint16()),
        "i32": pa.array(rng.integers(-2**31, 2**31 - 1, n), pa.int32()),
        "u64": pa.array(rng.integers(0, 2**63, n, dtype=np.uint64), pa.uint64()),
        "f16": pa.array(rng.random(n).astype(np.float16), pa.float16()),
        "f64": pa.array(rng.random(n), pa.float64()),
        "flag": pa.array(rng.random(n) < 0.5, pa.bool_()),
        "s": pa.array([f"row{i}" * (i % 4) for i in range(n)], pa.string()),
        "ls": pa.array([str(i).encode() for i in range(n)], pa.large_binary()),
    }
    table = pa.table(columns).slice(7, 21)  # offsets inside every buffer
    dtypes = [tf.int8, tf.uint16, tf.int32, tf.uint64, tf.float16, tf.float64, tf.bool,
              tf.string, tf.string]
    got = convert(table, dtypes, [0] * len(dtypes))
    for t, name in zip(got, columns):
        want = table.column(name).to_numpy(zero_copy_only=False)
        if t.dtype == tf.string:
            want = [w.encode() if isinstance(w, str) else w for w in want]
        np.testing.assert_array_equal(t.numpy(), want, err_msg=name)


def test_nested_ragged_and_fixed_size_lists():
    nested = pa.array([[[1, 2], []], [], [[3]], [[4, 5, 6], [7]]], pa.list_(pa.list_(pa.int64())))
    fixed = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]],
                     pa.list_(pa.float32(), 2))
    pairs = pa.array([[1, 2], [3, 4], [5, 6], [7, 8]], pa.large_list(pa.int32()))
    table = pa.table({"nested": nested, "fixed": fixed, "pairs": pairs}).slice(1, 3)
    values, outer, inner, fixed_t, pairs_t = convert(
        table, [tf.int64, tf.int64, tf.int64, tf.float32, tf.int32],
        ragged_ranks=[2, 0, 0], inner_ranks=[0, 1, 1], inner_shapes=[2, 2])
    rt = tf.RaggedTensor.from_nested_row_splits(values, [outer, inner])
    assert rt.to_list() == [[], [[3]], [[4, 5, 6], [7]]]
    np.testing.assert_array_equal(fixed_t.numpy(), [[3, 4], [5, 6], [7, 8]])
    np.testing.assert_array_equal(pairs_t.numpy(), [[3, 4], [5, 6], [7, 8]])


def test_aligned_values_are_shared_not_copied():
    values = np.arange(1 << 16, dtype=np.int64)
    table = pa.table({"x": pa.array(values)})
    (t,) = convert(table, [tf.int64], [0])
    np.testing.assert_array_equal(t.numpy(), values)


def test_bad_inputs_give_invalid_argument():
    table = pa.table({"x": pa.array([1, 2, 3], pa.int64())})
    gen = _ops.gen()
    with pytest.raises(tf.errors.InvalidArgumentError, match="2 addresses"):
        gen.kre_arrow_batch_to_tensors(tf.constant([1, 2, 3], tf.int64), out_types=[tf.int64],
                                       ragged_ranks=[0], inner_ranks=[0], inner_shapes=[])
    with pytest.raises(tf.errors.InvalidArgumentError, match="not an Arrow batch that"):
        gen.kre_arrow_batch_to_tensors(tf.constant([0, 0], tf.int64), out_types=[tf.int64],
                                       ragged_ranks=[0], inner_ranks=[0], inner_shapes=[])
    with pytest.raises(tf.errors.InvalidArgumentError, match="type int64 but the op expects float"):
        convert(table, [tf.float32], [0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="struct batch of 2 columns"):
        convert(table, [tf.int64, tf.int64], [0, 0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="where a list was expected"):
        convert(table, [tf.int64, tf.int64], [1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="nulls|null values"):
        convert(pa.table({"x": pa.array([1, None], pa.int64())}), [tf.int64], [0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="fixed size 2 .* has 3 values"):
        convert(pa.table({"x": pa.array([[1, 2], [1, 2, 3]])}), [tf.int64], [0], [1], [2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="out_types has 2 entries"):
        convert(table, [tf.int64, tf.int64], [0])
    # A batch is consumed once: handing the same structs over again fails.
    exports = parquet_lib._Exports()
    addresses = tf.constant(exports.export(table))
    kw = dict(out_types=[tf.int64], ragged_ranks=[0], inner_ranks=[0], inner_shapes=[])
    np.testing.assert_array_equal(gen.kre_arrow_batch_to_tensors(addresses, **kw)[0], [1, 2, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="consumed already"):
        gen.kre_arrow_batch_to_tensors(addresses, **kw)
    exports.close()
    # Structs exported by anyone but the package are refused before they are
    # read: the op dereferences only addresses the package registered.
    memory = np.zeros(19, np.uint64)
    array = memory.ctypes.data
    _compat.export_record_batch(pa.record_batch([pa.array([1, 2])], names=["x"]), array,
                                array + 80)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not an Arrow batch that"):
        gen.kre_arrow_batch_to_tensors(tf.constant([array, array + 80], tf.int64), **kw)
    assert memory[8] != 0  # not consumed: the release callback is still set
    _compat.import_record_batch(array, array + 80)  # release it


def test_every_exported_batch_is_released(tmp_path):
    """Consumed batches are released with their tensors, and batches a pass
    abandoned early are released when the pass ends."""
    path = str(tmp_path / "big.parquet")
    n = 200_000
    columns = {f"c{k}": np.arange(n) * k for k in range(4)}
    columns["x"] = np.arange(n)
    columns["l"] = pa.array([[i] * (i % 3) for i in range(n)])
    pq.write_table(pa.table(columns), path, row_group_size=100_000)  # ~5 MB decoded
    gc.collect()
    baseline = pa.total_allocated_bytes()
    ds = ParquetDataset(path, batch_size=1000)
    assert sum(int(b["x"].shape[0]) for b in ds) == n
    gc.collect()
    assert pa.total_allocated_bytes() <= baseline + (1 << 18)
    it = iter(ds)
    first = next(it)
    np.testing.assert_array_equal(first["x"].numpy(), np.arange(1000))
    assert pa.total_allocated_bytes() > baseline + (1 << 18)  # row groups held
    del it, first
    gc.collect()
    assert pa.total_allocated_bytes() <= baseline + (1 << 18)
