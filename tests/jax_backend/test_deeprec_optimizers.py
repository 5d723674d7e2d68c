"""DeepRec's ported optimizer tests under Keras's JAX backend: the cases of
tests/test_deeprec_parity.py and tests/optimizers/test_deeprec_optimizers.py
that train a table (or a dense variable) with one of
`keras_rec_emb.optimizers` and check DeepRec's numbers, with the same
inputs, expected numbers and NumPy references (tests/_deeprec_cases.py) and
tolerances. A table is updated in the backward of its training lookup, so
each step differentiates DeepRec's test loss, `sum(emb * 2)`, through the
layer (`jax.value_and_grad` of its `stateless_call`), or runs Keras's
`train_on_batch`."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable
from tests._deeprec_cases import (ADAGRAD_DECAY_IDS, ADAGRAD_DECAY_LOSSES, ADAMW_GRADS,
                                  ADAMW_STARTS, CASE_IDS, CASES, DIM, DVD, FTRL_EVICT_IDS,
                                  FTRL_EVICT_ROWS, GRADS, IDLE_ROW_ACCUMULATOR, OFFSET,
                                  RECORD_FREQ_EXPECTED, RECORD_FREQ_IDS, T0, W0, WEIGHT_DECAY,
                                  adamw_update_numpy, deeprec_adagrad_decay_expected,
                                  ftrl_element_wise_one_step, idle_row_key)
from tests.conftest import MatrixInitializer


def ones_ev(dim=3, name="ev", **option):
    return EmbeddingVariable(dim, initializer="ones", name=name,
                             ev_option=kre.EmbeddingVariableOption(**option) if option else None)


def train_step(layer, ids, weight=2.0):
    """One training step of `loss = sum(layer(ids) * weight)`; returns the
    loss (before the step's update) and the embeddings it read."""
    ids = jnp.asarray(np.asarray(ids), jnp.int32)
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def loss_fn(trainable):
        emb, new = layer.stateless_call(trainable, non_trainable, ids, training=True)
        return jnp.sum(emb * jnp.asarray(weight, jnp.float32)), (emb, new)

    (loss, (emb, new)), _ = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    for variable, value in zip(layer.non_trainable_variables, new):
        variable.assign(value)
    return float(loss), np.asarray(emb)


def train_steps(layer, ids, optimizer, steps):
    """DeepRec's test graph: `optimizer` trains the table as the one a model
    is compiled with does (it builds for the layer's variables); one step
    per run; the loss of each run (before its step) and its embeddings."""
    layer.build()
    optimizer.build(layer.trainable_variables)
    assert layer.table_rule is not None and layer.table_rule.optimizer is optimizer
    losses, reads = [], []
    for _ in range(steps):
        loss, emb = train_step(layer, ids)
        losses.append(loss)
        reads.append(emb)
    return losses, reads


def _freqs(layer):
    data = layer.export()
    return dict(zip(data["keys"].tolist(), data["freqs"].tolist()))


# -- AdagradDecay -----------------------------------------------------------------

@pytest.mark.parametrize("driver", ["grad", "train_on_batch"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-7])
def test_adagrad_decay_on_an_embedding_variable(epsilon, driver):
    # embedding_variable_ops_test.py: testEmbeddingVariableForAdagradDecayV2.
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
    # adagrad_decay_test.py: doTestBasic / doTestBaseline and the sparse
    # variants. A JAX gradient is dense: the "sparse" variables get a
    # gradient of zero on their other row, which leaves that row's value
    # and (floored at its initial value) accumulator as DeepRec's sparse
    # update does.
    var0, var1 = keras.Variable([1.0, 2.0]), keras.Variable([3.0, 4.0])
    sp0, sp1 = keras.Variable([[1.0], [2.0]]), keras.Variable([[3.0], [4.0]])
    opt = kre.optimizers.AdagradDecay(1.0, initial_accumulator_value=init,
                                      accumulator_decay_step=3,
                                      accumulator_decay_rate=rate, epsilon=0.0)
    for _ in range(4):
        opt.apply_gradients([
            (jnp.array([0.1, 0.1]), var0), (jnp.array([0.2, 0.2]), var1),
            (jnp.array([[0.1], [0.0]]), sp0), (jnp.array([[0.0], [0.2]]), sp1)])
    v0, a0 = deeprec_adagrad_decay_expected(0.1, init, rate, 4, 1.0)
    v1, a1 = deeprec_adagrad_decay_expected(0.2, init, rate, 4, 3.0)
    np.testing.assert_allclose(var0.numpy(), [v0, v0 + 1], rtol=1e-6)
    np.testing.assert_allclose(var1.numpy(), [v1, v1 + 1], rtol=1e-6)
    np.testing.assert_allclose(sp0.numpy(), [[v0], [2.0]], rtol=1e-6)
    np.testing.assert_allclose(sp1.numpy(), [[3.0], [v1 + 1]], rtol=1e-6)
    accs = {id(v): a for v, a in zip(opt._trainable_variables, opt._accumulators)}
    np.testing.assert_allclose(accs[id(var0)].numpy(), [a0, a0], rtol=1e-6)
    np.testing.assert_allclose(accs[id(sp1)].numpy(), [[init], [a1]], rtol=1e-6)


def test_adagrad_decay_floor_and_row_catch_up():
    # KvSparseApplyAdagradDecay: an idle row decays once when next updated.
    layer = EmbeddingVariable(DIM, initializer=MatrixInitializer(T0), default_value_dim=DVD)
    opt = kre.optimizers.AdagradDecay(0.1, initial_accumulator_value=0.1,
                                      accumulator_decay_step=2, accumulator_decay_rate=0.5)
    layer.build()
    opt.build(layer.trainable_variables)
    for step in range(9):
        train_step(layer, [idle_row_key(step)], weight=3.0)
    data = layer.export()
    i = list(data["keys"]).index(5)
    np.testing.assert_allclose(data["slots"]["accumulator"][i], IDLE_ROW_ACCUMULATOR, rtol=1e-6)
    np.testing.assert_array_equal(data["slots"]["decay_period"][i], [1.0])


def test_any_positive_shard_count():
    # DeepRec accepts ht_partition_num=20 (and any other count).
    for shards in (1, 3, 20, 1000):
        layer = ones_ev(name=f"s{shards}", num_shards=shards)
        losses, _ = train_steps(layer, ADAGRAD_DECAY_IDS, kre.optimizers.AdagradDecay(
            0.1, accumulator_decay_step=2, epsilon=0.0), 3)
        np.testing.assert_allclose(losses, ADAGRAD_DECAY_LOSSES[:3], atol=1e-5)


# -- Admission filters under each optimizer -----------------------------------------

FILTERS = [lambda: kre.CounterFilter(3), lambda: kre.CBFFilter(3, 1000, 0.01)]


@pytest.mark.parametrize("make_filter", FILTERS, ids=["counter", "cbf"])
@pytest.mark.parametrize("make_opt", [
    lambda: kre.optimizers.AdagradDecay(0.1), lambda: kre.optimizers.Ftrl(
        0.1, l1_regularization_strength=2.0, l2_regularization_strength=1e-5),
    lambda: kre.optimizers.AdamAsync(0.1), lambda: kre.optimizers.SGD(0.1)],
    ids=["adagrad_decay", "ftrl", "adam_async", "sgd"])
def test_filter_the_admitting_lookup_still_reads_no_permission(make_filter, make_opt):
    # embedding_variable_ops_test.py: testEmbeddingVariableFor{AdagradDecay,
    # Ftrl,AdamAsync,GradientDescent}Filter.
    layer = ones_ev(filter_option=make_filter())
    _, reads = train_steps(layer, [1], make_opt(), 4)
    for r in reads[:3]:
        np.testing.assert_array_equal(r, np.zeros((1, 3)))
    assert not np.any(reads[3] == 1.0)


def test_filter_one_value_per_key_per_batch():
    # embedding_variable_ops_test.py:
    # testEmbeddingVariableForFeatureFilterFromContribFeatureColumn.
    ids = [1, 1, 1, 1, 2, 2, 2, 3, 3, 4]
    for make_filter in FILTERS:
        layer = ones_ev(name="ff", filter_option=make_filter(),
                        init_option=kre.InitializerOption(default_value_no_permission=-0.5))
        _, reads = train_steps(layer, ids, kre.optimizers.Ftrl(
            0.1, l1_regularization_strength=2.0, l2_regularization_strength=1e-5), 2)
        np.testing.assert_array_equal(reads[0], np.full((10, 3), -0.5))
        assert not np.any(reads[1][:7] == -0.5) and not np.any(reads[1][:7] == 1.0)
        np.testing.assert_array_equal(reads[1][7:], np.full((3, 3), -0.5))
        np.testing.assert_array_equal(reads[1][0], reads[1][3])


def test_cbf_filter_admits_after_filter_freq_steps():
    # embedding_variable_ops_test.py: testEmbeddingVariableForBloomFilterInt64.
    for counter in ("uint8", "uint16", "uint32", "uint64"):
        layer = ones_ev(name=f"cbf_{counter}", filter_option=kre.CBFFilter(
            3, 5, 0.01, counter), num_shards=4)
        _, reads = train_steps(layer, [1], kre.optimizers.AdagradDecay(0.1), 4)
        for r in reads[:3]:
            np.testing.assert_array_equal(r, np.zeros((1, 3)))
        assert not np.any(reads[3] == 1.0) and not np.any(reads[3] == 0.0)


# -- Ftrl ---------------------------------------------------------------------------

def test_ftrl_group_rule_and_l2_weight_evict():
    # embedding_variable_ops_test.py: testEmbeddingVariableForL2FeatureEviction;
    # evict() does what DeepRec's save does.
    layer = ones_ev(evict_option=kre.L2WeightEvict(0.9))
    opt = kre.optimizers.Ftrl(0.1, l1_regularization_strength=2.0,
                              l2_regularization_strength=0.00001, table_rule="deeprec")
    train_steps(layer, FTRL_EVICT_IDS, opt, 1)
    assert layer.evict() == 1
    emb = np.asarray(layer(np.asarray(FTRL_EVICT_IDS, np.int32), training=False))
    np.testing.assert_allclose(emb, FTRL_EVICT_ROWS, rtol=1e-6)
    assert sorted(layer.export()["keys"].tolist()) == [0, 1]  # key 2 evicted


def test_ftrl_default_table_rule_stays_element_wise():
    layer = ones_ev()
    opt = kre.optimizers.Ftrl(0.1, l1_regularization_strength=2.0,
                              l2_regularization_strength=0.00001)
    train_steps(layer, [0, 0, 0], opt, 1)
    np.testing.assert_allclose(layer.export()["values"][0],
                               [ftrl_element_wise_one_step(6.0)] * 3, rtol=1e-6)


# -- Frequencies under each optimizer ----------------------------------------------

@pytest.mark.parametrize("make_opt", [
    lambda: kre.optimizers.Adagrad(0.1), lambda: kre.optimizers.AdagradDecay(0.1),
    lambda: kre.optimizers.Adam(0.1), lambda: kre.optimizers.AdamAsync(0.1),
    lambda: kre.optimizers.Ftrl(0.1), lambda: kre.optimizers.SGD(0.1)],
    ids=["adagrad", "adagrad_decay", "adam", "adam_async", "ftrl", "sgd"])
def test_record_freq_counts_every_occurrence_once_per_step(make_opt):
    # embedding_variable_ops_test.py: _RecordFreqTestTemplate.
    layer = ones_ev(track_meta=True, record_freq=True)
    train_steps(layer, RECORD_FREQ_IDS, make_opt(), 2)
    assert _freqs(layer) == RECORD_FREQ_EXPECTED


@pytest.mark.parametrize("make_filter", FILTERS, ids=["counter", "cbf"])
def test_filtered_frequency_stops_at_filter_freq_unless_record_freq(make_filter):
    ids = [1, 1, 1, 1, 2, 2, 2, 3, 3, 4]
    capped = ones_ev(name="capped", filter_option=make_filter())
    train_steps(capped, ids, kre.optimizers.SGD(0.1), 3)
    assert _freqs(capped) == {1: 3, 2: 3, 3: 3, 4: 3}
    counted = ones_ev(name="counted", filter_option=make_filter(), record_freq=True)
    train_steps(counted, ids, kre.optimizers.SGD(0.1), 3)
    assert _freqs(counted) == {1: 12, 2: 9, 3: 6, 4: 3}
    assert counted.table_size() == capped.table_size() == 4


# -- AdamW --------------------------------------------------------------------------
# Both conventions, as under TensorFlow: Keras's decay (lr * weight_decay * var,
# the default) and DeepRec's unscaled one (weight_decay * var).

@pytest.mark.parametrize("scaled", [True, False])
def test_adamw_decay_conventions(scaled):
    # weight_decay_optimizers_test.py: AdamWOptimizerTest.testBasic, with the
    # decay scaled by the learning rate or not.
    var0, var1 = (keras.Variable(v) for v in ADAMW_STARTS)
    g0, g1 = (np.array(g) for g in ADAMW_GRADS)
    opt = kre.optimizers.AdamW(WEIGHT_DECAY, scale_weight_decay_by_learning_rate=scaled)
    n0, n1 = (np.array(v) for v in ADAMW_STARTS)
    m0 = v0 = m1 = v1 = 0.0
    for t in range(1, 4):
        opt.apply_gradients([(jnp.asarray(g0, jnp.float32), var0),
                             (jnp.asarray(g1, jnp.float32), var1)])
        n0, m0, v0 = adamw_update_numpy(n0, g0, t, m0, v0, scaled=scaled)
        n1, m1, v1 = adamw_update_numpy(n1, g1, t, m1, v1, scaled=scaled)
        np.testing.assert_allclose(var0.numpy(), n0, rtol=1e-6)
        np.testing.assert_allclose(var1.numpy(), n1, rtol=1e-6)


def test_adamw_decay_conventions_on_a_table():
    layer = ones_ev(dim=2)
    opt = kre.optimizers.AdamW(WEIGHT_DECAY)
    g = np.array([0.1, 0.1])
    want, m, v = np.ones(2), 0.0, 0.0
    layer.build()
    opt.build(layer.trainable_variables)
    for t in range(1, 4):
        train_step(layer, [4], weight=g[None, :])
        want, m, v = adamw_update_numpy(want, g, t, m, v, scaled=True)
    np.testing.assert_allclose(layer.export()["values"][0], want, rtol=1e-6)


# -- Step-by-step NumPy references ----------------------------------------------------
# tests/optimizers/test_deeprec_optimizers.py's cases: one optimizer trains
# a dense variable (`apply_gradients`) and a table (the lookup's backward,
# the rows' gradient injected as the loss's weights). Its keras.layers.Embedding
# with sparse gradients is TensorFlow's alone (a JAX gradient is dense).

def _jax_key(key):
    # int32 keys (no x64): k * OFFSET + 7 -> k * 1000 + 7, the same
    # initializer row (both are 2 mod DVD = 5).
    return (int(key) - 7) // OFFSET * 1000 + 7


def _reference_key(key):
    return (int(key) - 7) // 1000 * OFFSET + 7


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
        train_step(layer, [_jax_key(k) for k in t_keys], weight=t_val)
        optimizer.apply_gradients([(jnp.asarray(gw), w),
                                   (jnp.zeros((0,), jnp.float32), layer.anchor)])
    data = layer.export()
    table = {_reference_key(k): data["values"][i] for i, k in enumerate(data["keys"])}
    rw, _, rtable = reference(**ref_kwargs)
    np.testing.assert_allclose(w.numpy(), rw, rtol=1e-4, atol=1e-5)
    assert table.keys() == rtable.keys() and len(table) >= 4
    for k in table:
        np.testing.assert_allclose(table[k], rtable[k], rtol=1e-4, atol=1e-5, err_msg=f"key {k}")
