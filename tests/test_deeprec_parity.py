"""DeepRec's own unit tests, translated to this package's API with their
inputs, hyper-parameters and expected values kept. Each test
names the DeepRec test it reproduces (DeepRec-AI/DeepRec,
tensorflow/python/...). These are TensorFlow's (checkpoints, the fused
sparse ops, tf.constant ids); those that run under both backends are in
tests/test_deeprec_training.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

from tests._table_training import (FILTERS, check_ftrl_evicted, freqs, ftrl_evict_trained, ones_ev,
                                   train_steps)


# -- 1. AdagradDecay -------------------------------------------------------------

def test_adagrad_decay_old_scalar_decay_period_still_loads(tmp_path):
    # keras_rec_emb 0.1.0 stored a dense variable's decay_period as a scalar.
    ids = keras.Input((1,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(
        keras.layers.Embedding(10, 2)(ids))))
    opt = kre.optimizers.AdagradDecay(0.1, accumulator_decay_step=2)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.array([[1], [2]]), np.ones((2, 1)), verbose=0)
    store = {str(i): np.asarray(v.numpy()) for i, v in enumerate(opt.variables)}
    periods = [i for i, v in enumerate(opt.variables) if "decay_period" in v.path]
    assert periods and all(store[str(i)].ndim == 1 for i in periods)
    for i in periods:
        store[str(i)] = np.array(3.0, np.float32)  # the old layout
    opt.load_own_variables(store)
    for i in periods:
        np.testing.assert_array_equal(opt.variables[i].numpy(), np.full(opt.variables[i].shape, 3.0))


# -- 2. CBFFilter sizing -----------------------------------------------------------

@pytest.mark.parametrize("n", [5, 10, 1000])
def test_cbf_false_positive_rate_holds_for_small_filters_and_many_shards(n):
    # embedding_variable_ops_test.py: testEmbeddingVariableForBloomFilter*
    # use max_element_size=5 (m = 48, k = 7). A fresh key is admitted at its
    # first sighting (filter_freq=2) only through a false positive.
    p = 0.01
    f = kre.CBFFilter(2, n, p, "uint16")
    trials = 200 if n < 1000 else 1
    admitted = probes = 0
    rng = np.random.default_rng(n)
    for t in range(trials):
        layer = EmbeddingVariable(2, name=f"cbf{n}_{t}", ev_option=kre.EmbeddingVariableOption(
            filter_option=f, num_shards=32))
        keys = rng.choice(10**12, size=n + max(1, n // 10), replace=False)
        layer(keys[:n], training=True)  # the design load, one sighting each
        before = layer.table_size()
        fresh = keys[n:]
        layer(fresh, training=True)
        admitted += layer.table_size() - before
        probes += len(fresh)
    rate = admitted / probes
    assert rate < 4 * p, rate


# -- 3. Admission timing -------------------------------------------------------------

@pytest.mark.parametrize("make_filter", FILTERS, ids=["counter", "cbf"])
def test_filter_timing_through_group_embedding_and_functional_ops(make_filter):
    def table(name):
        return EmbeddingVariable(2, initializer="ones", name=name, ev_option=kre.EmbeddingVariableOption(
            filter_option=make_filter(),
            init_option=kre.InitializerOption(default_value_no_permission=-0.5)))

    # Functional op: [1, 1, 1, 1] with filter_freq=3 reads no-permission for
    # every occurrence, then the admitted row.
    ev = table("fn")
    ev.build()
    ids = tf.constant([[1, 1, 1, 1]], tf.int64)
    first = kre.ops.embedding_lookup(ev, ids, training=True)
    np.testing.assert_array_equal(first.numpy(), np.full((1, 4, 2), -0.5))
    second = kre.ops.embedding_lookup(ev, ids, training=True)
    np.testing.assert_array_equal(second.numpy(), np.ones((1, 4, 2)))
    # GroupEmbedding, combiner sum.
    group = kre.layers.GroupEmbedding(
        {"f": kre.layers.FeatureSpec(table("grp"), combiner="sum")})
    x = {"f": tf.constant([[7, 7, 7, 7]], tf.int64)}
    np.testing.assert_allclose(group(x, training=True)["f"].numpy(), [[-2.0, -2.0]])
    np.testing.assert_allclose(group(x, training=True)["f"].numpy(), [[4.0, 4.0]])


# -- 4 and 5. L2WeightEvict and Ftrl on tables ------------------------------------------

def test_ftrl_l2_weight_evict_through_a_checkpoint(tmp_path):
    # testEmbeddingVariableForL2FeatureEviction's save, restore, read.
    layer = ftrl_evict_trained()
    path = tf.train.Checkpoint(layer=layer).write(str(tmp_path / "ckpt"))  # evicts, as DeepRec's save does
    fresh = ones_ev(name="ev2", evict_option=kre.L2WeightEvict(0.9))
    fresh.build()
    tf.train.Checkpoint(layer=fresh).read(path).expect_partial()
    check_ftrl_evicted(fresh)


def test_l2_weight_evict_uses_half_the_squared_norm():
    layer = ones_ev(dim=2, evict_option=kre.L2WeightEvict(0.9))
    layer.build()
    # 0.5 * sum(v**2): 0.81 (kept under the norm rule: |v| = 1.27 > 0.9),
    # 0.9025 (kept), 0.5 * 1.62 = 0.81 < 0.9 evicted.
    layer.import_({"keys": np.array([1, 2, 3]),
                   "values": np.array([[0.9, 0.9], [0.95, 0.95], [0.0, 1.2727922]], np.float32)})
    assert layer.evict() == 2
    assert layer.export()["keys"].tolist() == [2]


# -- 9. Restore into another embedding size (the error; see the report) -----------

def test_restore_into_another_dim_names_the_table_and_the_fix(tmp_path):
    small = EmbeddingVariable(4, name="user_table")
    small(tf.constant([1, 2], tf.int64), training=True)
    path = tf.train.Checkpoint(layer=small).write(str(tmp_path / "ckpt"))
    big = EmbeddingVariable(8, name="user_table")
    big.build()
    with pytest.raises(ValueError, match=r"'user_table.*dim 4.*dim 8.*embedding_dim=4"):
        tf.train.Checkpoint(layer=big).read(path)
    store = {"keys": np.array([1]), "values": np.ones((1, 4), np.float32)}
    with pytest.raises(ValueError, match=r"'user_table.*dim 4.*dim 8.*embedding_dim=4"):
        big.load_own_variables(store)


# -- 8. Fused sparse lookup edge cases ---------------------------------------------
# TF's embedding_ops_test.py (shipped by DeepRec), SafeEmbeddingLookupSparseTest:
# _ids_and_weights_2d / _ids_and_weights_3d and the expectations of
# test_safe_embedding_lookup_sparse_return_zero_vector,
# test_safe_embedding_lookup_sparse_return_special_vector and their _3d
# variants. The reference is tf.nn.safe_embedding_lookup_sparse on a
# tf.Variable holding the same matrix.

_MATRIX = np.arange(16, dtype=np.float32).reshape(4, 4) / 7.0 - 1.0


def _tf_ids_and_weights(rank):
    if rank == 2:
        indices = [[0, 0], [0, 1], [0, 2], [1, 0], [3, 0], [4, 0], [4, 1]]
        shape = [5, 4]
    else:
        indices = [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [1, 0, 0],
                   [1, 1, 0], [1, 1, 1]]
        shape = [2, 3, 4]
    ids = tf.SparseTensor(indices, tf.constant([0, 1, -1, -1, 2, 0, 1], tf.int64), shape)
    weights = tf.SparseTensor(indices, [1.0, 2.0, 1.0, 1.0, 3.0, 0.0, -0.5], shape)
    return ids, weights


def _params(kind):
    if kind == "variable":
        return keras.Variable(_MATRIX)
    layer = EmbeddingVariable(4)
    layer.build()
    layer.table.import_({"keys": np.arange(4), "values": _MATRIX})
    return layer


@pytest.mark.parametrize("kind", ["variable", "table"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn", "sum"])
@pytest.mark.parametrize("default_id", [None, 3])
def test_fused_lookup_prunes_non_positive_weights_like_tf(kind, combiner, default_id):
    ids, weights = _tf_ids_and_weights(2)
    got = kre.ops.embedding_lookup_sparse(_params(kind), ids, weights, combiner=combiner,
                                          default_id=default_id)
    want = tf.nn.safe_embedding_lookup_sparse(
        tf.Variable(_MATRIX), ids, weights, combiner=combiner, default_id=default_id)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    e = _MATRIX
    fill = e[3] if default_id == 3 else np.zeros(4)
    if combiner == "mean":  # TF's expected rows, written out
        expected = [(1.0 * e[0] + 2.0 * e[1]) / 3.0, fill, fill, e[2], fill]
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)
    if combiner == "sum":  # "sum" keeps weights <= 0 (TF and DeepRec)
        np.testing.assert_allclose(got.numpy()[4], 0.0 * e[0] - 0.5 * e[1], rtol=1e-6)


@pytest.mark.parametrize("default_id", [None, 3])
def test_fused_lookup_rank_3_ids_give_rank_3_output(default_id):
    ids, weights = _tf_ids_and_weights(3)
    for params in (_params("variable"), _params("table")):
        got = kre.ops.embedding_lookup_sparse(params, ids, weights, default_id=default_id)
        assert got.shape == (2, 3, 4)
        want = tf.nn.safe_embedding_lookup_sparse(
            tf.Variable(_MATRIX), ids, weights, default_id=default_id)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
        e = _MATRIX
        fill = e[3] if default_id == 3 else np.zeros(4)
        np.testing.assert_allclose(
            got.numpy(), [[(e[0] + 2 * e[1]) / 3, fill, fill], [e[2], fill, fill]],
            rtol=1e-6, atol=1e-6)
    # Dense rank-3 ids and unweighted sparse ones follow the same rule.
    dense = np.array([[[0, 1], [-1, -1]], [[2, -1], [3, 3]]])
    got = kre.ops.embedding_lookup_sparse(keras.Variable(_MATRIX), dense, combiner="sum")
    want = tf.nn.safe_embedding_lookup_sparse(tf.Variable(_MATRIX), _sparse_of(dense),
                                              None, combiner="sum")
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    assert got.shape == (2, 2, 4)


def _sparse_of(dense):
    """All entries of `dense` (padding -1 included) as a SparseTensor."""
    dense = np.asarray(dense)
    idx = np.argwhere(np.ones_like(dense, bool))
    return tf.SparseTensor(idx, tf.constant(dense.reshape(-1), tf.int64), dense.shape)


def test_fused_group_lookup_and_group_embedding_prune_weights():
    ids, weights = _tf_ids_and_weights(2)
    ragged_ids = tf.RaggedTensor.from_sparse(ids)
    ragged_w = tf.RaggedTensor.from_sparse(weights)
    matrix = keras.Variable(_MATRIX)
    mean, total = kre.ops.group_embedding_lookup_sparse(
        [matrix, matrix], [ragged_ids, ragged_ids], ["mean", "sum"],
        sp_weights=[ragged_w, ragged_w], training=True)
    for got, combiner in ((mean, "mean"), (total, "sum")):
        want = tf.nn.safe_embedding_lookup_sparse(tf.Variable(_MATRIX), ids, weights,
                                                  combiner=combiner)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    # Gradient: pruned ids get none (TF's reference gradient on the matrix).
    var = tf.Variable(_MATRIX)
    with tf.GradientTape(persistent=True) as tape:
        ours = kre.ops.embedding_lookup_sparse(var, ids, weights, combiner="mean",
                                               default_id=3)
        ref = tf.nn.safe_embedding_lookup_sparse(var, ids, weights, combiner="mean",
                                                 default_id=3)
        loss_ours = tf.reduce_sum(ours * ours)
        loss_ref = tf.reduce_sum(ref * ref)
    np.testing.assert_allclose(tf.convert_to_tensor(tape.gradient(loss_ours, var)).numpy(),
                               tf.convert_to_tensor(tape.gradient(loss_ref, var)).numpy(),
                               rtol=1e-5, atol=1e-6)
    # GroupEmbedding: a weighted mean feature with default_id.
    group = kre.layers.GroupEmbedding({
        "f": kre.layers.FeatureSpec({"input_dim": 4, "output_dim": 4}, combiner="mean",
                                    weight_feature="w", default_id=3)})
    group({"f": ragged_ids, "w": ragged_w})
    group.tables[0].embeddings.assign(_MATRIX)
    got = group({"f": ragged_ids, "w": ragged_w})["f"]
    want = tf.nn.safe_embedding_lookup_sparse(tf.Variable(_MATRIX), ids, weights,
                                              combiner="mean", default_id=3)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def test_rank_3_ids_of_a_sequence_feature_are_refused():
    ids, _ = _tf_ids_and_weights(3)
    with pytest.raises(ValueError, match=r"sp_ids\[0\].*is_sequence"):
        kre.ops.group_embedding_lookup_sparse([keras.Variable(_MATRIX)], [ids], ["sum"],
                                              is_sequence=True)


# -- 10. Multi-hash Q-R mapping ------------------------------------------------------
# DeepRec's embedding_variable_ops_test.py, testEmbeddingVariableForMultiHashFunction:
# get_multihash_variable([[5, 6], [3, 6]], "Q-R", initializer=ones) trained one
# step by AdagradDecayOptimizer(0.1) on ids [0, 1, 2, 4, 6, 7] with
# loss = sum(emb * 2) equals two plain tables read at ids // 5 and ids % 3.

@pytest.mark.parametrize("operation", ["concat", "add", "mult"])
def test_multi_hash_deeprec_qr_mapping(operation):
    ids = np.array([0, 1, 2, 4, 6, 7])
    layer = kre.layers.MultiHashEmbedding(
        25, [6, 6] if operation == "concat" else 6, operation=operation,
        qr_sizes=(5, 3), initializer="ones")
    q_idx, r_idx = (t.numpy().tolist() for t in layer.partition_indices(ids))
    assert q_idx == [0 // 5, 1 // 5, 2 // 5, 4 // 5, 6 // 5, 7 // 5]
    assert r_idx == [0 % 3, 1 % 3, 2 % 3, 4 % 3, 6 % 3, 7 % 3]
    assert layer.partition_sizes == [5, 3]

    def step(variables, forward):
        opt = kre.optimizers.AdagradDecay(0.1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(forward() * 2.0)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return forward().numpy()

    layer.build()
    got = step(layer.trainable_variables, lambda: layer(ids))
    var1, var2 = keras.Variable(np.ones((5, 6), "float32")), keras.Variable(np.ones((3, 6), "float32"))

    def reference():
        e1, e2 = tf.gather(var1, ids // 5), tf.gather(var2, ids % 3)
        return {"concat": lambda: tf.concat([e1, e2], 1), "add": lambda: e1 + e2,
                "mult": lambda: e1 * e2}[operation]()

    want = step([var1, var2], reference)
    np.testing.assert_array_equal(got, want)
    if operation == "add":  # NumPy: quotient row 0 read 4 times, gradient 2 each
        acc = 0.1 + 8.0 ** 2
        np.testing.assert_allclose(got[0, 0], (1 - 0.1 * 8 / np.sqrt(acc))
                                   + (1 - 0.1 * 4 / np.sqrt(0.1 + 16.0)), rtol=1e-5)


def test_multi_hash_qr_sizes_config_and_bad_input():
    layer = kre.layers.MultiHashEmbedding(25, 6, qr_sizes=(5, 3))
    clone = kre.layers.MultiHashEmbedding.from_config(layer.get_config())
    assert clone.qr_sizes == [5, 3] and clone.partition_sizes == [5, 3]
    with pytest.raises(ValueError, match=r"num_buckets=26"):
        kre.layers.MultiHashEmbedding(26, 6, qr_sizes=(5, 3))
    with pytest.raises(ValueError, match=r"qr_sizes=\(5,\)"):
        kre.layers.MultiHashEmbedding(25, 6, qr_sizes=(5,))
    with pytest.raises(ValueError, match=r"qr_sizes.*CRT"):
        kre.layers.MultiHashEmbedding(25, 6, complementary_strategy="CRT", qr_sizes=(5, 3))
    with pytest.raises(ValueError, match=r"m=5"):
        kre.layers.MultiHashEmbedding(25, 6, m=5, qr_sizes=(5, 3))


def test_fused_lookup_weight_pruning_in_the_stock_serving_graph():
    # export_for_serving replaces the fused op with stock ops: same rule.
    from keras_rec_emb.backend.tensorflow.ids import flat_ids_and_splits
    from keras_rec_emb.ops import embedding_ops as eo

    ids, weights = _tf_ids_and_weights(2)
    v, s = flat_ids_and_splits(ids, "sp_ids")
    for combiner in ("mean", "sum"):
        for w in (weights.values, tf.zeros([0], tf.float32)):
            (got,) = eo.stock_group_lookup(
                [eo._Param(variable=keras.Variable(_MATRIX))], [v], [s], [w], [combiner],
                [None], [None], [True], [False])
            want = tf.nn.safe_embedding_lookup_sparse(
                tf.Variable(_MATRIX), ids, weights if w.shape[0] else None,
                combiner=combiner)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


# -- 9. Restore into another embedding size (opt-in) ------------------------------
# DeepRec's embedding_variable_ops_test.py restore cases: a dim-3 EV checkpoint
# restores into a dim-6 EV (the new columns from the new EV's initializer)
# and into a dim-2 EV (truncated). Here behind restore_dim_mismatch.

def _trained_dim3(tmp_path):
    layer = EmbeddingVariable(3, initializer="ones", name="ev")
    opt = kre.optimizers.Adagrad(0.1)
    train_steps(layer, [0, 1, 1], opt, 1)
    rows = layer.table.export()
    path = tf.train.Checkpoint(layer=layer).write(str(tmp_path / "ckpt"))
    return layer, rows, path


@pytest.mark.parametrize("new_dim", [6, 2])
@pytest.mark.parametrize("route", ["checkpoint", "keras"])
def test_restore_into_another_dim_pads_or_truncates(tmp_path, new_dim, route):
    old_layer, saved, path = _trained_dim3(tmp_path)
    order = np.argsort(saved["keys"])
    saved_rows = saved["values"][order]
    saved_acc = saved["slots"]["accumulator"][order]
    init = np.arange(new_dim * 4, dtype=np.float32).reshape(4, new_dim)
    new = EmbeddingVariable(
        new_dim, initializer=lambda shape, dtype=None: tf.constant(init), name="ev",
        ev_option=kre.EmbeddingVariableOption(
            init_option=kre.InitializerOption(default_value_dim=4)),
        restore_dim_mismatch="pad_or_truncate")
    new.build()
    opt = kre.optimizers.Adagrad(0.1, initial_accumulator_value=0.5)
    opt.build(new.trainable_variables)  # slots known before the restore
    if route == "checkpoint":
        tf.train.Checkpoint(layer=new).read(path).expect_partial()
    else:
        store = {"keys": saved["keys"], "values": saved["values"],
                 "slot:accumulator": saved["slots"]["accumulator"]}
        new.load_own_variables(store)
    got = new.table.export()
    o = np.argsort(got["keys"])
    np.testing.assert_array_equal(got["keys"][o], [0, 1])
    rows, acc = got["values"][o], got["slots"]["accumulator"][o]
    keep = min(3, new_dim)
    np.testing.assert_allclose(rows[:, :keep], saved_rows[:, :keep], rtol=1e-6)
    np.testing.assert_allclose(acc[:, :keep], saved_acc[:, :keep], rtol=1e-6)
    if new_dim == 6:  # key k pads from initializer row k mod 4; slots from their init
        np.testing.assert_allclose(rows[:, 3:], init[[0, 1], 3:])
        np.testing.assert_allclose(acc[:, 3:], 0.5)
    assert rows.shape == (2, new_dim)
    # Trained values really came from the checkpoint (not the initializer).
    assert not np.allclose(rows[:, :keep], 1.0)


def test_restore_dim_mismatch_config_and_default_error(tmp_path):
    _, _, path = _trained_dim3(tmp_path)
    layer = EmbeddingVariable(6, name="ev", restore_dim_mismatch="pad_or_truncate")
    clone = EmbeddingVariable.from_config(layer.get_config())
    assert clone.restore_dim_mismatch == "pad_or_truncate"
    strict = EmbeddingVariable(6, name="ev")
    strict.build()
    with pytest.raises(ValueError, match=r"restore_dim_mismatch='pad_or_truncate'"):
        tf.train.Checkpoint(layer=strict).read(path)
    with pytest.raises(ValueError, match=r"restore_dim_mismatch=.*'pad'"):
        EmbeddingVariable(6, restore_dim_mismatch="pad")


# -- 7. Frequency counting -----------------------------------------------------------
# DeepRec counts a key's frequency in the training lookup (KvResourceGather ->
# filter LookupOrCreateKey -> AddFreq), once per occurrence, so once per step
# for a model with one lookup per step. With a filter and without
# TF_RECORD_FREQ=1 an admitted key reports the filter's threshold
# (CounterFilterDescriptorImpl::GetFreq; before it, EmbeddingVar's
# add_freq_fn_ counted only while freq < filter_freq). Ours: `record_freq`.

def test_export_after_lookups_without_an_optimizer_step():
    # embedding_variable_ops_test.py: testEmbeddingVariableForExport
    # (CounterFilter(filter_freq=1), steps_to_live=10000, three runs of the
    # lookup of [0,1,2,5,6,7] and no train op).
    layer = ones_ev(filter_option=kre.CounterFilter(filter_freq=1),
                    evict_option=kre.GlobalStepEvict(steps_to_live=10000))
    layer.build()
    ids = tf.constant([0, 1, 2, 5, 6, 7], tf.int64)
    for _ in range(3):
        layer(ids, training=True)
    data = layer.export()
    order = np.argsort(data["keys"])
    np.testing.assert_array_equal(data["keys"][order], [0, 1, 2, 5, 6, 7])
    np.testing.assert_array_equal(data["values"][order], np.ones((6, 3)))
    np.testing.assert_array_equal(data["versions"][order], [0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(data["freqs"][order], [1, 1, 1, 1, 1, 1])


def test_record_freq_option_config_and_bad_input():
    opt = kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(2), record_freq=True)
    back = kre.EmbeddingVariableOption.from_config(opt.get_config())
    assert back.record_freq is True
    assert kre.EmbeddingVariableOption().record_freq is False
    with pytest.raises(TypeError, match=r"record_freq=1"):
        kre.EmbeddingVariableOption(record_freq=1)


def test_capped_frequencies_round_trip_and_old_counts_restore(tmp_path):
    # A checkpoint written before the cap (counts past filter_freq) restores
    # its counts unchanged; further lookups do not lower or raise them.
    old = ones_ev(name="old", filter_option=kre.CounterFilter(2), record_freq=True)
    train_steps(old, [5, 5, 5], kre.optimizers.SGD(0.1), 2)
    assert freqs(old) == {5: 6}
    path = tf.train.Checkpoint(layer=old).write(str(tmp_path / "ckpt"))
    new = ones_ev(name="old", filter_option=kre.CounterFilter(2))
    new.build()
    tf.train.Checkpoint(layer=new).read(path).assert_consumed()
    assert freqs(new) == {5: 6}
    new(tf.constant([5, 7, 7, 7], tf.int64), training=True)
    assert freqs(new) == {5: 6, 7: 2}
