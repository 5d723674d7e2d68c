"""callbacks.TableStats and CheckpointCallback, checked against the tables' own export."""

import contextlib
import csv
import io
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
import keras_rec_emb_cli
from tests import _event_files
from tests._callbacks import EachStep, table_model


def test_stats_match_the_tables_export_every_step(tmp_path):
    model, ev = table_model(filter_freq=2, steps_to_live=1)
    stats = kre.callbacks.TableStats(every_n_steps=1, log_dir=str(tmp_path / "tb"))
    evict = kre.callbacks.EvictionCallback(every_n_steps=1)
    # EachStep runs after eviction and stats: all see the same state.
    exports = EachStep(ev.table.export)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append({k: v for k, v in logs.items() if k.startswith("ids_")})

    x = np.array([[1, 2], [1, 3], [1, 2], [4, 5], [1, 6], [1, 7]])
    model.fit(x, np.ones((6, 1)), batch_size=2, verbose=0,
              callbacks=[evict, stats, exports, Record()])
    prev_keys = set()
    for logs, d in zip(seen, exports.values):
        assert logs["ids_size"] == len(d["keys"])
        assert logs["ids_filtered"] == len(d["keys_filtered"])
        keys = set(d["keys"].tolist())
        assert logs["ids_new"] >= len(keys - prev_keys)
        assert logs["ids_evicted"] >= len(prev_keys - keys)
        assert logs["ids_bytes"] == ev.table.stats()["memory_bytes"] or logs["ids_bytes"] > 0
        prev_keys = keys
    # Hit rate, by hand: step 1 looks up 1,2,1,3 with filter 2: 1 is admitted
    # by this lookup (count 2) but found no row before it: 0 hits.
    assert seen[0]["ids_hit_rate"] == 0.0
    # Step 2 (1,2,4,5): key 1 was admitted at step 1 (if not evicted).
    assert 0.0 <= seen[1]["ids_hit_rate"] <= 1.0
    # The TensorBoard scalars: the logged numbers (float32, as
    # tf.summary.scalar writes them) at the optimizer's step, read back by
    # TensorFlow's reader (which checks the records' CRCs) and by
    # tensorboard's protos.
    (name,) = os.listdir(tmp_path / "tb")
    assert name.startswith("events.out.tfevents.")
    read = [(e.step, {v.tag: v.simple_value for v in e.summary.value})
            for e in tf.compat.v1.train.summary_iterator(str(tmp_path / "tb" / name))]
    assert read[0] == (0, {})  # the file version event
    assert read[1:] == _event_files.scalars(str(tmp_path / "tb"))
    assert [step for step, _ in read[1:]] == [1, 2, 3]
    for (_, values), logs in zip(read[1:], seen):
        assert values == {f"tables/{k}": float(np.float32(v)) for k, v in logs.items()}


def test_hit_rate_against_numpy_reference():
    model, ev = table_model(filter_freq=0)
    stats = kre.callbacks.TableStats(every_n_steps=1)
    x = np.array([[1, 2], [3, 4], [1, 9], [2, 3]])
    model.fit(x, np.ones((4, 1)), batch_size=2, verbose=0, shuffle=False, callbacks=[stats])
    # Reference: per occurrence, was the key in the table before it?
    table, hits = set(), 0
    for k in x[2:].reshape(-1):  # the second step
        hits += k in table or k in {1, 2, 3, 4}
        table.add(k)
    assert stats.latest["ids_hit_rate"] == hits / 4
    assert stats.latest["ids_new"] == 1  # key 9
    assert stats.latest["ids_size"] == len(ev.table.export()["keys"]) == 5


def test_stats_in_csv_logger_and_history(tmp_path):
    model, _ = table_model(filter_freq=0)
    path = tmp_path / "log.csv"
    h = model.fit(np.array([[1, 2], [1, 3]]), np.ones((2, 1)), epochs=2, verbose=0,
                  callbacks=[kre.callbacks.TableStats(), keras.callbacks.CSVLogger(str(path))])
    assert h.history["ids_size"] == [3, 3]
    assert h.history["ids_new"] == [3, 0]
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["ids_size"]) for r in rows] == [3, 3]


