"""GroupEmbedding's one-tensor form: ids `[batch, F]` or `[batch, F, L]`
split per feature by one `KRE>UnstackFeatureIds` (L = 1) or
`KRE>UnstackKeptIds` op (padding dropped). The ops against NumPy;
the layer against the dict of per-feature inputs (bit-equal outputs, equal
tables after training); saving; errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding

DVD = 7
COMBINERS = ("sum", "mean", "sqrtn", "sum", "mean")


# -- the op alone --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(6, 4, 3), (5, 3, 1), (0, 2, 4), (3, 2, 0), (2000, 7, 5)])
def test_unstack_op_matches_numpy(dtype, shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.integers(-1, np.iinfo(dtype).max, shape, dtype=dtype)
    values, splits = _ops.unstack_feature_ids(tf.constant(x))
    assert len(values) == shape[1]
    for j, v in enumerate(values):
        assert v.dtype == tf.int64 and v.shape == (shape[0] * shape[2],)
        np.testing.assert_array_equal(v.numpy(), x[:, j, :].reshape(-1).astype(np.int64))
    np.testing.assert_array_equal(splits.numpy(), np.arange(shape[0] + 1) * shape[2])


def test_unstack_op_shapes_in_a_graph():
    fn = tf.function(lambda x: _ops.unstack_feature_ids(x))
    static = fn.get_concrete_function(tf.TensorSpec([8, 3, 5], tf.int64)).structured_outputs
    assert [v.shape.as_list() for v in static[0]] == [[40]] * 3
    assert static[1].shape.as_list() == [9]
    dynamic = fn.get_concrete_function(tf.TensorSpec([None, 3, None], tf.int32))
    assert dynamic.structured_outputs[0][0].shape.as_list() == [None]
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    values, splits = dynamic(tf.constant(x))
    np.testing.assert_array_equal(values[2].numpy(), [8, 9, 10, 11, 20, 21, 22, 23])
    np.testing.assert_array_equal(splits.numpy(), [0, 4, 8])


@pytest.mark.parametrize("op", ["kre_unstack_feature_ids", "kre_unstack_kept_ids"])
def test_unstack_ops_bad_input(op):
    split = getattr(_ops.gen(), op)
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 3"):
        split(tf.zeros([4, 3], tf.int64), num_features=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="num_features = 2"):
        split(tf.zeros([4, 3, 1], tf.int64), num_features=2)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="num_features"):
        split(tf.zeros([4, 0, 1], tf.int64), num_features=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="attr 'T' of float"):
        split(tf.zeros([4, 3, 1], tf.float32), num_features=3)
    with pytest.raises(ValueError, match="rank 3|must be rank 3|Shape must be rank"):
        tf.function(lambda x: split(x, num_features=3)
                    ).get_concrete_function(tf.TensorSpec([4, 3], tf.int64))
    with pytest.raises(ValueError, match="num_features|must be 3|Dimension"):
        tf.function(lambda x: split(x, num_features=3)
                    ).get_concrete_function(tf.TensorSpec([4, 2, 5], tf.int64))
    # Integer ids in, integer ids out: no gradient (the lookup's gradient
    # goes to the tables).
    from tensorflow.python.framework import ops as tf_ops
    name = "KRE>UnstackFeatureIds" if op == "kre_unstack_feature_ids" else "KRE>UnstackKeptIds"
    assert tf_ops.gradient_registry.lookup(name) is None


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(6, 4, 3), (5, 3, 1), (0, 2, 4), (3, 2, 0), (2000, 7, 5),
                                   (300, 3, 11), (40, 2, 300)])
def test_unstack_kept_op_matches_numpy(dtype, shape):
    """KRE>UnstackKeptIds: per feature the ids >= 0 row by row and their row
    splits; padding (-1) and other negative ids dropped, rows left empty;
    lengths 1-8 (compiled), longer (11, and 300: counts past one byte)."""
    rng = np.random.default_rng(sum(shape))
    x = rng.integers(0, np.iinfo(dtype).max, shape, dtype=dtype)
    x[rng.random(shape) < 0.4] = -1
    x[rng.random(shape) < 0.05] = np.iinfo(dtype).min
    if shape[0] > 2:
        x[1] = -1  # an empty row in every feature
    values, splits = _ops.unstack_kept_ids(tf.constant(x))
    assert len(values) == len(splits) == shape[1]
    for j in range(shape[1]):
        col = x[:, j, :]
        want_splits = np.concatenate([[0], np.cumsum((col >= 0).sum(1))]).astype(np.int64)
        assert values[j].dtype == tf.int64 and splits[j].dtype == tf.int64
        np.testing.assert_array_equal(values[j].numpy(), col[col >= 0].astype(np.int64))
        np.testing.assert_array_equal(splits[j].numpy(), want_splits)


def test_unstack_kept_op_threads_and_graph_shapes():
    """Features split over two intra-op threads give the one-thread result;
    in a graph the values have an unknown length, the splits [batch + 1]."""
    x = np.random.default_rng(3).integers(-1, 9, (3000, 9, 5))
    want = _ops.unstack_kept_ids(tf.constant(x))
    fn = tf.function(lambda t: _ops.unstack_kept_ids(t))
    static = fn.get_concrete_function(tf.TensorSpec([8, 3, 5], tf.int64)).structured_outputs
    assert [v.shape.as_list() for v in static[0]] == [[None]] * 3
    assert [s.shape.as_list() for s in static[1]] == [[9]] * 3
    got = fn(tf.constant(x))  # the default pool: 2 threads on these machines
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# -- the layer: stacked vs per-feature inputs ---------------------------------
def _group(matrix_initializer, key_dtype="int64", output_mode="concat", dense=False):
    specs = {}
    for j, c in enumerate(COMBINERS):
        matrix = np.random.default_rng(j).normal(size=(DVD, 3)).astype(np.float32)
        opt = kre.EmbeddingVariableOption(
            init_option=kre.InitializerOption(default_value_dim=DVD))
        init = (keras.initializers.RandomNormal(seed=j) if matrix_initializer is None
                else matrix_initializer(matrix))  # None: a serializable one
        table = EmbeddingVariable(3, initializer=init, ev_option=opt,
                                  key_dtype=key_dtype, name=f"t{j}")
        if dense and j == 4:
            table = keras.layers.Embedding(
                50, 2, embeddings_initializer=keras.initializers.RandomUniform(seed=4))
        specs[f"f{j}"] = FeatureSpec(table, combiner=c, default_id=5 if j == 3 else None)
    return GroupEmbedding(specs, output_mode=output_mode)


def _stacked_ids(batch=9, length=4, seed=0):
    x = np.random.default_rng(seed).integers(-1, 40, (batch, len(COMBINERS), length))
    x[2] = -1  # an empty row in every feature (feature 3 reads default_id 5)
    x[4, 1] = -1
    return x


def _as_dict(x):
    return {f"f{j}": x[:, j] for j in range(x.shape[1])}


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("length", [None, 1, 4])
@pytest.mark.parametrize("dense,batch", [(True, 9), (False, 9), (False, 3000)],
                         ids=["with_dense", "tables", "tables_ordered_lookup"])
def test_stacked_equals_per_feature_inputs(matrix_initializer, dtype, length, dense, batch):
    """Stacked ids give the per-feature form's bits: with a dense matrix
    among the tables (the group lookup), and over tables alone (one
    KRE>StackedPooledLookup, small batches and those read in batch order)."""
    group = _group(matrix_initializer, dense=dense)
    x = _stacked_ids(batch=batch, length=length or 1).astype(dtype)
    if length is None:  # [batch, F]: column j feeds feature j
        x = x[:, :, 0]
    expect = group(_as_dict(x)).numpy()
    np.testing.assert_array_equal(group(x).numpy(), expect)
    traced = tf.function(lambda t: group(t))
    np.testing.assert_array_equal(traced(tf.constant(x)).numpy(), expect)
    # Ids < 0 are padding: an all-padding row reads zeros, or its default id.
    np.testing.assert_array_equal(expect[2, :9], 0)
    np.testing.assert_array_equal(expect[2, 9:12], group.tables[3](np.array([5])).numpy()[0])


@pytest.mark.parametrize("batch", [3, 3000], ids=["small", "ordered_lookup"])
def test_stacked_all_padding(matrix_initializer, batch):
    """A batch whose ids are all padding: no id is kept (an empty ids input
    on every path of the lookup); rows are zeros, or feature 3's default_id
    row, as the per-feature form gives them."""
    group = _group(matrix_initializer)
    x = np.full((batch, len(COMBINERS), 4), -1, np.int64)
    got = group(x).numpy()
    np.testing.assert_array_equal(got, group(_as_dict(x)).numpy())
    assert np.all(got[:, :9] == 0) and np.all(got[:, 12:] == 0)
    assert np.all(got[:, 9:12] != 0)  # feature 3 (dim 3) reads default_id 5


def test_stacked_dict_output(matrix_initializer):
    group = _group(matrix_initializer, output_mode="dict")
    x = _stacked_ids()
    got, expect = group(x), group(_as_dict(x))
    assert list(got) == list(expect)
    for name in expect:
        np.testing.assert_array_equal(got[name].numpy(), expect[name].numpy())


def test_stacked_graph_has_no_per_feature_ops(matrix_initializer):
    group = _group(matrix_initializer)
    group(_stacked_ids())
    # Training: a split (plain for one id a row, pruning for several or
    # unknown) and the group lookup. Inference: one op, for any length
    # (length 0: ids [batch, F]).
    for dtype, length, training, lookup in [
            (tf.int64, 0, True, ["KRE>UnstackFeatureIds", "KRE>GroupLookup"]),
            (tf.int64, 0, False, ["KRE>StackedPooledLookup"]),
            (tf.int32, 4, True, ["KRE>UnstackKeptIds", "KRE>GroupLookup"]),
            (tf.int64, 4, True, ["KRE>UnstackKeptIds", "KRE>GroupLookup"]),
            (tf.int64, None, True, ["KRE>UnstackKeptIds", "KRE>GroupLookup"]),
            (tf.int64, 1, True, ["KRE>UnstackFeatureIds", "KRE>GroupLookup"]),
            (tf.int64, 1, False, ["KRE>StackedPooledLookup"]),
            (tf.int32, 4, False, ["KRE>StackedPooledLookup"]),
            (tf.int64, 4, False, ["KRE>StackedPooledLookup"]),
            (tf.int64, None, False, ["KRE>StackedPooledLookup"])]:
        shape = [None, 5] if length == 0 else [None, 5, length]
        graph = tf.function(lambda t, training=training: group(t, training=training)
                            ).get_concrete_function(tf.TensorSpec(shape, dtype)).graph
        ops = [op.type for op in graph.get_operations()]
        assert [op for op in ops if op.startswith("KRE>")] == lookup, ops
        assert not {"StridedSlice", "Reshape", "Cast", "Range"} & set(ops), ops


def test_int32_key_tables(matrix_initializer):
    group = _group(matrix_initializer, key_dtype="int32")
    x = _stacked_ids()
    np.testing.assert_array_equal(group(x).numpy(), group(_as_dict(x)).numpy())
    big = x.copy()
    big[0, 2, 1] = 2**40
    with pytest.raises(ValueError, match=r"outside the int32 key range.*1099511627776"):
        group(big)
    with pytest.raises(tf.errors.InvalidArgumentError, match="int32 key range"):
        tf.function(lambda t: group(t))(tf.constant(big))
    # One range check for all features of int32 tables.
    graph = tf.function(lambda t: group(t)).get_concrete_function(
        tf.TensorSpec([None, 5, 4], tf.int64)).graph
    assert [op.type for op in graph.get_operations()].count("LessEqual") == 1


def test_int32_and_int64_tables_together(matrix_initializer):
    t32 = EmbeddingVariable(2, key_dtype="int32", name="t32")
    t64 = EmbeddingVariable(2, name="t64")
    group = GroupEmbedding({"f0": FeatureSpec(t32), "f1": FeatureSpec(t64)},
                           output_mode="concat")
    x = np.array([[[1, -1], [2**40, 3]], [[4, 5], [-1, -1]]])
    np.testing.assert_array_equal(group(x).numpy(), group(_as_dict(x)).numpy())
    x[1, 0, 1] = 2**40  # in the int32 table's feature
    with pytest.raises(ValueError, match="int32 key range"):
        group(x)


def _models(matrix_initializer, length):
    """The same model twice: fed stacked ids, fed a dict of per-feature ids."""
    dense = keras.initializers.Constant(0.1)
    g1 = _group(matrix_initializer)
    stacked_in = keras.Input((5, length), dtype="int64")
    stacked = keras.Model(stacked_in, keras.layers.Dense(
        1, kernel_initializer=dense)(g1(stacked_in)))
    g2 = _group(matrix_initializer)
    dict_in = {f"f{j}": keras.Input((length,), dtype="int64", name=f"f{j}") for j in range(5)}
    per_feature = keras.Model(dict_in, keras.layers.Dense(
        1, kernel_initializer=dense)(g2(dict_in)))
    return stacked, per_feature


def test_training_equals_per_feature_inputs(matrix_initializer):
    stacked, per_feature = _models(matrix_initializer, 4)
    x = _stacked_ids(batch=32, seed=3)
    y = np.random.default_rng(3).integers(0, 2, (32, 1)).astype("float32")
    before = stacked.predict(x, verbose=0)
    for model, inputs in ((stacked, x), (per_feature, _as_dict(x))):
        model.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="binary_crossentropy")
        model.fit(inputs, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    g1, g2 = (next(layer for layer in m.layers if isinstance(layer, GroupEmbedding))
              for m in (stacked, per_feature))
    for a, b in zip(g1.tables, g2.tables):
        ea, eb = a.export(), b.export()
        oa, ob = np.argsort(ea["keys"]), np.argsort(eb["keys"])
        assert len(oa) > 20
        np.testing.assert_array_equal(ea["keys"][oa], eb["keys"][ob])
        np.testing.assert_array_equal(ea["values"][oa], eb["values"][ob])
    after = stacked.predict(x, verbose=0)
    assert not np.allclose(before, after)  # it trained
    np.testing.assert_array_equal(after, per_feature.predict(_as_dict(x), verbose=0))


def test_stacked_model_save_and_reload(saving_round_trip):
    stacked, _ = _models(None, 4)
    assert stacked.output_shape == (None, 1)
    x = _stacked_ids(batch=16, seed=5)
    stacked.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    stacked.fit(x, np.ones((16, 1)), epochs=1, verbose=0)
    saving_round_trip(stacked, inputs=x)


def test_stacked_bad_input(matrix_initializer):
    group = _group(matrix_initializer)
    with pytest.raises(ValueError, match=r"\[batch, 5, length\].*shape \(2, 5, 3, 1\)"):
        group(np.zeros((2, 5, 3, 1), np.int64))
    with pytest.raises(ValueError, match=r"\[batch, 5\].*shape \(2, 4, 3\)"):
        group(np.zeros((2, 4, 3), np.int64))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        group(np.zeros((2,), np.int64))
    with pytest.raises(TypeError, match="integer ids.*float32"):
        group(np.zeros((2, 5, 3), np.float32))
    # A Functional model fails when built, not when fit.
    with pytest.raises(ValueError, match=r"\[batch, 5\].*\(None, 6, 2\)"):
        group(keras.Input((6, 2), dtype="int64"))
    with pytest.raises(TypeError, match="float32"):
        group(keras.Input((5, 2), dtype="float32"))
    weighted = GroupEmbedding({"a": FeatureSpec(EmbeddingVariable(2), weight_feature="w")})
    with pytest.raises(ValueError, match="weight features"):
        weighted(np.zeros((2, 1, 3), np.int64))
