"""Admission filters, eviction, metadata and DeepRec's checkpoint parts."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

DIM = 4


def ev(name="ev", filter_option=None, evict_option=None, no_permission=-0.5, **kwargs):
    return EmbeddingVariable(DIM, name=name, ev_option=kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_no_permission=no_permission),
        filter_option=filter_option, evict_option=evict_option, **kwargs))


def model_with(layer, optimizer=None, length=2):
    ids = keras.Input((length,), dtype="int64")
    x = keras.layers.Flatten()(layer(ids))
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=optimizer or kre.optimizers.Adagrad(0.5), loss="mse")
    return model


def row(layer, key):
    data = layer.export()
    keys = list(data["keys"])
    return data["values"][keys.index(key)] if key in keys else None


# -- counter filter -------------------------------------------------------------

def test_counter_filter_reads_no_permission_and_drops_gradients_until_admitted():
    layer = ev(filter_option=kre.CounterFilter(3))
    model = model_with(layer)
    y = np.ones((1, 1))
    for sighting in (1, 2):
        out = layer(np.array([[7, 7]]), training=False)
        np.testing.assert_array_equal(out.numpy(), np.full((1, 2, DIM), -0.5))
        model.fit(np.array([[7, 99 + sighting]]), y, verbose=0)  # one more sighting of 7
        assert layer.table_size() == 0 and layer.table.stats()["filtered"] == sighting + 1
        data = layer.export()
        assert data["freqs_filtered"][list(data["keys_filtered"]).index(7)] == sighting
        assert data["slots"]["accumulator"].shape == (0, DIM)  # no slots for filtered ids
    model.fit(np.array([[7, 1000]]), y, verbose=0)  # third sighting admits 7 and trains it
    assert layer.table_size() == 1
    initial = layer.table.export()["default_values"][7 % 4096]
    trained = row(layer, 7)
    assert trained is not None and not np.allclose(trained, initial)
    model.fit(np.array([[7, 1001]]), y, verbose=0)
    assert not np.array_equal(row(layer, 7), trained)
    data = layer.export()
    # Four sightings; an admitted key's frequency stays at filter_freq (DeepRec).
    assert data["freqs"][list(data["keys"]).index(7)] == 3


def test_key_below_threshold_is_unchanged_by_training():
    layer = ev(filter_option=kre.CounterFilter(1000), no_permission=0.25)
    model = model_with(layer)
    before = model.get_layer(index=-1).kernel.numpy().copy()
    model.fit(np.array([[3, 4]] * 8), np.ones((8, 1)), batch_size=2, epochs=2, verbose=0)
    assert layer.table_size() == 0
    np.testing.assert_array_equal(layer(np.array([[3]]), training=True).numpy(), [[[0.25] * DIM]])
    assert not np.array_equal(model.get_layer(index=-1).kernel.numpy(), before)  # dense trained


def test_filter_freq_zero_disables_the_filter():
    layer = ev(filter_option=kre.CounterFilter(0))
    layer(np.array([1, 2, 3]), training=True)
    assert layer.table_size() == 3 and layer.table.stats()["filtered"] == 0


# -- counting Bloom filter ----------------------------------------------------------

def test_bloom_filter_false_positive_rate_and_memory():
    n, p = 20_000, 0.01
    layer = ev(filter_option=kre.CBFFilter(2, n, p, "uint16"))
    seen = np.arange(n, dtype=np.int64) * 7919
    layer(seen, training=True)  # each once: none admitted but false positives
    stats = layer.table.stats()
    assert stats["filtered"] == 0  # a Bloom filter keeps no index entries for them
    first = stats["size"]
    # A fresh key is admitted on first sight only if all its counters are
    # already set: the false-positive rate at (about) the design load n,
    # since the probes themselves add a tenth to the load.
    fresh = np.arange(n, n + n // 10, dtype=np.int64) * 7919 + 3
    layer(fresh, training=True)
    rate = (layer.table_size() - first) / len(fresh)
    assert 0.4 * p < rate < 2.5 * p, rate
    # The counters cost bytes per expected key, far less than rows.
    m, k, b = kre.CBFFilter(2, n, p, "uint16").sizing()
    assert (m, k, b) == (191702, 7, 2)
    no_filter = ev(name="plain")
    no_filter(seen, training=True)
    assert layer.table.memory_bytes() < no_filter.table.memory_bytes()
    layer(seen, training=True)  # second sighting admits (nearly) all
    assert layer.table_size() >= n


# -- eviction -------------------------------------------------------------------

def test_global_step_evict_on_save_and_on_demand(saving_round_trip):
    layer = ev(evict_option=kre.GlobalStepEvict(steps_to_live=2))
    model = model_with(layer)
    y = np.ones((1, 1))
    model.fit(np.array([[1, 2]]), y, verbose=0)           # step 0
    for step in range(1, 6):
        model.fit(np.array([[1, 10 + step]]), y, verbose=0)
    assert layer.table_size() == 7
    loaded = saving_round_trip(model)                      # evicts keys idle > 2 steps
    assert sorted(layer.export()["keys"].tolist()) == [1, 13, 14, 15]
    assert sorted(loaded.layers[1].export()["keys"].tolist()) == [1, 13, 14, 15]
    assert layer.evict(step=8) == 4 and layer.export()["keys"].tolist() == []
    assert layer.evict() == 0


def test_l2_weight_evict():
    layer = ev(evict_option=kre.L2WeightEvict(0.5))
    layer.build()
    layer.import_({"keys": np.array([1, 2, 3]),
                   "values": np.array([[0.1] * DIM, [1.0] * DIM, [0.2] * DIM], np.float32)})
    assert layer.evict() == 2
    assert layer.export()["keys"].tolist() == [2]


# -- metadata -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, tracked", [
    ({}, False),
    ({"track_meta": True}, True),
    ({"filter_option": kre.CounterFilter(1)}, "capped"),
    ({"filter_option": kre.CounterFilter(1), "record_freq": True}, True),
    ({"evict_option": kre.L2WeightEvict(0.0)}, True),
])
def test_frequencies_and_versions_tracked_when_needed(kwargs, tracked):
    layer = ev(**kwargs)
    model = model_with(layer)
    model.fit(np.array([[5, 5], [5, 6]]), np.ones((2, 1)), batch_size=2, verbose=0)
    model.fit(np.array([[5, 6]]), np.ones((1, 1)), verbose=0)
    data = layer.export()
    freqs = dict(zip(data["keys"].tolist(), data["freqs"].tolist()))
    versions = dict(zip(data["keys"].tolist(), data["versions"].tolist()))
    if tracked == "capped":  # a filter's admitted keys report filter_freq
        assert freqs == {5: 1, 6: 1} and versions == {5: 1, 6: 1}
    elif tracked:
        assert freqs == {5: 4, 6: 2} and versions == {5: 1, 6: 1}
    else:
        assert freqs == {5: 0, 6: 0} and versions == {5: 0, 6: 0}


def test_track_meta_false_conflicts():
    with pytest.raises(ValueError, match="track_meta=False"):
        kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(2), track_meta=False)
    with pytest.raises(ValueError, match="track_meta=False"):
        kre.EmbeddingVariableOption(evict_option=kre.GlobalStepEvict(2), track_meta=False)


# -- checkpoint parts ---------------------------------------------------------------

def trained_with_filter(threshold=3):
    layer = ev(filter_option=kre.CounterFilter(threshold))
    model = model_with(layer)
    x = np.array([[1, 1], [1, 2], [3, 2]])  # 1 seen 3x (admitted), 2 seen 2x, 3 once
    model.fit(x, np.ones((3, 1)), batch_size=3, verbose=0)
    return model, layer


def filtered(layer):
    data = layer.export()
    return dict(zip(data["keys_filtered"].tolist(), data["freqs_filtered"].tolist()))


def test_keras_save_keeps_filtered_counts_and_new_thresholds_apply(tmp_path):
    model, layer = trained_with_filter(3)
    assert layer.export()["keys"].tolist() == [1] and filtered(layer) == {2: 2, 3: 1}
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    # A model with a lower threshold: counts carry over, admitted ids stay.
    low = ev(filter_option=kre.CounterFilter(2))
    model_low = model_with(low)
    model_low.load_weights(path)
    assert low.export()["keys"].tolist() == [1] and filtered(low) == {2: 2, 3: 1}
    low(np.array([3]), training=True)          # 3 reaches 2 -> admitted
    low(np.array([2]), training=True)          # 2 had reached it -> admitted now
    assert sorted(low.export()["keys"].tolist()) == [1, 2, 3] and filtered(low) == {}
    # A higher threshold: admitted id 1 stays admitted despite its count.
    high = ev(filter_option=kre.CounterFilter(100))
    model_with(high).load_weights(path)
    assert high.export()["keys"].tolist() == [1]
    np.testing.assert_array_equal(row(high, 1), row(layer, 1))


def test_checkpoint_carries_deeprec_parts(tmp_path):
    model, layer = trained_with_filter(3)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    for part in ("keys", "values", "freqs", "versions", "keys_filtered", "freqs_filtered",
                 "versions_filtered"):
        assert any(n.endswith(f"/{part}") or n.endswith(f"{part}/.ATTRIBUTES/VARIABLE_VALUE")
                   or f"/{part}" in n for n in names), (part, names)
    fresh_model, fresh = trained_with_filter(3)
    fresh.import_({"keys": np.zeros(0, np.int64), "values": np.zeros((0, DIM), np.float32)})
    tf.train.Checkpoint(model=fresh_model).restore(path)
    assert filtered(fresh) == {2: 2, 3: 1} and fresh.export()["keys"].tolist() == [1]


@pytest.mark.parametrize("how", ["option", "env"])
def test_save_filtered_can_be_turned_off(saving_round_trip, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("KRE_EV_SAVE_FILTERED_FEATURES", "false")
        model, layer = trained_with_filter(3)
    else:
        layer = ev(filter_option=kre.CounterFilter(3), save_filtered=False)
        model = model_with(layer)
        model.fit(np.array([[1, 1], [1, 2], [3, 2]]), np.ones((3, 1)), batch_size=3, verbose=0)
    loaded = saving_round_trip(model)
    assert filtered(loaded.layers[1]) == {} and loaded.layers[1].export()["keys"].tolist() == [1]
    assert filtered(layer) == {2: 2, 3: 1}  # saving did not drop them from the live table


def test_checkpoint_saved_without_filter_loads_into_filtered_model(tmp_path):
    plain = ev()
    model = model_with(plain)
    model.fit(np.array([[1, 2]]), np.ones((1, 1)), verbose=0)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    weights = str(tmp_path / "w.weights.h5")
    model.save_weights(weights)
    for restore in ("checkpoint", "weights"):
        layer = ev(filter_option=kre.CounterFilter(5))
        target = model_with(layer)
        target.build((None, 2))
        if restore == "checkpoint":
            tf.train.Checkpoint(model=target).restore(path).assert_existing_objects_matched()
        else:
            target.load_weights(weights)
        assert sorted(layer.export()["keys"].tolist()) == [1, 2]
        np.testing.assert_array_equal(target.predict(np.array([[1, 2]]), verbose=0),
                                      model.predict(np.array([[1, 2]]), verbose=0))
