"""DeepRec's ported optimizer tests that train a table (or a dense variable)
with one of `keras_rec_emb.optimizers` and check DeepRec's numbers, under
both Keras backends, with DeepRec's inputs, expected numbers and NumPy
references (tests/_deeprec_cases.py). Each step differentiates DeepRec's
test loss, `sum(emb * 2)`, through the layer (tests/_table_training.py),
or runs Keras's `train_on_batch`. The TensorFlow-only cases (checkpoints,
the fused sparse ops) are in tests/test_deeprec_parity.py."""

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable
from tests._deeprec_cases import (ADAGRAD_DECAY_IDS, ADAGRAD_DECAY_LOSSES, ADAMW_GRADS,
                                  ADAMW_STARTS, CASE_IDS, CASES, DIM, DVD, GRADS, IDLE_ROW_ACCUMULATOR, OFFSET,
                                  RECORD_FREQ_EXPECTED, RECORD_FREQ_IDS, T0, W0, WEIGHT_DECAY,
                                  adamw_update_numpy, deeprec_adagrad_decay_expected,
                                  ftrl_element_wise_one_step, idle_row_key)
from tests._table_training import (FILTERS, check_ftrl_evicted, freqs, ftrl_evict_trained, ones_ev,
                                   row_gradient, train_step, train_steps)
from tests.conftest import MatrixInitializer

pytestmark = pytest.mark.backends("tensorflow", "jax")


# -- AdagradDecay -----------------------------------------------------------------

@pytest.mark.parametrize("driver", ["grad", "train_on_batch"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-7])
def test_adagrad_decay_on_an_embedding_variable(epsilon, driver):
    # embedding_variable_ops_test.py: testEmbeddingVariableForAdagradDecayV2
    # (AdagradDecayOptimizerV2(0.1, gs, accumulator_decay_step=2)).
    opt = kre.optimizers.AdagradDecay(0.1, accumulator_decay_step=2, epsilon=epsilon)
    layer = ones_ev()
    if driver == "grad":
        losses, _ = train_steps(layer, ADAGRAD_DECAY_IDS, opt, 5)
    else:
        ids = keras.Input(shape=(), dtype="int32")
        model = keras.Model(ids, layer(ids))
        model.compile(optimizer=opt, loss=lambda _, emb: keras.ops.sum(emb * 2.0))
        x = np.asarray(ADAGRAD_DECAY_IDS, np.int32)
        losses = [float(model.train_on_batch(x, np.zeros(len(x), np.float32)))
                  for _ in range(5)]
    assert losses[0] == ADAGRAD_DECAY_LOSSES[0]
    np.testing.assert_allclose(losses[1:], ADAGRAD_DECAY_LOSSES[1:], atol=1e-5)


@pytest.mark.parametrize("rate, init", [(0.9, 0.1), (0.6, 1.0)])
def test_adagrad_decay_dense_and_sparse(rate, init):
    # adagrad_decay_test.py: doTestBasic / doTestBaseline (dense gradients)
    # and doTestSparseBasic / doTestSparseBaseline (a gradient on one row of
    # a dense variable, as keras.layers.Embedding gives): decay_step=3,
    # 4 steps, decay at the third. Under JAX the "sparse" gradient is dense,
    # zero on the other row, which leaves that row's value and (floored at
    # its initial value) accumulator as DeepRec's sparse update does.
    var0, var1 = keras.Variable([1.0, 2.0]), keras.Variable([3.0, 4.0])
    sp0, sp1 = keras.Variable([[1.0], [2.0]]), keras.Variable([[3.0], [4.0]])
    opt = kre.optimizers.AdagradDecay(1.0, initial_accumulator_value=init,
                                      accumulator_decay_step=3,
                                      accumulator_decay_rate=rate, epsilon=0.0)
    for _ in range(4):
        opt.apply_gradients([
            (np.array([0.1, 0.1], np.float32), var0), (np.array([0.2, 0.2], np.float32), var1),
            (row_gradient([[0.1]], [0], 2), sp0), (row_gradient([[0.2]], [1], 2), sp1)])
    v0, a0 = deeprec_adagrad_decay_expected(0.1, init, rate, 4, 1.0)
    v1, a1 = deeprec_adagrad_decay_expected(0.2, init, rate, 4, 3.0)
    np.testing.assert_allclose(var0.numpy(), [v0, v0 + 1], rtol=1e-6)
    np.testing.assert_allclose(var1.numpy(), [v1, v1 + 1], rtol=1e-6)
    np.testing.assert_allclose(sp0.numpy(), [[v0], [2.0]], rtol=1e-6)
    np.testing.assert_allclose(sp1.numpy(), [[3.0], [v1 + 1]], rtol=1e-6)
    accs = {id(v): a for v, a in zip(opt._trainable_variables, opt._accumulators)}
    np.testing.assert_allclose(accs[id(var0)].numpy(), [a0, a0], rtol=1e-6)
    np.testing.assert_allclose(accs[id(sp1)].numpy(), [[init], [a1]], rtol=1e-6)


