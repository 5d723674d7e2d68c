"""`KRE>StackedPooledLookup`: GroupEmbedding's inference lookup of stacked
ids `[batch, F, L]` (L > 1) in one op. Against NumPy over the tables'
exported rows, bit-equal to the group lookup's paths (the pooled one and
the deduplicating one), for every kind of table it reads (in batch order,
shard by shard: filtered, file tier, large), its gradient when
differentiated anyway, and its errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding

COMBINERS = ("sum", "mean", "sqrtn", "sum", "mean")


def _tables(key_dtype="int64", **option):
    opt = kre.EmbeddingVariableOption(**option) if option else None
    return [EmbeddingVariable(4 * (1 + j % 2), key_dtype=key_dtype, ev_option=opt,
                              initializer=keras.initializers.RandomUniform(-1, 1, seed=j),
                              name=f"t{j}")
            for j in range(3)]


def _group(tables, default_ids=(None, 7, None, None, 3)):
    """Five features over three tables (features 0 and 3 share table 0, 1 and
    4 share table 1): mixed combiners and dims, two default ids."""
    return GroupEmbedding({
        f"f{j}": FeatureSpec(tables[j % 3], combiner=c, default_id=default_ids[j])
        for j, c in enumerate(COMBINERS)}, output_mode="concat")


def _ids(batch, length, high=300, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, high, (batch, len(COMBINERS), length))
    x[rng.random(x.shape) < 0.4] = -1  # padding anywhere in a row
    x[: batch // 10] = -1  # rows empty in every feature
    return x


def _numpy_lookup(group, x):
    """The expected output from the tables' exported rows: each feature's
    kept ids (or its default id in an empty row) summed, / n for mean,
    / sqrt(n) for sqrtn; ids not in a table read the row its inference
    lookup gives them."""
    outs = []
    for j, spec in enumerate(group.features.values()):
        table = group.tables[spec.table]
        export = table.export()
        rows = dict(zip(export["keys"].tolist(), export["values"]))
        # Ids not exported: their inference lookups, in one call.
        missing = sorted({i for i in x[:, j].ravel().tolist() if i >= 0 and i not in rows}
                         | ({spec.default_id} - set(rows) - {None}))
        if missing:
            read = table(np.array(missing), training=False).numpy()
            rows.update(zip(missing, read))
        out = np.zeros((len(x), table.embedding_dim))
        for b in range(len(x)):
            kept = [i for i in x[b, j].tolist() if i >= 0]
            if not kept and spec.default_id is not None:
                kept = [spec.default_id]
            if not kept:
                continue
            vecs = np.array([rows[i] for i in kept], np.float64)
            scale = {"sum": 1.0, "mean": 1 / len(kept), "sqrtn": 1 / np.sqrt(len(kept))}
            out[b] = vecs.sum(0) * scale[spec.combiner]
        outs.append(out)
    return np.concatenate(outs, 1)


def _group_lookup_paths(group, x, training=False):
    """The same lookup by the group lookup op over each feature's kept ids:
    as it is (the pooled path for a table's only feature, deduplicated for
    tables shared by two features) and with every feature read twice (all
    deduplicated; the first copy's columns)."""
    specs = list(group.features.values())
    tables = [group.tables[s.table] for s in specs]
    x = tf.convert_to_tensor(x)
    ids = [tf.ragged.boolean_mask(x[:, j, :], x[:, j, :] >= 0) for j in range(len(specs))]
    combiners = [s.combiner for s in specs]
    defaults = [s.default_id for s in specs]
    width = sum(t.embedding_dim for t in tables)
    once = kre.ops.group_embedding_lookup_sparse(tables, ids, combiners, default_id=defaults,
                                                 training=training, concat=True)
    twice = kre.ops.group_embedding_lookup_sparse(tables * 2, ids * 2, combiners * 2,
                                                  default_id=defaults * 2, training=training,
                                                  concat=True)
    return [once, twice[:, :width]]


def _old_paths(group, x):
    return [out.numpy() for out in _group_lookup_paths(group, x)]


def _graph_ops(group, x):
    fn = tf.function(lambda t: group(t, training=False))
    return [op.type for op in fn.get_concrete_function(x).graph.get_operations()
            if op.type.startswith("KRE>")]


@pytest.mark.parametrize("length", [1, 2, 5, 12])  # 12: rows longer than the padded combine's
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
@pytest.mark.parametrize("key_dtype", ["int32", "int64"])
def test_matches_numpy_and_the_group_lookup(length, ids_dtype, key_dtype):
    group = _group(_tables(key_dtype))
    x = tf.constant(_ids(300, length).astype(ids_dtype))
    group(x, training=True)  # most ids admitted; a second batch has unseen ones
    x = tf.constant(_ids(300, length, high=400, seed=1).astype(ids_dtype))
    assert _graph_ops(group, x) == ["KRE>StackedPooledLookup"]
    got = group(x, training=False).numpy()
    np.testing.assert_allclose(got, _numpy_lookup(group, x.numpy()), rtol=1e-5, atol=1e-6)
    for old in _old_paths(group, x):
        np.testing.assert_array_equal(got, old)
    # Columns: f0 0:4, f1 4:12, f2 12:16, f3 16:20, f4 20:28.
    np.testing.assert_array_equal(got[:30, :4], 0)  # empty rows, no default id
    np.testing.assert_array_equal(got[:30, 12:20], 0)
    assert np.all(got[:30, 4:12] != 0) and np.all(got[:30, 20:] != 0)  # default ids 7 and 3


@pytest.mark.parametrize("batch", [0, 1, 3000])
def test_batch_sizes_and_all_padding(batch):
    group = _group(_tables())
    group(tf.constant(_ids(64, 4)), training=True)
    x = _ids(batch, 4)
    np.testing.assert_array_equal(group(x).numpy(), _old_paths(group, tf.constant(x))[1])
    empty = np.full((batch, 5, 3), -1)
    got = group(empty).numpy()
    assert got.shape == (batch, 28)
    np.testing.assert_array_equal(got, _old_paths(group, tf.constant(empty))[1])


def test_one_feature_split_over_threads():
    """One feature of 4096 rows is split into ranges of rows over the pool's
    threads (two here); the ranges meet exactly."""
    table = _tables()[0]
    group = GroupEmbedding({"f": FeatureSpec(table, combiner="mean")}, output_mode="concat")
    x = np.random.default_rng(2).integers(-1, 500, (4096, 1, 3))
    group(x, training=True)
    got = group(x).numpy()
    np.testing.assert_array_equal(got, _old_paths(group, tf.constant(x))[1])
    np.testing.assert_allclose(got, _numpy_lookup_single(table, x[:, 0]), rtol=1e-5, atol=1e-6)


def _numpy_lookup_single(table, ids):
    export = table.export()
    rows = dict(zip(export["keys"].tolist(), export["values"]))
    out = np.zeros((len(ids), table.embedding_dim))
    for b, row in enumerate(ids):
        kept = [rows[i] for i in row if i >= 0]
        if kept:
            out[b] = np.mean(kept, 0)
    return out


@pytest.mark.parametrize("kind", ["filter", "file", "large"])
def test_tables_read_shard_by_shard(kind, tmp_path):
    """Tables that do not read in batch order: a counter filter (keys not
    admitted read no_permission_value), a file tier, a table larger than
    batch-order reads serve. Their features are looked up shard by shard:
    the same values as the group lookup's."""
    if kind == "filter":
        tables = _tables(filter_option=kre.CounterFilter(2), init_option=kre.InitializerOption(
            default_value_no_permission=0.5))
    elif kind == "file":
        tables = _tables(storage_option=kre.StorageOption(
            "FILE", storage_path=str(tmp_path), storage_size=4096))
    else:
        tables = _tables()
        tables[0](np.arange(70_000, dtype=np.int64) + 10_000, training=True)
    group = _group(tables)
    group(tf.constant(_ids(500, 4)), training=True)
    x = tf.constant(_ids(500, 4, high=400, seed=1))
    got = group(x).numpy()
    for old in _old_paths(group, x):
        np.testing.assert_array_equal(got, old)
    if kind == "filter":  # seen once only: not admitted, reads 0.5 in every column
        assert np.any(got == 0.5)
    else:
        np.testing.assert_allclose(got, _numpy_lookup(group, x.numpy()), rtol=1e-5, atol=1e-6)


def test_gradient_when_differentiated_in_inference():
    """Under a tape with training=False the output still has the group
    lookup's gradient: IndexedSlices over each table's distinct keys."""
    tables = _tables()
    group = _group(tables)
    x = tf.constant(_ids(200, 4))
    group(x, training=True)
    variables = [t.table.variable for t in tables]
    grads = []
    for stacked in (True, False):  # the stacked op; the deduplicating group lookup
        with tf.GradientTape() as tape:
            out = group(x, training=False) if stacked else _group_lookup_paths(group, x)[1]
            loss = tf.reduce_sum(out ** 2)
        grads.append(tape.gradient(loss, variables))
    for new, old in zip(*grads):
        assert isinstance(new, tf.IndexedSlices)
        by_key_new, by_key_old = _sum_by_key(new), _sum_by_key(old)
        assert sorted(by_key_new) == sorted(by_key_old)
        for k, v in by_key_new.items():
            np.testing.assert_allclose(v, by_key_old[k], rtol=1e-5, atol=1e-6)


def _sum_by_key(grad):
    """{key: summed row} of an IndexedSlices gradient."""
    out = {}
    for i, v in zip(grad.indices.numpy().tolist(), grad.values.numpy()):
        out[i] = out.get(i, 0) + v
    return out


def test_mixed_precision_output():
    group = _group(_tables())
    x = _ids(50, 3)
    group(x, training=True)
    want = group(x).numpy()
    half = _group(group.tables)
    half.dtype_policy = keras.DTypePolicy("mixed_float16")
    got = half(x)
    assert got.dtype == tf.float16
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float16))


