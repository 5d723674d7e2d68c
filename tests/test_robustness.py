"""Inputs and states that used to give a wrong answer (or an unloadable
file) with no error now give the right one or a clear error."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding


# -- 1. every empty part of a table round-trips ------------------------------------
def _filtered_model(filter_option):
    opt = kre.EmbeddingVariableOption(filter_option=filter_option)
    a = EmbeddingVariable(4, ev_option=opt, name="filtered")
    b = EmbeddingVariable(4, ev_option=opt, name="grouped")
    ids = keras.Input((1,), dtype="int64", name="ids")
    g = GroupEmbedding({"g": FeatureSpec(b)}, output_mode="concat", name="group")
    h = keras.layers.Concatenate()([keras.layers.Flatten()(a(ids)), g({"g": ids})])
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


@pytest.mark.parametrize("filter_option", [
    kre.CounterFilter(3),
    kre.CBFFilter(3, max_element_size=100, false_positive_probability=0.01),
], ids=["counter", "cbf"])
def test_table_that_admitted_nothing_saves_and_loads(tmp_path, filter_option):
    model = _filtered_model(filter_option)
    x = np.arange(10).reshape(10, 1)
    model.fit(x, np.zeros((10, 1)), batch_size=10, verbose=0)  # every id seen once
    for name in ("filtered", "grouped"):
        table = model.get_layer(name) if name == "filtered" else model.get_layer(
            "group").tables[0]
        assert table.table_size() == 0
        assert table.export()["slots"]["accumulator"].shape == (0, 4)
    path = str(tmp_path / "m.keras")
    kre.save_model(model, path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    before, after = model.get_layer("filtered").export(), loaded.get_layer("filtered").export()
    assert after["values"].shape == (0, 4)
    assert after["slots"]["accumulator"].shape == (0, 4)
    for part in ("keys_filtered", "freqs_filtered", "bloom", "default_values"):
        np.testing.assert_array_equal(after[part], before[part])
    # Training goes on: a third sighting admits the ids in both models alike.
    model.fit(x, np.zeros((10, 1)), batch_size=10, verbose=0)
    loaded.fit(x, np.zeros((10, 1)), batch_size=10, verbose=0)
    model.fit(x, np.zeros((10, 1)), batch_size=10, verbose=0)
    loaded.fit(x, np.zeros((10, 1)), batch_size=10, verbose=0)
    assert loaded.get_layer("filtered").table_size() == 10
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)


def test_empty_table_round_trips_through_checkpoint_and_import(tmp_path):
    layer = EmbeddingVariable(3, name="empty")
    layer.build()
    layer.table.add_slot("m", width=5)
    ckpt = tf.train.Checkpoint(t=layer.table)
    path = ckpt.write(str(tmp_path / "ckpt"))
    ckpt.read(path).assert_consumed()
    assert layer.export()["slots"]["m"].shape == (0, 5)
    layer.import_(layer.export())
    assert layer.export()["slots"]["m"].shape == (0, 5)
    assert layer.table_size() == 0


# -- 2. tf.SparseTensor ids in any index order; rows outside dense_shape --------------
TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)
SHUFFLED = ([[1, 0], [0, 0], [1, 1]], [1, 2, 3])  # row 0: [2]; row 1: [1, 3]


def _sp(indices, values, shape=(2, 2), dtype=tf.int64):
    return tf.SparseTensor(tf.constant(indices, tf.int64), tf.constant(values, dtype), shape)


def _reference(indices, values, weights=None, combiner="sum", rows=2):
    """NumPy: combine TABLE rows of `values` per row index."""
    out = np.zeros((rows, 4), np.float32)
    wsum = np.zeros(rows)
    for k, ((r, _), v) in enumerate(zip(indices, values)):
        w = 1.0 if weights is None else weights[k]
        out[r] += w * TABLE[v]
        wsum[r] += w
    return out / np.maximum(wsum, 1e-30)[:, None] if combiner == "mean" else out


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_sparse_ids_out_of_order_combine_into_their_own_rows(combiner):
    matrix = keras.Variable(TABLE)
    sp = _sp(*SHUFFLED)
    expected = _reference(*SHUFFLED, combiner=combiner)
    np.testing.assert_allclose(expected[0], TABLE[2])  # the reference itself
    got = kre.ops.embedding_lookup_sparse(matrix, sp, combiner=combiner).numpy()
    np.testing.assert_allclose(got, expected)
    # Traced too, and with weights reordered alike.
    weights = [0.5, 2.0, 3.0]
    sp_w = tf.SparseTensor(sp.indices, tf.constant(weights), sp.dense_shape)
    fn = tf.function(lambda i, w: kre.ops.embedding_lookup_sparse(
        matrix, i, sp_weights=w, combiner=combiner))
    np.testing.assert_allclose(fn(sp, sp_w).numpy(),
                               _reference(*SHUFFLED, weights, combiner=combiner), rtol=1e-6)


def test_sparse_ids_out_of_order_in_group_embedding_and_tables():
    table = EmbeddingVariable(4, name="t", initializer=keras.initializers.Constant(0.0))
    table.build()
    table.import_({"keys": np.arange(10), "values": TABLE})
    group = GroupEmbedding({"f": FeatureSpec(table, combiner="sum")})
    expected = _reference(*SHUFFLED)
    np.testing.assert_allclose(group({"f": _sp(*SHUFFLED)})["f"].numpy(), expected)
    summed = EmbeddingVariable(4, combiner="sum", name="s")
    summed.build()
    summed.import_({"keys": np.arange(10), "values": TABLE})
    np.testing.assert_allclose(summed(_sp(*SHUFFLED)).numpy(), expected)


@pytest.mark.parametrize("row", [-1, 2])
def test_sparse_row_index_outside_dense_shape_is_an_error(row):
    table = EmbeddingVariable(4, name="t")
    table.build()
    sp = _sp([[0, 0], [row, 0]], [7, 8])
    with pytest.raises(ValueError, match=r"sp_ids\[0\].*row indices outside \[0, 2\)"):
        kre.ops.embedding_lookup_sparse(table, sp, combiner="sum", training=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sp_ids"):
        tf.function(lambda s: kre.ops.embedding_lookup_sparse(
            table, s, combiner="sum", training=True))(sp)
    layer = EmbeddingVariable(4, combiner="sum", name="ev")
    with pytest.raises(ValueError, match="'ev' ids has row indices outside"):
        layer(sp, training=True)
    assert table.table_size() == 0 and layer.table_size() == 0  # nothing inserted


# -- 3. int64 ids never wrap onto int32 keys -------------------------------------------------
def test_int32_table_refuses_ids_outside_int32():
    layer = EmbeddingVariable(2, key_dtype="int32", name="small")
    ids = np.array([5, 2**32 + 5], np.int64)
    with pytest.raises(ValueError, match=r"'small'.*int32 key range.*4294967301"):
        layer(ids, training=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="int32 key range"):
        tf.function(lambda x: layer(x, training=True))(tf.constant(ids))
    with pytest.raises(ValueError, match=r"sp_ids\[0\].*int32 key range"):
        kre.ops.embedding_lookup_sparse(layer, tf.ragged.constant([[5, 2**32 + 5]],
                                                                  tf.int64), training=True)
    with pytest.raises(ValueError, match=r"ids\[0\].*int32 key range"):
        kre.ops.embedding_lookup(layer, ids, training=True)
    with pytest.raises(ValueError, match=r"`keys` of table 'small/embeddings'.*int32 key range"):
        layer.import_({"keys": ids, "values": np.ones((2, 2))})
    with pytest.raises(ValueError, match=r"`keys_filtered`.*int32 key range"):
        layer.import_({"keys": ids[:1], "values": np.ones((1, 2)),
                       "keys_filtered": [-(2**31) - 1]})
    assert layer.table_size() == 0
    # In range, int64 ids still work (cast), and distinct ids stay distinct.
    out = layer(np.array([5, 2**31 - 1, -(2**31)], np.int64), training=True)
    assert out.shape == (3, 2) and layer.table_size() == 3


# -- 4. dense [B, 0] ids with a combiner give zeros ---------------------------------------
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_empty_dense_rows_combine_to_zeros(combiner):
    empty = np.zeros((3, 0), np.int64)
    layer = EmbeddingVariable(4, combiner=combiner)
    np.testing.assert_array_equal(layer(empty).numpy(), np.zeros((3, 4)))
    hashed = kre.layers.MultiHashEmbedding(100, 4, combiner=combiner)
    np.testing.assert_array_equal(hashed(empty).numpy(), np.zeros((3, 4)))
    # A non-empty row still divides by its length.
    layer.build()
    layer.import_({"keys": [1, 2], "values": [[1, 1, 1, 1], [3, 3, 3, 3]]})
    got = layer(np.array([[1, 2]])).numpy()
    want = {"sum": 4.0, "mean": 2.0, "sqrtn": 4 / np.sqrt(2)}[combiner]
    np.testing.assert_allclose(got, np.full((1, 4), want), rtol=1e-6)


# -- 8. invalid arguments are refused at every entry point ---------------------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make, error, match", [
    (lambda: kre.L2WeightEvict(NAN), ValueError, r"l2_weight_threshold.*finite.*nan"),
    (lambda: kre.L2WeightEvict(INF), ValueError, r"l2_weight_threshold.*finite.*inf"),
    (lambda: kre.L2WeightEvict(-1e-3), ValueError, r"l2_weight_threshold"),
    (lambda: kre.InitializerOption(default_value_no_permission=NAN), ValueError,
     r"default_value_no_permission.*finite.*nan"),
    (lambda: kre.InitializerOption(default_value_no_permission="0"), TypeError,
     r"default_value_no_permission"),
    (lambda: kre.CounterFilter(2**70), ValueError, r"filter_freq.*\[0, 9223372036854775807\]"),
    (lambda: kre.CounterFilter(1.5), TypeError, r"filter_freq.*1\.5"),
    (lambda: kre.GlobalStepEvict(2**64), ValueError, r"steps_to_live"),
    (lambda: kre.CBFFilter(256, 100, 0.01, counter_type="uint8"), ValueError,
     r"filter_freq.*\[0, 255\].*256"),
    (lambda: kre.CBFFilter(3, 100, NAN), ValueError, r"false_positive_probability.*nan"),
    (lambda: FeatureSpec({"embedding_dim": 4}, max_norm=INF), ValueError, r"max_norm.*inf"),
    (lambda: FeatureSpec({"embedding_dim": 4}, default_id=1.5), TypeError, r"default_id=1.5"),
])
def test_options_refuse_non_finite_and_out_of_range(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_cbf_filter_at_counter_maximum_is_accepted():
    assert kre.CBFFilter(255, 100, 0.01, counter_type="uint8").filter_freq == 255


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam", "Ftrl", "AdamAsync",
                                  "AdagradDecay"])
@pytest.mark.parametrize("lr", [-1.0, NAN, INF])
def test_optimizers_refuse_bad_learning_rates(name, lr):
    cls = getattr(kre.optimizers, name)
    with pytest.raises(ValueError, match=r"`learning_rate` must be.*Received: learning_rate="):
        cls(learning_rate=lr)
    with pytest.raises(ValueError, match="learning_rate"):
        cls(lr)  # positionally too


def test_optimizers_refuse_bad_hyper_parameters_and_keep_good_ones():
    with pytest.raises(ValueError, match=r"beta_1.*\[0, 1\).*1\.5"):
        kre.optimizers.Adam(0.1, beta_1=1.5)
    with pytest.raises(ValueError, match=r"epsilon.*nan"):
        kre.optimizers.Adagrad(0.1, epsilon=NAN)
    with pytest.raises(ValueError, match=r"momentum.*-0\.5"):
        kre.optimizers.SGD(0.1, momentum=-0.5)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    assert kre.optimizers.Adam(schedule).get_config()["learning_rate"]["class_name"] == \
        "ExponentialDecay"
    assert float(kre.optimizers.SGD(0.0).learning_rate) == 0.0  # a frozen model is allowed


def _ops_table():
    table = EmbeddingVariable(4, name="t")
    table.build()
    return table


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_norm=-1.0), ValueError, r"max_norm.*-1\.0"),
    (dict(max_norm=NAN), ValueError, r"max_norm.*nan"),
    (dict(default_id=-5), ValueError, r"default_id.*-5"),
    (dict(default_id=1.5), TypeError, r"default_id.*1\.5"),
    (dict(prune_invalid_ids="yes"), TypeError, r"prune_invalid_ids"),
])
def test_ops_refuse_bad_max_norm_and_default_id(kwargs, error, match):
    ids = tf.ragged.constant([[1, 2], []], tf.int64)
    with pytest.raises(error, match=match):
        kre.ops.embedding_lookup_sparse(_ops_table(), ids, combiner="sum", **kwargs)
    with pytest.raises(error, match=match):
        kre.ops.group_embedding_lookup_sparse([_ops_table()], [ids], "sum", **kwargs)


def test_weights_with_another_structure_are_refused():
    table = _ops_table()
    ids = tf.ragged.constant([[1, 2], [3]], tf.int64)
    weights = tf.ragged.constant([[1.0], [2.0, 3.0]])  # same count, other rows
    with pytest.raises(ValueError, match=r"sp_weights\[0\].*structure of `sp_ids\[0\]`"):
        kre.ops.embedding_lookup_sparse(table, ids, sp_weights=weights, combiner="sum")
    sp_ids = _sp([[0, 0], [1, 0]], [1, 2])
    sp_w = tf.SparseTensor(tf.constant([[0, 0], [0, 1]], tf.int64), [1.0, 2.0], [2, 2])
    with pytest.raises(ValueError, match=r"sp_weights\[0\].*same indices"):
        kre.ops.embedding_lookup_sparse(table, sp_ids, sp_weights=sp_w, combiner="sum")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"sp_weights\[0\]"):
        tf.function(lambda i, w: kre.ops.embedding_lookup_sparse(
            table, i, sp_weights=w, combiner="sum"))(ids, weights)


def test_group_embedding_refuses_out_of_range_table_ids():
    group = GroupEmbedding({"a": FeatureSpec({"embedding_dim": 2}),
                            "b": FeatureSpec({"embedding_dim": 2})})
    ids = np.array([[1, 2, -1]])
    ok = group((ids, np.array([[0, 1, 9]])))  # a padding id may carry any table id
    assert ok["a"].shape == (1, 2)
    with pytest.raises(ValueError, match=r"table_ids.*\[0, 2\).*\[2\]"):
        group((ids, np.array([[0, 2, 0]])))
    with pytest.raises(ValueError, match=r"table_ids.*\[-1\]"):
        group((ids, np.array([[-1, 0, 0]])))


# -- 7. eviction and counting saturate instead of wrapping -----------------------------------
def test_global_step_evicts_a_key_whose_version_is_int64_min():
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    layer = EmbeddingVariable(2, name="ev", ev_option=kre.EmbeddingVariableOption(
        evict_option=kre.GlobalStepEvict(100)))
    layer.build()
    layer.import_({"keys": [1, 2, 3], "values": np.ones((3, 2)),
                   "versions": [lo, 50, 10]})
    assert layer.evict(step=60) == 1  # 60 - INT64_MIN is stale; 60 - 10 is not
    np.testing.assert_array_equal(np.sort(layer.export()["keys"]), [2, 3])
    # A checkpoint's largest step: the next lookup's step saturates, no wrap.
    layer.import_({"keys": [4, 5], "values": np.ones((2, 2)), "versions": [hi, 0]})
    layer(np.array([6]), training=True)
    assert layer.evict() == 1  # at step INT64_MAX, key 5 (step 0) is stale
    np.testing.assert_array_equal(np.sort(layer.export()["keys"]), [4, 6])


# -- 12. errors that name the file and the fix ------------------------------------------------
def _saved(tmp_path):
    ids = keras.Input((1,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(EmbeddingVariable(
        4, combiner="sum", name="ev", ev_option=kre.EmbeddingVariableOption(
            filter_option=kre.CounterFilter(2)))(ids)))
    path = str(tmp_path / "ok.keras")
    kre.save_model(model, path)
    return path


def test_cli_reports_corrupt_and_truncated_models_by_name(tmp_path, capsys):
    import zipfile

    from keras_rec_emb import cli

    path = _saved(tmp_path)
    data = open(path, "rb").read()
    truncated = str(tmp_path / "truncated.keras")
    with open(truncated, "wb") as f:
        f.write(data[:len(data) // 2])
    for command in (["inspect", truncated], ["strip-filtered", truncated,
                                             str(tmp_path / "o.keras")]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert f"{truncated} exists but is not a valid .keras file" in err
        assert "File not found" not in err and "Traceback" not in err
    # A zip whose weights file is garbage: named, not a BadZipFile/h5 traceback.
    bad_h5 = str(tmp_path / "bad_h5.keras")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bad_h5, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, b"\x89HDF garbage" * 50 if name == "model.weights.h5"
                         else src.read(name))
    assert cli.main(["strip-filtered", bad_h5, str(tmp_path / "o.keras")]) == 2
    assert f"{bad_h5}: its model.weights.h5 is corrupt" in capsys.readouterr().err
    # Flipped bytes in a member fail its CRC check.
    flipped = bytearray(data)
    with zipfile.ZipFile(path) as src:
        info = src.getinfo("model.weights.h5")
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + 100, start + 200):
        flipped[i] ^= 0xFF
    flipped_path = str(tmp_path / "flipped.keras")
    with open(flipped_path, "wb") as f:
        f.write(bytes(flipped))
    assert cli.main(["inspect", flipped_path]) == 2
    assert "'model.weights.h5' fails its CRC check" in capsys.readouterr().err
    assert cli.main(["inspect", path]) == 0


def test_corrupt_parquet_pages_name_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from keras_rec_emb.data import ParquetDataset

    path = str(tmp_path / "corrupt.parquet")
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"a": rng.integers(0, 10**9, 20000),
                             "b": rng.normal(size=20000)}), path, compression="snappy")
    raw = bytearray(open(path, "rb").read())
    for i in range(200, len(raw) // 2, 3):  # page data, not the footer
        raw[i] ^= 0x5A
    with open(path, "wb") as f:
        f.write(bytes(raw))
    with pytest.raises((ValueError, tf.errors.OpError), match="corrupt.parquet"):
        for _ in ParquetDataset(path, batch_size=1000):
            pass