@pytest.mark.parametrize("epsilon", [0.0, 1e-7])
def test_adagrad_decay_an_idle_row_decays_once_per_update(epsilon):
    # KvSparseApplyAdagradDecay: at most one decay per update of a row,
    # however many periods it missed (accum_decay_power += 1).
    layer = EmbeddingVariable(DIM, initializer=MatrixInitializer(T0), default_value_dim=DVD)
    opt = kre.optimizers.AdagradDecay(0.1, initial_accumulator_value=0.1,
                                      accumulator_decay_step=2, accumulator_decay_rate=0.5,
                                      epsilon=epsilon)
    layer.build()
    opt.build(layer.trainable_variables)
    for step in range(9):
        train_step(layer, [idle_row_key(step)], opt, weight=3.0)
    data = layer.export()
    i = list(data["keys"]).index(5)
    np.testing.assert_allclose(data["slots"]["accumulator"][i], [IDLE_ROW_ACCUMULATOR] * DIM,
                               rtol=1e-6)
    np.testing.assert_array_equal(data["slots"]["decay_period"][i], [1.0])  # not four


def test_any_positive_shard_count():
    # DeepRec accepts ht_partition_num=20 (and any other count).
    for shards in (1, 3, 20, 1000):
        layer = ones_ev(name=f"s{shards}", num_shards=shards)
        losses, _ = train_steps(layer, ADAGRAD_DECAY_IDS, kre.optimizers.AdagradDecay(
            0.1, accumulator_decay_step=2, epsilon=0.0), 3)
        np.testing.assert_allclose(losses, ADAGRAD_DECAY_LOSSES[:3], atol=1e-5)
    with pytest.raises(ValueError, match=r"num_shards.*\[1, 65536\].*num_shards=70000"):
        kre.EmbeddingVariableOption(num_shards=70000)
    with pytest.raises(ValueError, match="num_shards=0"):
        kre.EmbeddingVariableOption(num_shards=0)


# -- Admission filters under each optimizer -----------------------------------------

@pytest.mark.parametrize("make_filter", FILTERS, ids=["counter", "cbf"])
@pytest.mark.parametrize("make_opt", [
    lambda: kre.optimizers.AdagradDecay(0.1), lambda: kre.optimizers.Ftrl(
        0.1, l1_regularization_strength=2.0, l2_regularization_strength=1e-5),
    lambda: kre.optimizers.AdamAsync(0.1), lambda: kre.optimizers.SGD(0.1)],
    ids=["adagrad_decay", "ftrl", "adam_async", "sgd"])
def test_filter_the_admitting_lookup_still_reads_no_permission(make_filter, make_opt):
    # embedding_variable_ops_test.py: testEmbeddingVariableFor{AdagradDecay,
    # Ftrl,AdamAsync,GradientDescent}Filter: CounterFilter(3) and key [1]:
    # the first three runs read 0.0, the fourth a row != 1.0 (admitted by
    # the third run, whose gradient trained it).
    layer = ones_ev(filter_option=make_filter())
    _, reads = train_steps(layer, [1], make_opt(), 4)
    for r in reads[:3]:
        np.testing.assert_array_equal(r, np.zeros((1, 3)))
    assert not np.any(reads[3] == 1.0)


def test_filter_one_value_per_key_per_batch():
    # embedding_variable_ops_test.py:
    # testEmbeddingVariableForFeatureFilterFromContribFeatureColumn: ids
    # [1,1,1,1,2,2,2,3,3,4], CounterFilter(3): the first run reads 0 for all
    # (keys 1 and 2 reach the threshold in it); the second reads rows for
    # keys 1 and 2, 0 for keys 3 and 4.
    ids = [1, 1, 1, 1, 2, 2, 2, 3, 3, 4]
    for make_filter in FILTERS:
        layer = ones_ev(name="ff", filter_option=make_filter(),
                        init_option=kre.InitializerOption(default_value_no_permission=-0.5))
        _, reads = train_steps(layer, ids, kre.optimizers.Ftrl(
            0.1, l1_regularization_strength=2.0, l2_regularization_strength=1e-5), 2)
        np.testing.assert_array_equal(reads[0], np.full((10, 3), -0.5))
        assert not np.any(reads[1][:7] == -0.5) and not np.any(reads[1][:7] == 1.0)
        np.testing.assert_array_equal(reads[1][7:], np.full((3, 3), -0.5))
        # All occurrences of a key in one batch read the same row.
        np.testing.assert_array_equal(reads[1][0], reads[1][3])