def test_not_used_where_it_does_not_serve():
    """Dense matrices, max_norm features and dict output keep the group
    lookup; one id per row (ids [batch, F, 1] or [batch, F]) takes the op
    too."""
    tables = _tables()
    x = tf.constant(_ids(20, 3))
    dense = GroupEmbedding({"a": FeatureSpec(tables[0]),
                            "b": FeatureSpec(keras.layers.Embedding(500, 2))},
                           output_mode="concat")
    clipped = GroupEmbedding({"a": FeatureSpec(tables[0]),
                              "b": FeatureSpec(tables[1], max_norm=1.0)}, output_mode="concat")
    as_dict = GroupEmbedding({"a": FeatureSpec(tables[0]), "b": FeatureSpec(tables[1])})
    for group in (dense, clipped, as_dict):
        group(x[:, :2])  # built
        assert "KRE>StackedPooledLookup" not in _graph_ops(group, x[:, :2])
    single = _group(tables)
    single(x)
    assert "KRE>StackedPooledLookup" in _graph_ops(single, x[:, :, :1])
    assert "KRE>StackedPooledLookup" in _graph_ops(single, x[:, :, 0])


def _op(ids, tables=None, **attrs):
    tables = tables or _tables()[:1]
    for t in tables:
        t.build()
    n = ids.shape[1]
    args = dict(table_key_dtypes=[t.key_dtype for t in tables],
                table_dims=[t.embedding_dim for t in tables], feature_tables=[0] * n,
                combiners=["sum"] * n, default_ids=[-1] * n, num_features=n)
    args.update(attrs)
    return _ops.gen().kre_stacked_pooled_lookup([t.table.handle for t in tables], ids, **args)


def test_op_bad_input():
    x = tf.constant(np.zeros((2, 2, 3), np.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="combiners\\[1\\].*'max'"):
        _op(x, combiners=["sum", "max"])
    with pytest.raises(tf.errors.InvalidArgumentError, match="feature_tables\\[1\\] = 3"):
        _op(x, feature_tables=[0, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="table_dims\\[0\\] must be >= 1"):
        _op(x, table_dims=[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="num_features = 2 entries"):
        _op(x, default_ids=[-1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="has dim 4 but the op expects"):
        _op(x, table_dims=[8])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank 3|must be"):
        _op(tf.constant(np.zeros((2, 2), np.int64)))
    t32 = _tables("int32")[:1]
    with pytest.raises(tf.errors.InvalidArgumentError, match="default_ids\\[0\\] = 4294967296"):
        _op(x, tables=t32, default_ids=[2**32, -1])
    big = np.zeros((2, 2, 3), np.int64)
    big[1, 1, 2] = 2**40
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="id 1099511627776 of feature 1.*int32 keys"):
        _op(tf.constant(big), tables=t32)
