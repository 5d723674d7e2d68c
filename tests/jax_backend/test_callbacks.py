"""`keras_rec_emb.callbacks` under Keras's JAX backend: `EvictionCallback`
evicts during `fit` with each table's step counter as "now" (the numbers a
NumPy replay of GlobalStepEvict gives), `TableStats` logs what the tables'
export says (in `logs` and as TensorBoard scalars, read back from the event
file), and bad arguments are refused naming them (`CheckpointCallback`:
tests/jax_backend/test_incremental.py)."""

import doctest

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb import callbacks
from tests import _event_files
from tests._callbacks import EachStep, table_model


def _model(steps_to_live=None, filter_freq=None, name="ids"):
    return table_model(name, filter_freq, steps_to_live, width=4, dtype="int32", num_shards=4)


def test_eviction_callback_keeps_the_ids_of_the_last_steps():
    """Each step brings 8 new ids; with steps_to_live=2 and eviction after
    every step, the table holds exactly the ids of the steps a NumPy replay
    of the rule keeps (version > now - steps_to_live)."""
    model, layer = _model(steps_to_live=2)
    callback = kre.callbacks.EvictionCallback(every_n_steps=1, on_epoch_end=False)
    exports = EachStep(layer.export)
    x = np.arange(10 * 8, dtype=np.int32).reshape(20, 4)  # 2 rows a step: 8 new ids
    model.fit(x, np.ones((20, 1)), batch_size=2, shuffle=False, verbose=0,
              callbacks=[callback, exports])
    version = {}  # NumPy replay: each key's last update step
    erased = 0
    for step, export in enumerate(exports.values):
        for key in x[2 * step:2 * step + 2].ravel().tolist():
            version[key] = step
        doomed = [k for k, v in version.items() if v < step - 2]
        erased += len(doomed)
        for key in doomed:
            del version[key]
        assert sorted(export["keys"].tolist()) == sorted(version), step
        np.testing.assert_array_equal(np.sort(export["versions"]),
                                      np.sort([version[k] for k in export["keys"].tolist()]))
    assert callback.evicted == erased == 8 * 7
    assert layer.table_size() == 3 * 8


def test_eviction_callback_at_epoch_end_and_without_an_eviction_option():
    model, layer = _model(steps_to_live=1)
    plain, plain_layer = _model(name="plain")
    x = np.arange(6 * 4, dtype=np.int32).reshape(6, 4)
    callback = kre.callbacks.EvictionCallback()  # epoch ends only
    model.fit(x, np.ones((6, 1)), batch_size=2, shuffle=False, verbose=0, callbacks=[callback])
    # Steps 0, 1, 2: at the end (now = 2) only versions >= 1 stay.
    assert sorted(layer.export()["keys"].tolist()) == list(range(8, 24))
    assert callback.evicted == 8
    other = kre.callbacks.EvictionCallback(every_n_steps=1)
    plain.fit(x, np.ones((6, 1)), batch_size=2, verbose=0, callbacks=[other])
    assert other.evicted == 0 and plain_layer.table_size() == 24


def test_eviction_callback_config_and_bad_arguments():
    cb = kre.callbacks.EvictionCallback(5, False)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(cb))
    assert isinstance(again, kre.callbacks.EvictionCallback)
    assert again.get_config() == {"every_n_steps": 5, "on_epoch_end": False}
    with pytest.raises(ValueError, match="`every_n_steps` must be a positive integer or None. "
                                         "Received: every_n_steps=0"):
        kre.callbacks.EvictionCallback(every_n_steps=0)
    with pytest.raises(TypeError, match="on_epoch_end"):
        kre.callbacks.EvictionCallback(on_epoch_end="yes")


