"""The raw table ops (`backend/tensorflow/ops.py`) and the EmbeddingTable
resource (`backend/tensorflow/variables.py`), against NumPy."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.optimizers.rules import RULES
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable, complete_parts

DIM = 4


def make_table(key_dtype="int64", dvd=5, num_shards=4):
    defaults = np.arange(dvd * DIM, dtype=np.float32).reshape(dvd, DIM)
    return EmbeddingTable(DIM, key_dtype, defaults, num_shards=num_shards), defaults


def default_rows(keys, defaults):
    return defaults[np.mod(np.asarray(keys, np.int64), defaults.shape[0])]


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
def test_lookup_inserts_with_ev_initializer_rows(key_dtype):
    table, defaults = make_table(key_dtype)
    big = 2**40 + 3 if key_dtype == "int64" else 2**30 + 3
    keys = np.array([[7, -3, big], [7, 0, 12]], key_dtype)
    rows = table.lookup(tf.constant(keys), insert=True).numpy()
    assert rows.shape == (2, 3, DIM)
    np.testing.assert_array_equal(rows, default_rows(keys, defaults))
    assert table.size() == 5  # 7 appears twice
    exported = table.export()
    freq = dict(zip(exported["keys"].tolist(), exported["freqs"].tolist()))
    assert freq == {7: 2, -3: 1, big: 1, 0: 1, 12: 1}


def test_lookup_without_insert_reads_defaults_and_leaves_table_alone():
    table, defaults = make_table()
    table.lookup(tf.constant([1, 2], tf.int64), insert=True)
    rows = table.lookup(tf.constant([2, 10**15], tf.int64), insert=False).numpy()
    np.testing.assert_array_equal(rows, default_rows([2, 10**15], defaults))
    assert table.size() == 2
    freqs = table.export()["freqs"]
    assert sorted(freqs.tolist()) == [1, 1]  # inference does not count


def test_table_grows_by_exactly_the_new_unique_keys():
    table, _ = make_table(num_shards=8)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(5):
        batch = rng.integers(0, 5000, size=3000) * 10**9
        table.lookup(tf.constant(batch), insert=True)
        seen |= set(batch.tolist())
        assert table.size() == len(seen)
    assert set(table.export()["keys"].tolist()) == seen


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
def test_batch_order_and_partitioned_lookups_match_a_dict(key_dtype):
    """Batches of >= 4 ids per shard take the batch-order lookup
    (kv::Table::LookupOrdered), smaller ones the partitioned one; both must
    read and count exactly as a dict from key to row and frequency."""
    table, defaults = make_table(key_dtype, num_shards=4)
    rng = np.random.default_rng(7)
    rows, freqs = {}, {}
    lookups = hits = 0
    for step, size in enumerate([500, 3, 4000, 15, 16, 700, 1]):
        batch = rng.integers(-300, 1500, size=size).astype(key_dtype)
        insert = step % 3 != 2
        got = table.lookup(tf.constant(batch), insert=insert).numpy()
        want = np.stack([rows.get(k, default_rows([k], defaults)[0]) for k in batch.tolist()])
        np.testing.assert_array_equal(got, want)
        for k in batch.tolist():
            lookups += 1
            hits += k in rows
            if insert:
                rows.setdefault(k, default_rows([k], defaults)[0])
                freqs[k] = freqs.get(k, 0) + 1
        if step == 2:  # new values, so rows differ from the defaults
            data = table.export()
            data["values"] = rng.normal(size=data["values"].shape).astype(np.float32)
            data["freqs"] = np.full_like(data["freqs"], -1)  # keep the counts
            table.import_(data, clear=False)
            rows = dict(zip(data["keys"].tolist(), data["values"]))
    exported = table.export()
    assert dict(zip(exported["keys"].tolist(), exported["freqs"].tolist())) == freqs
    counters = table.counters()
    assert (counters["lookups"], counters["hits"]) == (lookups, hits)


def test_empty_and_scalar_keys():
    table, defaults = make_table()
    empty = table.lookup(tf.zeros([0, 3], tf.int64), insert=True)
    assert empty.shape == (0, 3, DIM)
    scalar = table.lookup(tf.constant(9, tf.int64), insert=True).numpy()
    np.testing.assert_array_equal(scalar, defaults[9 % 5])


def test_export_import_round_trip_with_slots():
    table, _ = make_table()
    table.lookup(tf.constant([3, 1, 4, 1, 5], tf.int64), insert=True)
    table.add_slot("accumulator", 0.1)
    table.add_slot("beta_power", 0.9, width=1)
    data = table.export()
    assert set(data["slots"]) == {"accumulator", "beta_power"}
    assert data["slots"]["beta_power"].shape == (4, 1)
    np.testing.assert_allclose(data["slots"]["accumulator"], 0.1)
    data["values"] = data["values"] * -2.0
    data["slots"]["accumulator"] = (data["slots"]["accumulator"] + data["keys"][:, None]).astype(np.float32)
    other, _ = make_table(num_shards=2)
    other.import_(data)
    back = other.export()
    order = np.argsort(back["keys"])
    src = np.argsort(data["keys"])
    np.testing.assert_array_equal(back["keys"][order], data["keys"][src])
    np.testing.assert_array_equal(back["values"][order], data["values"][src])
    np.testing.assert_array_equal(back["freqs"][order], data["freqs"][src])
    for name in data["slots"]:
        np.testing.assert_array_equal(back["slots"][name][order], data["slots"][name][src])


def test_import_rejects_bad_data():
    table, _ = make_table()
    with pytest.raises(ValueError, match="keys"):
        table.import_({"values": np.zeros((1, DIM))})
    with pytest.raises(ValueError, match=r"values.*shape \(2, 4\)"):
        table.import_({"keys": np.array([1, 2]), "values": np.zeros((2, 3))})
    with pytest.raises(TypeError, match="integers"):
        table.import_({"keys": np.array([1.5]), "values": np.zeros((1, DIM))})


def _apply(table, keys, grads, rule, hyper, slots, step=1):
    spec = RULES[rule]  # values given in the kernel's order; checked by name
    ordered = spec.ordered(dict(zip(spec.hparam_names, hyper)))
    return _ops.sparse_apply(table.handle, tf.constant(keys, tf.int64),
                             tf.constant(grads, tf.float32), rule,
                             dict(zip(spec.hparam_names, ordered)), step, slots)


def test_sparse_apply_adagrad_matches_numpy_with_duplicate_keys():
    table, defaults = make_table()
    keys = np.array([2, 9, 2, 2, 11])
    table.lookup(tf.constant(keys), insert=True)
    table.add_slot("accumulator", 0.1)
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(5, DIM)).astype(np.float32)
    lr, eps = 0.3, 1e-7
    _apply(table, keys, grads, "adagrad", [lr, 0.0, eps], ["accumulator"], step=42)
    data = table.export()
    for k in (2, 9, 11):
        g = grads[keys == k].sum(axis=0)
        acc = 0.1 + g * g
        expect = defaults[k % 5] - lr * g / np.sqrt(acc + eps)
        i = list(data["keys"]).index(k)
        np.testing.assert_allclose(data["values"][i], expect, rtol=1e-6)
        np.testing.assert_allclose(data["slots"]["accumulator"][i], acc, rtol=1e-6)
        assert data["versions"][i] == 42


def test_sparse_apply_ftrl_matches_numpy():
    table, defaults = make_table()
    keys = np.array([1, 1, 3])
    table.lookup(tf.constant(keys), insert=True)
    table.add_slot("accumulator", 0.1)
    table.add_slot("linear", 0.0)
    grads = np.array([[0.5, -1, 2, 0], [1, 1, -1, 3], [0.2, 0.2, 0.2, 0.2]], np.float32)
    lr, p, l1, l2, shr = 0.1, -0.5, 0.01, 0.02, 0.03
    _apply(table, keys, grads, "ftrl", [lr, 0.0, p, l1, l2, shr], ["accumulator", "linear"])
    data = table.export()
    for k in (1, 3):
        g = grads[keys == k].sum(axis=0)
        var = defaults[k % 5].astype(np.float64)
        acc = np.full(DIM, 0.1)
        new_acc = acc + g * g
        linear = (g + 2 * shr * var) - (new_acc ** -p - acc ** -p) / lr * var
        quad = new_acc ** -p / lr + 2 * l2
        expect = (np.clip(linear, -l1, l1) - linear) / quad
        i = list(data["keys"]).index(k)
        np.testing.assert_allclose(data["values"][i], expect, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(data["slots"]["linear"][i], linear, rtol=1e-5, atol=1e-6)


def test_sparse_apply_inserts_missing_keys_and_applies_weight_decay():
    table, defaults = make_table()
    _apply(table, [8], np.ones((1, DIM)), "sgd", [0.5, 0.1], [])
    np.testing.assert_allclose(table.export()["values"][0],
                               defaults[8 % 5] * (1 - 0.1) - 0.5, rtol=1e-6)


def test_kernels_reject_bad_inputs_with_invalid_argument():
    table, _ = make_table()
    with pytest.raises(tf.errors.InvalidArgumentError, match="key dtype int64.*int32"):
        table.lookup(tf.constant([1], tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="grads`? must be"):
        _apply(table, [1, 2], np.ones((3, DIM)), "sgd", [0.1, 0.0], [])
    with pytest.raises(tf.errors.InvalidArgumentError, match="takes 3 hyper"):
        _ops.gen().kre_table_sparse_apply(
            table.handle, tf.constant([1], tf.int64), tf.ones([1, DIM]),
            tf.constant([0.1], tf.float32), tf.constant(0, tf.int64),
            rule="adagrad", slots=["accumulator"],
            hparam_names=["learning_rate", "decay", "epsilon"])
    with pytest.raises(tf.errors.FailedPreconditionError, match="no optimizer slot"):
        _apply(table, [1], np.ones((1, DIM)), "adagrad", [0.1, 0.0, 1e-7], ["accumulator"])
    with pytest.raises(tf.errors.InvalidArgumentError, match="dim 4 but the op expects dim 8"):
        _ops.lookup(table.handle, tf.constant([1], tf.int64), 8, False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="default_values must be"):
        _ops.create_table(tf.zeros([0, DIM]), tf.int64, DIM, 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"num_shards must be in \[1, 65536\]"):
        _ops.create_table(tf.zeros([2, DIM]), tf.int64, DIM, 0)
    table.add_slot("m", 0.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="slot 'm' exists with width"):
        table.add_slot("m", 0.0, width=1)
    def parts(**override):
        return complete_parts({"keys": tf.constant([1], tf.int64), **override}, DIM, tf.int64)

    with pytest.raises(tf.errors.InvalidArgumentError, match="slot_values`? must be"):
        table._import_parts(parts(slot_values=tf.zeros([1, 3]),
                                              slot_names=tf.constant(["m"]),
                                              slot_widths=tf.constant([DIM], tf.int64)))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"default_values`? must be \[rows, 4\]"):
        table._import_parts(parts(default_values=tf.zeros([2, 3])))
    with pytest.raises(tf.errors.InvalidArgumentError, match="freqs_filtered`? must be a vector of length 2"):
        table._import_parts(parts(keys_filtered=tf.zeros([2], tf.int64)))
    with pytest.raises(ValueError, match="hyper-parameters"):
        _apply(table, [1], np.ones((1, DIM)), "sgd", [0.1], [])


def test_gradient_is_indexed_slices_over_keys_eager_and_in_function():
    table, _ = make_table()
    keys = tf.constant([[5, 10**15], [5, 7]], tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(table.lookup(keys, insert=True) * 3.0)
    grad = tape.gradient(loss, table.variable)
    assert isinstance(grad, tf.IndexedSlices)
    np.testing.assert_array_equal(grad.indices.numpy(), [5, 10**15, 5, 7])
    np.testing.assert_array_equal(grad.values.numpy(), np.full((4, DIM), 3.0))

    @tf.function
    def traced(k):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(table.lookup(k, insert=True) ** 2)
        return tape.gradient(loss, table.variable)

    g = traced(tf.constant([1, 2], tf.int64))
    np.testing.assert_array_equal(g.indices.numpy(), [1, 2])
    assert table.size() == 5


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
@pytest.mark.parametrize("filter_freq", [0, 3])
def test_counted_lookup_counts_as_the_lookup_of_every_occurrence(key_dtype, filter_freq):
    # The MultiWorkerMirroredStrategy owner's lookup: each asked key comes
    # with how often it occurred; a key asked by two workers comes twice.
    defaults = np.arange(5 * DIM, dtype=np.float32).reshape(5, DIM)
    counted, repeated = (EmbeddingTable(DIM, key_dtype, defaults, num_shards=4,
                                        filter_freq=filter_freq) for _ in range(2))
    rng = np.random.default_rng(1)
    for step in range(3):
        keys = rng.integers(0, 40, size=30).astype(key_dtype)
        counts = rng.integers(1, 4, size=30).astype(np.int32)
        rows = counted.lookup_counted(tf.constant(keys), tf.constant(counts), insert=True).numpy()
        every = np.repeat(keys, counts)
        rows_every = repeated.lookup(tf.constant(every), insert=True).numpy()
        # Each key reads what the lookup of every occurrence reads for it
        # (the row, or no_permission_value until admitted).
        first = {k: i for i, k in reversed(list(enumerate(every.tolist())))}
        np.testing.assert_array_equal(rows, rows_every[[first[k] for k in keys.tolist()]])
        assert filter_freq or (rows != 0).any()
        a, b = counted.export(), repeated.export()
        for part in ("keys", "keys_filtered"):
            order_a, order_b = np.argsort(a[part]), np.argsort(b[part])
            np.testing.assert_array_equal(a[part][order_a], b[part][order_b])
            freqs = "freqs" if part == "keys" else "freqs_filtered"
            np.testing.assert_array_equal(a[freqs][order_a], b[freqs][order_b])
        assert step or counted.size() < len(set(keys.tolist())) or not filter_freq
        assert 0 < counted.size()
    with tf.GradientTape() as tape:
        out = counted.lookup_counted(tf.constant([3, 8, 3], key_dtype), tf.constant([1, 2, 1]),
                                     insert=True)
        loss = tf.reduce_sum(out * tf.constant([[1.0], [2.0], [3.0]]))
    grad = tape.gradient(loss, counted.variable)
    np.testing.assert_array_equal(grad.indices.numpy(), [3, 8, 3])
    np.testing.assert_array_equal(grad.values.numpy(), [[1.0] * DIM, [2.0] * DIM, [3.0] * DIM])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"counts\[1\] is 0"):
        _ops.lookup_counted(counted.handle, tf.constant([3, 8], key_dtype), tf.constant([1, 0]),
                            DIM, True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="vectors of one length"):
        _ops.gen().kre_table_lookup_counted(counted.handle, tf.constant([3, 8], key_dtype),
                                            tf.constant([1]), dim=DIM, insert=True)


def test_checkpoint_round_trip(tmp_path):
    table, defaults = make_table()
    table.lookup(tf.constant([1, 2, 3], tf.int64), insert=True)
    table.add_slot("accumulator", 0.5)
    path = tf.train.Checkpoint(table=table).save(str(tmp_path / "ckpt"))
    table.lookup(tf.constant([99], tf.int64), insert=True)  # changes after the save
    fresh = EmbeddingTable(DIM, "int64", defaults, num_shards=2)
    tf.train.Checkpoint(table=fresh).restore(path).assert_consumed()
    assert fresh.size() == 3
    data = fresh.export()
    assert sorted(data["keys"].tolist()) == [1, 2, 3]
    np.testing.assert_allclose(data["slots"]["accumulator"], 0.5)


def test_missing_library_and_version_mismatch_messages(tmp_path, monkeypatch):
    load = _ops.gen.__wrapped__
    monkeypatch.setattr(_ops, "_DIR", str(tmp_path))
    with pytest.raises(ImportError, match="missing.*make build"):
        load()
    real = _ops.LIBRARY_NAME
    os.symlink(os.path.join(os.path.dirname(keras_rec_emb.__file__), real), tmp_path / real)
    (tmp_path / "_kre_ops_build.json").write_text(json.dumps({"tensorflow": "2.0.0"}))
    with pytest.raises(ImportError, match=rf"built against TensorFlow 2.0.0, but TensorFlow {tf.__version__}"):
        load()


def test_table_parts_are_declared_once_and_match_the_kernels():
    """`variables.PARTS` is the one list of a table's parts: the export and
    import ops name theirs alike, `export()` returns the non-slot parts plus
    `slots`, and a checkpoint of the table holds exactly these parts."""
    from tensorflow.python.framework import op_def_registry

    from keras_rec_emb.backend.tensorflow import variables

    out = [a.name for a in op_def_registry.get("KRE>TableExport").output_arg]
    into = [a.name for a in op_def_registry.get("KRE>TableImport").input_arg]
    assert out == list(variables.PART_NAMES)
    assert into == ["handle"] + list(variables.PART_NAMES)
    table = EmbeddingTable(DIM, tf.int64, np.zeros((2, DIM), np.float32), name="parts")
    table.add_slot("m")
    table.lookup(tf.constant([5, 6], tf.int64), insert=True)
    data = table.export()
    assert set(data) == set(variables.ARRAY_PARTS) | {"slots"}
    assert list(data["slots"]) == ["m"] and data["slots"]["m"].shape == (2, DIM)
    assert set(table._serialize_to_tensors()) == set(variables.PART_NAMES)
    assert variables.FILTERED_PARTS == ("keys_filtered", "freqs_filtered",
                                        "versions_filtered", "bloom")
    empty = variables.complete_parts({}, DIM, tf.int32)
    assert set(empty) == set(variables.PART_NAMES)
    assert empty["keys"].dtype == tf.int32 and empty["default_values"].shape == (0, DIM)