def test_inspect_reports_the_same_numbers(tmp_path):
    model, ev = table_model(filter_freq=2)
    model.fit(np.array([[1, 2], [1, 3]]), np.ones((2, 1)), verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    # The command's main, which the console script calls (tests/test_cli.py
    # runs the command in a child), here: a child would only add a TensorFlow start.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (keras_rec_emb_cli.main(["inspect", "--json", path]) or 0) == 0
    t = json.loads(out.getvalue())["tables"][0]
    d = ev.table.export()
    assert t["keys"] == len(d["keys"]) and t["filtered"] == len(d["keys_filtered"])
    assert t["total_freq"] == int(d["freqs"].sum())


def test_callbacks_config_round_trip_and_bad_input(tmp_path):
    for cb in (kre.callbacks.TableStats(every_n_steps=3, log_dir=str(tmp_path)),
               kre.callbacks.CheckpointCallback(str(tmp_path), full_every_steps=5,
                                                incremental_every_secs=1.5, keep=3)):
        again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(cb))
        assert type(again) is type(cb) and again.get_config() == cb.get_config()
    with pytest.raises(ValueError, match="every_n_steps=0"):
        kre.callbacks.TableStats(every_n_steps=0)
    with pytest.raises(TypeError, match="in_logs="):
        kre.callbacks.TableStats(in_logs="yes")
    with pytest.raises(ValueError, match="full_every_steps=-1"):
        kre.callbacks.CheckpointCallback(str(tmp_path), full_every_steps=-1)
    with pytest.raises(ValueError, match="keep=0"):
        kre.callbacks.CheckpointCallback(str(tmp_path), keep=0)
    with pytest.raises(TypeError, match="directory="):
        kre.callbacks.CheckpointCallback(None)


def test_checkpoint_callback_chain_restores_the_fitted_state(tmp_path):
    model, ev = table_model(filter_freq=2, steps_to_live=2)
    cb = kre.callbacks.CheckpointCallback(str(tmp_path), full_every_steps=4,
                                          incremental_every_steps=1, keep=2)
    rng = np.random.default_rng(0)
    model.fit(rng.integers(0, 30, (20, 2)), np.ones((20, 1)), batch_size=2, verbose=0,
              callbacks=[cb, kre.callbacks.EvictionCallback(every_n_steps=1)])
    kinds = [p.rsplit("-", 1)[1] for p in cb.saves]
    assert kinds[0] == "full.npz" and "incremental.npz" in kinds
    restored, rev = table_model(filter_freq=2, steps_to_live=2)
    restored.build((None, 2))
    info = kre.callbacks.CheckpointCallback(str(tmp_path)).restore(restored)
    assert info["links"][-1] == cb.saves[-1]
    a, b = ev.table.export(), rev.table.export()
    oa, ob = np.argsort(a["keys"]), np.argsort(b["keys"])
    for k in ("keys", "values", "freqs", "versions"):
        np.testing.assert_array_equal(a[k][oa], b[k][ob])
    np.testing.assert_array_equal(np.sort(a["keys_filtered"]), np.sort(b["keys_filtered"]))
    x = rng.integers(0, 30, (8, 2))
    np.testing.assert_allclose(model.predict(x, verbose=0), restored.predict(x, verbose=0))


def test_first_interval_starts_at_fit_not_at_the_restore(tmp_path):
    """A restore replays admissions and erasures; TableStats counts from fit."""
    model, ev = table_model(filter_freq=None, steps_to_live=1)
    ckpt = kre.IncrementalCheckpointer(model, str(tmp_path))
    model.fit(np.array([[1, 2], [3, 4]]), np.ones((2, 1)), batch_size=1, verbose=0)
    ckpt.save_full()
    ev.evict(5)  # erases all four ids (trained at steps 0 and 1)
    model.fit(np.array([[5, 6]]), np.ones((1, 1)), verbose=0)
    ckpt.save_incremental()

    model2, ev2 = table_model(filter_freq=None, steps_to_live=1)
    kre.IncrementalCheckpointer(model2, str(tmp_path)).restore()
    before = ev2.table.counters()
    assert before["admitted_total"] >= 2 and before["erased_total"] >= 4  # the replay
    assert sorted(ev2.table.export()["keys"].tolist()) == [5, 6]
    stats = kre.callbacks.TableStats(every_n_steps=1)
    h = model2.fit(np.array([[5, 7]]), np.ones((1, 1)), verbose=0, callbacks=[stats])
    # One step: 7 is new, 5 and 6 stay (no eviction ran), 5 was a hit.
    assert h.history["ids_new"] == [1]
    assert h.history["ids_evicted"] == [0]
    assert h.history["ids_size"] == [3]
    assert h.history["ids_hit_rate"] == [0.5]