def test_cbf_filter_admits_after_filter_freq_steps():
    # embedding_variable_ops_test.py: testEmbeddingVariableForBloomFilterInt64
    # (CBFFilter(3, 5, 0.01), 4 shards): three runs read 0, the fourth a
    # trained row.
    for counter in ("uint8", "uint16", "uint32", "uint64"):
        layer = ones_ev(name=f"cbf_{counter}", filter_option=kre.CBFFilter(
            3, 5, 0.01, counter), num_shards=4)
        _, reads = train_steps(layer, [1], kre.optimizers.AdagradDecay(0.1), 4)
        for r in reads[:3]:
            np.testing.assert_array_equal(r, np.zeros((1, 3)))
        assert not np.any(reads[3] == 1.0) and not np.any(reads[3] == 0.0)


# -- Ftrl ---------------------------------------------------------------------------

def test_ftrl_group_rule_and_l2_weight_evict():
    # evict() does what DeepRec's save does (tests/test_deeprec_parity.py:
    # the checkpoint's write).
    layer = ftrl_evict_trained()
    assert layer.evict() == 1
    check_ftrl_evicted(layer)


def test_ftrl_default_table_rule_stays_element_wise():
    layer = ones_ev()
    opt = kre.optimizers.Ftrl(0.1, l1_regularization_strength=2.0,
                              l2_regularization_strength=0.00001)
    train_steps(layer, [0, 0, 0], opt, 1)
    # Keras's element-wise rule for one element with g = 6.
    np.testing.assert_allclose(layer.export()["values"][0],
                               [ftrl_element_wise_one_step(6.0)] * 3, rtol=1e-6)
    with pytest.raises(ValueError, match="table_rule.*'group'"):
        kre.optimizers.Ftrl(0.1, table_rule="group")
    cfg = kre.optimizers.Ftrl(0.1, table_rule="deeprec").get_config()
    assert kre.optimizers.Ftrl.from_config(cfg).table_rule == "deeprec"


# -- Frequencies under each optimizer ----------------------------------------------

@pytest.mark.parametrize("make_opt", [
    lambda: kre.optimizers.Adagrad(0.1), lambda: kre.optimizers.AdagradDecay(0.1),
    lambda: kre.optimizers.Adam(0.1), lambda: kre.optimizers.AdamAsync(0.1),
    lambda: kre.optimizers.Ftrl(0.1), lambda: kre.optimizers.SGD(0.1)],
    ids=["adagrad", "adagrad_decay", "adam", "adam_async", "ftrl", "sgd"])
def test_record_freq_counts_every_occurrence_once_per_step(make_opt):
    # embedding_variable_ops_test.py: _RecordFreqTestTemplate (TF_RECORD_FREQ=1,
    # ids [1,1,1,2,2,3], two runs of lookup + train op): var_1-freqs 6, 4, 2.
    layer = ones_ev(track_meta=True, record_freq=True)
    train_steps(layer, RECORD_FREQ_IDS, make_opt(), 2)
    assert freqs(layer) == RECORD_FREQ_EXPECTED


@pytest.mark.parametrize("make_filter", FILTERS, ids=["counter", "cbf"])
def test_filtered_frequency_stops_at_filter_freq_unless_record_freq(make_filter):
    # DeepRec's default (no TF_RECORD_FREQ): an admitted key reports
    # filter_freq however often it is seen; with it, every occurrence.
    ids = [1, 1, 1, 1, 2, 2, 2, 3, 3, 4]
    capped = ones_ev(name="capped", filter_option=make_filter())
    train_steps(capped, ids, kre.optimizers.SGD(0.1), 3)
    assert freqs(capped) == {1: 3, 2: 3, 3: 3, 4: 3}
    counted = ones_ev(name="counted", filter_option=make_filter(), record_freq=True)
    train_steps(counted, ids, kre.optimizers.SGD(0.1), 3)
    assert freqs(counted) == {1: 12, 2: 9, 3: 6, 4: 3}
    # Keys not admitted yet count below the threshold either way (key 4
    # has been seen 3 times: admitted by the third step).
    assert counted.table_size() == capped.table_size() == 4


# -- AdamW --------------------------------------------------------------------------
# Both conventions: Keras's decay (lr * weight_decay * var, the default) and
# DeepRec's unscaled one (weight_decay * var).

@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("sparse", [False, pytest.param(
    True, marks=pytest.mark.backends("tensorflow"))])  # a JAX gradient is dense
