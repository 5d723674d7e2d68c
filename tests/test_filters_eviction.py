"""Admission filters, eviction, metadata and DeepRec's checkpoint parts."""

import logging
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from tests._eviction_at_save import eviction_logs, two_table_model
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



def run_bloom_memory_child(spelling, backend):
    """Runs tests/_bloom_memory_child.py; returns its KEY value lines as a dict."""
    child = os.path.join(os.path.dirname(__file__), "_bloom_memory_child.py")
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, child, spelling], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)


@pytest.mark.parametrize("spelling", ["tf.uint64", "tf.int64"])
def test_deeprec_bloom_setting_holds_memory_for_the_counters_written(spelling):
    """CBFFilter(3, max_element_size=2**30, false_positive_probability=0.01),
    what DeepRec's modelzoo passes (counter_type tf.int64; DeepRec's default
    is tf.uint64), sizes 76.7 GiB of counters: the table builds, and 2000
    keys counted four times hold tens of MiB (pages written, not the whole
    filter), admit as an exact counter and a small filter do, and the size
    is warned about. A 2**24 filter (1.2 GiB) costs no more at its first
    lookup."""
    out = run_bloom_memory_child(spelling, "tensorflow")
    assert out["SAME"] == "True" and out["ADMITTED"] == "2000", out
    assert int(out["FULL"]) == 82_335_024_528
    assert out["WARNED"] == str(int(out["FULL"]) > os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")), out
    assert int(out["GROWN"]) < 200 * 2**20, out
    assert int(out["MEMORY"]) < 200 * 2**20, out
    assert int(out["FULL24"]) == 1_286_484_760
    assert int(out["GROWN24"]) < 100 * 2**20, out


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


# -- eviction at save: reported, and optional ------------------------------------
# L2WeightEvict(1.0) at dim 16: trained rows have 0.5 * sum(row**2) far below
# 1.0, so a save evicts every row (issue 56: an ESMM lost all 17 tables).

@pytest.mark.backends("tensorflow", "jax")
def test_default_save_evicts_and_reports_each_table(tmp_path, caplog):
    """DeepRec's rule stays the default: the save evicts, logs each table's
    counts (the tables' real sizes before and after) and warns, naming the
    table, the counts and the opt-outs, for the one that lost over half."""
    caplog.set_level(logging.INFO, logger="keras_rec_emb")
    model, x = two_table_model()
    before = {name: model.get_layer(name).table_size() for name in ("clicks", "items")}
    assert before["clicks"] > 100 and before["items"] > 100
    with pytest.warns(UserWarning) as record:
        kre.save_model(model, tmp_path / "m.keras")
    after = {name: model.get_layer(name).table_size() for name in ("clicks", "items")}
    assert after == {"clicks": 0, "items": before["items"]}
    logs = eviction_logs(caplog)
    for name in ("clicks", "items"):
        assert (f"evicted {before[name] - after[name]} of {before[name]} rows, "
                f"kept {after[name]}.") in logs[name], logs
    assert "L2WeightEvict(l2_weight_threshold=1.0)" in logs["clicks"]
    warned = [str(w.message) for w in record if "Saving evicted" in str(w.message)]
    assert len(warned) == 1, warned
    assert f"Saving evicted {before['clicks']} of the {before['clicks']} rows of table " \
           "'clicks' (0 kept)" in warned[0]
    assert "save_model(model, path, evict=False)" in warned[0]
    assert "L2WeightEvict(..., at_save=False)" in warned[0]
    loaded = kre.load_model(tmp_path / "m.keras")
    assert loaded.get_layer("clicks").table_size() == 0
    assert loaded.get_layer("items").table_size() == before["items"]


@pytest.mark.backends("tensorflow", "jax")
@pytest.mark.parametrize("how", ["save_model", "option"])
def test_saving_without_eviction_keeps_every_row(tmp_path, caplog, how):
    """`save_model(..., evict=False)` for one save, `at_save=False` for one
    table: the table in memory and in the file (and in a tf.train.Checkpoint
    under TensorFlow) keeps every row, predictions do not move, and nothing
    is reported."""
    caplog.set_level(logging.INFO, logger="keras_rec_emb")
    model, x = two_table_model(at_save=how != "option")
    layer = model.get_layer("clicks")
    rows = layer.export()
    predictions = model.predict(x, verbose=0)
    path = tmp_path / "m.keras"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Saving evicted")
        if how == "save_model":
            kre.save_model(model, path, evict=False)
        else:
            model.save(path)
            if keras.config.backend() == "tensorflow":
                import tensorflow as tf

                tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    assert "clicks" not in eviction_logs(caplog)
    np.testing.assert_array_equal(model.predict(x, verbose=0), predictions)
    assert layer.table_size() == len(rows["keys"])
    loaded = kre.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), predictions)
    got = loaded.get_layer("clicks").export()
    assert loaded.get_layer("clicks").ev_option.evict_option.at_save is (how != "option")
    order, want = np.argsort(got["keys"]), np.argsort(rows["keys"])
    np.testing.assert_array_equal(got["keys"][order], rows["keys"][want])
    np.testing.assert_array_equal(got["values"][order], rows["values"][want])
    assert layer.evict() == len(rows["keys"])  # evict() still evicts