STATS_OPS = {"KRE>TableStats": "TABLE_STATS", "KRE>TableStorageStats": "STORAGE_STATS",
             "KRE>TableCounters": "COUNTER_PARTS"}


@pytest.mark.parametrize("op", sorted(STATS_OPS))
def test_stats_ops_declare_the_parts_python_reads_them_by(op):
    """Each statistics op names its vector's parts (its `parts` attr, whose
    default is the library's own list) as `_ops` declares them, and its
    kernel refuses any other names or order."""
    from tensorflow.python.framework import op_def_registry

    from keras_rec_emb.backend.tensorflow import ops as _ops

    names = getattr(_ops, STATS_OPS[op])
    (attr,) = [a for a in op_def_registry.get(op).attr if a.name == "parts"]
    assert [p.decode() for p in attr.default_value.list.s] == list(names)
    from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

    table = EmbeddingTable(4, tf.int64, np.zeros((1, 4), np.float32), name="t")
    raw = getattr(_ops.gen(), {"KRE>TableStats": "kre_table_stats",
                               "KRE>TableStorageStats": "kre_table_storage_stats",
                               "KRE>TableCounters": "kre_table_counters"}[op])
    assert raw(table.handle, Tkeys=tf.int64, parts=names).shape == (len(names),)
    for wrong in (names[::-1], names[:-1], names + ("extra",)):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"{op} returns the parts \[{', '.join(names)}\] in this "
                                 rf"order, but was given parts=\[{', '.join(wrong)}\]"):
            raw(table.handle, Tkeys=tf.int64, parts=wrong)


def test_stats_and_counters_are_read_by_name():
    """Each named part holds what its name says, against an independent
    count of the lookups and the table's own export."""
    from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

    table = EmbeddingTable(4, tf.int64, np.zeros((1, 4), np.float32), name="named",
                           filter_freq=2)
    ids = np.array([1, 1, 2, 3, 3, 3, 4], np.int64)
    table.lookup(tf.constant(ids), insert=True)  # 1 and 3 are admitted, 2 and 4 counted
    first = table.counters()
    table.lookup(tf.constant([1, 5], tf.int64), insert=True)  # 1 is a hit, 5 is counted
    exported = table.export()
    stats, counters = table.stats(), table.counters()
    assert stats["size"] == counters["size"] == len(exported["keys"]) == 2
    assert stats["filtered"] == counters["filtered"] == len(exported["keys_filtered"]) == 3
    assert (first["lookups"], counters["lookups"]) == (len(ids), len(ids) + 2)
    assert counters["hits"] - first["hits"] == 1
    assert counters["admitted_total"] == 2 and counters["erased_total"] == 0
    assert stats["rows"] == stats["cached_rows"] == 2 and stats["file_writes"] == 0
    assert stats["memory_bytes"] > stats["cache_memory_bytes"] > 0
    assert table.erase([3]) == 1
    assert table.counters()["erased_total"] == 1 and table.stats()["size"] == 1


def test_a_graph_saved_without_the_parts_attr_still_runs():
    """Graphs written before the stats ops took `parts` (no such attr on
    their nodes) load and run: the attr defaults to the library's list."""
    from keras_rec_emb.backend.tensorflow import ops as _ops

    graph = tf.Graph()
    with graph.as_default():
        handle = _ops.gen().kre_table_create(tf.zeros([1, 4]), key_dtype=tf.int64, dim=4,
                                             num_shards=1)
        with tf.control_dependencies([_ops.gen().kre_table_lookup(
                handle, tf.constant([7, 8], tf.int64), dim=4, insert=True)]):
            _ops.gen().kre_table_stats(handle, Tkeys=tf.int64, parts=_ops.TABLE_STATS,
                                       name="stats")
    graph_def = graph.as_graph_def()
    (node,) = [n for n in graph_def.node if n.op == "KRE>TableStats"]
    del node.attr["parts"]
    old = tf.Graph()
    with old.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=old) as session:
            assert session.run("stats:0").tolist()[:2] == [2, 0]