def test_table_stats_match_the_tables_export_every_step():
    model, layer = _model(steps_to_live=1, filter_freq=2)
    stats = kre.callbacks.TableStats(every_n_steps=1)
    evict = kre.callbacks.EvictionCallback(every_n_steps=1)
    exports = EachStep(layer.export)  # after eviction and stats: the same state
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append({k: v for k, v in logs.items() if k.startswith("ids_")})

    x = np.array([[1, 2, 1, 3], [1, 2, 4, 5], [1, 6, 1, 7], [8, 8, 8, 8]], np.int32)
    model.fit(x, np.ones((4, 1)), batch_size=1, shuffle=False, verbose=0,
              callbacks=[evict, stats, exports, Record()])
    assert len(seen) == len(exports.values) == 4
    counts, admitted = {}, set()
    prev_keys = prev_counted = set()
    for step, (logs, d) in enumerate(zip(seen, exports.values)):
        # NumPy: a key is admitted at its 2nd occurrence; an occurrence hits
        # when its key was admitted before the batch (one admitted within
        # the batch reads its row from the next batch on).
        before = set(admitted)
        hits = sum(key in before for key in x[step].tolist())
        for key in x[step].tolist():
            counts[key] = counts.get(key, 0) + 1
            if counts[key] >= 2:
                admitted.add(key)
        lookups = 4
        keys = set(d["keys"].tolist())
        counted = keys | set(d["keys_filtered"].tolist())  # admitted or counted
        assert logs["ids_size"] == len(keys), step
        assert logs["ids_filtered"] == len(d["keys_filtered"]), step
        assert logs["ids_new"] == len(keys - prev_keys), step
        # (No key comes back here once erased, so erased = gone from both.)
        assert logs["ids_evicted"] == len(prev_counted - counted), step
        assert logs["ids_hit_rate"] == pytest.approx(hits / lookups), step
        assert logs["ids_bytes"] == layer.stats()["memory_bytes"] or step < 3
        prev_keys, prev_counted = keys, counted
    assert stats.latest["ids_size"] == layer.table_size()


def test_table_stats_in_history_at_epoch_ends():
    model, layer = _model()
    h = model.fit(np.array([[1, 2, 1, 3]], np.int32), np.ones((1, 1)), epochs=2, verbose=0,
                  callbacks=[kre.callbacks.TableStats(every_n_steps=None)])
    assert h.history["ids_size"] == [3, 3]
    assert h.history["ids_new"] == [3, 0]
    assert h.history["ids_hit_rate"] == [0.25, 1.0]


def test_table_stats_write_the_logged_numbers_as_tensorboard_scalars(tmp_path):
    model, layer = _model(filter_freq=2)
    stats = kre.callbacks.TableStats(every_n_steps=1, log_dir=str(tmp_path / "tb"))
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            seen.append((step, {f"tables/{k}": v for k, v in logs.items()
                                if k.startswith("ids_")}))

    x = np.array([[1, 2, 1, 3], [1, 2, 4, 5], [6, 6, 7, 2]], np.int32)
    model.fit(x, np.ones((3, 1)), batch_size=1, shuffle=False, verbose=0,
              callbacks=[stats, Record()])
    written = _event_files.scalars(str(tmp_path / "tb"))
    assert [step for step, _ in written] == [1, 2, 3]
    assert len(seen) == 3 and seen[-1][1]["tables/ids_size"] == layer.table_size()
    for (step, values), (logged_step, logged) in zip(written, seen):
        assert step == logged_step and sorted(values) == sorted(logged) and len(values) == 6
        for tag, value in logged.items():  # float32 in the file, as tf.summary.scalar
            assert values[tag] == np.float32(value), (step, tag)
    assert stats._writer is None  # closed when fit ends
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(stats))
    assert again.get_config() == stats.get_config()


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"`log_dir` must be a path or None. Received: "
                                        r"log_dir=3"):
        kre.callbacks.TableStats(log_dir=3)
    assert sorted(dir(callbacks)) == ["CheckpointCallback", "EvictionCallback", "TableStats"]
    with pytest.raises(ValueError, match="`every_n_steps` must be a positive integer"):
        kre.callbacks.TableStats(every_n_steps=0)


@pytest.mark.parametrize("name", ["EvictionCallback", "TableStats", "CheckpointCallback"])
def test_the_docstring_examples_run(name):
    cls = getattr(kre.callbacks, name)
    test = doctest.DocTestFinder().find(cls, name, globs={"keras": keras, "np": np,
                                                          "keras_rec_emb": kre})[0]
    assert test.examples
    result = doctest.DocTestRunner().run(test, out=lambda text: None)
    assert result.failed == 0