@pytest.mark.tensorflow_only  # tf.train.Checkpoint
def test_at_save_false_builds_a_table_that_keeps_its_rows_at_save(tmp_path):
    import tensorflow as tf
    layer = ev(evict_option=kre.L2WeightEvict(0.5, at_save=False))
    model = model_with(layer)
    model.fit(np.array([[1, 2]]), np.ones((1, 1)), verbose=0)
    n = layer.table_size()
    model.save(tmp_path / "m.keras")
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    assert n == 2 and layer.table_size() == n
    assert kre.load_model(tmp_path / "m.keras").layers[1].table_size() == n
    assert layer.evict() == n


@pytest.mark.tensorflow_only  # tf.train.Checkpoint
def test_checkpoint_save_reports_its_eviction(tmp_path, caplog):
    import tensorflow as tf
    caplog.set_level(logging.INFO, logger="keras_rec_emb")
    model, _ = two_table_model()
    n = model.get_layer("clicks").table_size()
    with pytest.warns(UserWarning, match=rf"Saving evicted {n} of the {n} rows of table "
                                         r"'clicks/embeddings'"):
        tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    assert f"evicted {n} of {n} rows, kept 0." in eviction_logs(caplog)["clicks/embeddings"]


def test_at_save_in_the_config_and_its_checks():
    for cls, arg in ((kre.GlobalStepEvict, 5), (kre.L2WeightEvict, 0.5)):
        assert cls(arg).at_save is True
        assert "at_save" not in cls(arg).get_config()  # the config older releases read
        off = cls(arg, at_save=False)
        assert off.get_config()["at_save"] is False
        assert cls.from_config(off.get_config()) == off
        config = keras.saving.serialize_keras_object(kre.EmbeddingVariableOption(
            evict_option=off))
        assert keras.saving.deserialize_keras_object(config).evict_option.at_save is False
        with pytest.raises(TypeError, match=r"`at_save`.*Received: at_save='no'"):
            cls(arg, at_save="no")
    # A config written before `at_save` existed reads as DeepRec's default.
    assert kre.L2WeightEvict.from_config({"l2_weight_threshold": 0.5}).at_save is True
    with pytest.raises(TypeError, match=r"`evict` must be True or False. Received: evict=0"):
        kre.save_model(model_with(ev()), "/tmp/never.keras", evict=0)


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


@pytest.mark.tensorflow_only  # tf.train.Checkpoint
def test_checkpoint_carries_deeprec_parts(tmp_path):
    import tensorflow as tf
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


@pytest.mark.tensorflow_only  # tf.train.Checkpoint
def test_checkpoint_saved_without_filter_loads_into_filtered_model(tmp_path):
    import tensorflow as tf
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