def test_adamw_decay_conventions(scaled, sparse):
    # weight_decay_optimizers_test.py: AdamWOptimizerTest.testBasic /
    # testSparse (DeepRec: scale_weight_decay_by_learning_rate=False); the
    # same numbers with the decay scaled by the learning rate (Keras).
    var0, var1 = (keras.Variable(v) for v in ADAMW_STARTS)
    g0, g1 = (np.array(g) for g in ADAMW_GRADS)
    opt = kre.optimizers.AdamW(WEIGHT_DECAY, scale_weight_decay_by_learning_rate=scaled)

    def grad(g):
        return row_gradient(g, [0, 1], 2) if sparse else np.asarray(g, np.float32)

    n0, n1 = (np.array(v) for v in ADAMW_STARTS)
    m0 = v0 = m1 = v1 = 0.0
    for t in range(1, 4):
        opt.apply_gradients([(grad(g0), var0), (grad(g1), var1)])
        n0, m0, v0 = adamw_update_numpy(n0, g0, t, m0, v0, scaled=scaled)
        n1, m1, v1 = adamw_update_numpy(n1, g1, t, m1, v1, scaled=scaled)
        np.testing.assert_allclose(var0.numpy(), n0, rtol=1e-6)
        np.testing.assert_allclose(var1.numpy(), n1, rtol=1e-6)


@pytest.mark.parametrize("scaled", [False, True])
def test_adamw_decay_conventions_on_a_table(scaled):
    layer = ones_ev(dim=2)
    opt = kre.optimizers.AdamW(WEIGHT_DECAY, scale_weight_decay_by_learning_rate=scaled)
    g = np.array([0.1, 0.1])
    want, m, v = np.ones(2), 0.0, 0.0
    layer.build()
    opt.build(layer.trainable_variables)
    for t in range(1, 4):
        train_step(layer, [4], opt, weight=g[None, :])
        want, m, v = adamw_update_numpy(want, g, t, m, v, scaled=scaled)
    np.testing.assert_allclose(layer.export()["values"][0], want, rtol=1e-6)
    cfg = opt.get_config()
    assert cfg["scale_weight_decay_by_learning_rate"] is scaled
    assert kre.optimizers.AdamW.from_config(cfg).scale_weight_decay_by_learning_rate is scaled
    with pytest.raises(TypeError, match="scale_weight_decay_by_learning_rate='no'"):
        kre.optimizers.AdamW(0.01, scale_weight_decay_by_learning_rate="no")


# -- Step-by-step NumPy references ----------------------------------------------------
# tests/optimizers/test_deeprec_optimizers.py's cases under JAX: one
# optimizer trains a dense variable (`apply_gradients`) and a table (the
# lookup's backward, the rows' gradient injected as the loss's weights). Its
# keras.layers.Embedding with sparse gradients is TensorFlow's alone (a JAX
# gradient is dense).

def _jax_key(key):
    # int32 keys (no x64): k * OFFSET + 7 -> k * 1000 + 7, the same
    # initializer row (both are 2 mod DVD = 5).
    return (int(key) - 7) // OFFSET * 1000 + 7


def _reference_key(key):
    return (int(key) - 7) // 1000 * OFFSET + 7


@pytest.mark.backends("jax")
@pytest.mark.parametrize("name, kwargs, reference, ref_kwargs", CASES, ids=CASE_IDS)
def test_matches_numpy_reference(name, kwargs, reference, ref_kwargs):
    assert (_jax_key(7 + 3 * OFFSET) % DVD) == (7 + 3 * OFFSET) % DVD
    optimizer = getattr(kre.optimizers, name)(**kwargs)
    w = keras.Variable(W0, name="w")
    layer = EmbeddingVariable(DIM, initializer=MatrixInitializer(T0), ev_option=(
        kre.EmbeddingVariableOption(init_option=kre.InitializerOption(default_value_dim=DVD))))
    layer.build()
    optimizer.build([w, layer.anchor])
    for gw, _, _, t_keys, t_val in GRADS:
        train_step(layer, [_jax_key(k) for k in t_keys], optimizer, weight=t_val)
        optimizer.apply_gradients([(gw, w), (np.zeros((0,), np.float32), layer.anchor)])
    data = layer.export()
    table = {_reference_key(k): data["values"][i] for i, k in enumerate(data["keys"])}
    rw, _, rtable = reference(**ref_kwargs)
    np.testing.assert_allclose(w.numpy(), rw, rtol=1e-4, atol=1e-5)
    assert table.keys() == rtable.keys() and len(table) >= 4
    for k in table:
        np.testing.assert_allclose(table[k], rtable[k], rtol=1e-4, atol=1e-5, err_msg=f"key {k}")
