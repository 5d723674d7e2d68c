"""What a Keras user reaches for next works with tables: TensorBoard
histograms, mixed precision, jit_compile, model.summary()."""

import glob
import io

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import keras_rec_emb as kre

X = np.arange(48, dtype=np.int64).reshape(16, 3) * 1_000_003  # 48 distinct ids
Y = np.ones((16, 1), np.float32)


def table_model(optimizer, dim=4, name="ev", **compile_kwargs):
    ids = keras.Input((3,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(dim, combiner="sum", name=name)
    out = keras.layers.Dense(1, dtype="float32", name="head")(ev(ids))
    model = keras.Model(ids, out)
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model, ev


def test_tensorboard_histograms_of_table_rows(tmp_path):
    model, ev = table_model(kre.optimizers.Adagrad(0.1))
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[
        keras.callbacks.TensorBoard(str(tmp_path), histogram_freq=1)])
    files = glob.glob(str(tmp_path / "train" / "events.out.tfevents.*"))
    acc = event_accumulator.EventAccumulator(
        files[0], size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    tag = "ev/embeddings/histogram"
    assert tag in acc.Tags()["tensors"]
    events = acc.Tensors(tag)
    assert [e.step for e in events] == [0, 1]
    # The histogram buckets count every value of every row: 48 ids x 4.
    buckets = tf.make_ndarray(events[-1].tensor_proto)
    assert buckets[:, 2].sum() == 48 * 4 == ev.table_size() * 4
    rows = ev.export()["values"]
    assert buckets[0, 0] == pytest.approx(rows.min()) and \
        buckets[-1, 1] == pytest.approx(rows.max())


def test_table_converts_to_tensor_eagerly_only():
    model, ev = table_model(kre.optimizers.SGD(0.1))
    model.fit(X, Y, batch_size=16, verbose=0)
    np.testing.assert_array_equal(tf.convert_to_tensor(ev.table.variable).numpy(),
                                  ev.export()["values"])

    @tf.function
    def traced():
        return tf.convert_to_tensor(ev.table.variable)

    with pytest.raises(TypeError, match="ev/embeddings.*inside a tf.function"):
        traced()


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _train_sgd(matrix_initializer, optimizer, steps=3):
    init = matrix_initializer(np.linspace(-0.5, 0.5, 8 * 4).reshape(8, 4))
    ids = keras.Input((3,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(4, combiner="sum", initializer=init, name="ev")
    out = keras.layers.Dense(1, dtype="float32", kernel_initializer="ones", name="head")(ev(ids))
    model = keras.Model(ids, out)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(X, Y, batch_size=16, epochs=steps, shuffle=False, verbose=0)
    data = ev.export()
    return data["values"][np.argsort(data["keys"])], model


def test_mixed_float16_trains_tables_in_float32_with_loss_scaling(
        mixed_float16, matrix_initializer):
    optimizer = kre.optimizers.LossScaleOptimizer(kre.optimizers.SGD(0.05))
    mixed, model = _train_sgd(matrix_initializer, optimizer)
    assert model.get_layer("ev").compute_dtype == "float16"
    assert model.get_layer("ev").table.variable.dtype == tf.float32
    assert float(optimizer.dynamic_scale) == 2.0**15  # no overflow, no growth yet
    keras.mixed_precision.set_global_policy("float32")
    reference, _ = _train_sgd(matrix_initializer, kre.optimizers.SGD(0.05))
    before, _ = _train_sgd(matrix_initializer, kre.optimizers.SGD(0.0))
    # The update is unscaled (a scaled one would be 32768 times larger) and
    # matches float32 training to float16 precision.
    np.testing.assert_allclose(mixed, reference, atol=5e-3)
    assert np.abs(reference - before).max() > 0.02  # well above atol


def test_mixed_float16_skips_non_finite_steps(mixed_float16, matrix_initializer):
    optimizer = kre.optimizers.LossScaleOptimizer(kre.optimizers.SGD(0.05),
                                                  initial_scale=1e30)
    mixed, _ = _train_sgd(matrix_initializer, optimizer, steps=1)
    keras.mixed_precision.set_global_policy("float32")
    before, _ = _train_sgd(matrix_initializer, kre.optimizers.SGD(0.0), steps=1)
    np.testing.assert_array_equal(mixed, before)  # inf gradients: step skipped
    assert float(optimizer.dynamic_scale) == pytest.approx(0.5e30, rel=1e-6)


def test_mixed_float16_stock_wrapper_names_the_fix(mixed_float16):
    # `compile` wraps ours in ours by itself (tests/test_mixed_precision.py);
    # Keras's wrapper passed by hand cannot update a table.
    model, _ = table_model(keras.optimizers.LossScaleOptimizer(kre.optimizers.Adagrad(0.1)))
    with pytest.raises(TypeError, match=r"updated by keras_rec_emb\.optimizers\.Adagrad.*"
                                        r"keras_rec_emb\.optimizers\.LossScaleOptimizer"):
        model.fit(X, Y, verbose=0)


def test_loss_scale_optimizer_bad_input_and_saving(tmp_path, mixed_float16):
    with pytest.raises(TypeError, match="inner_optimizer.*keras_rec_emb.optimizers"):
        kre.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer = kre.optimizers.LossScaleOptimizer(kre.optimizers.Adagrad(0.1),
                                                  dynamic_growth_steps=7)
    model, ev = table_model(optimizer)
    model.fit(X, Y, verbose=0)
    kre.save_model(model, tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is kre.optimizers.LossScaleOptimizer
    assert loaded.optimizer.dynamic_growth_steps == 7
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0))


def _summary(model, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich's console width: no wrapping
    out = io.StringIO()
    model.summary(print_fn=lambda line, **kw: out.write(line + "\n"), line_length=200)
    return out.getvalue()


def test_summary_shows_each_table_ids_and_dim(monkeypatch):
    ids = keras.Input((3,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(8, combiner="sum", name="ev")
    group = kre.layers.GroupEmbedding({
        "a": kre.layers.FeatureSpec({"embedding_dim": 4}),
        "b": kre.layers.FeatureSpec({"embedding_dim": 2})}, output_mode="concat")
    h = keras.layers.Concatenate()([ev(ids), group({"a": ids, "b": ids})])
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    assert "0 (0 ids x 8)" in _summary(model, monkeypatch)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.fit(X, Y, verbose=0)
    text = _summary(model, monkeypatch)
    assert f"{48 * 8} (48 ids x 8)" in text
    assert f"{48 * 4 + 48 * 2} (2 tables, 96 ids)" in text
    assert ev.count_params() == 48 * 8 and isinstance(ev.count_params(), int)
    assert f"{ev.count_params():,}" == "384 (48 ids x 8)"


def test_jit_compile_auto_chooses_false_and_true_falls_back_with_a_warning():
    from keras.src.trainers.trainer import model_supports_jit

    model, ev = table_model(kre.optimizers.Adagrad(0.1), jit_compile="auto")
    assert not model_supports_jit(model) and model.jit_compile is False
    model.fit(X, Y, verbose=0)
    assert ev.table_size() == 48
    dense = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    assert model_supports_jit(dense)  # what "auto" sees without our layers
    with pytest.warns(UserWarning, match="doesn't support `jit_compile=True`"):
        model, ev = table_model(kre.optimizers.Adagrad(0.1), jit_compile=True)
    assert model.jit_compile is False
    history = model.fit(X, Y, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


@pytest.mark.parametrize("layer", ["ev", "group"])
def test_lookup_in_an_xla_function_gives_a_clear_error(layer):
    if layer == "ev":
        emb = kre.layers.EmbeddingVariable(4)
    else:
        emb = kre.layers.GroupEmbedding({"a": kre.layers.FeatureSpec({"embedding_dim": 4})})
    ids = tf.constant([[1, 2]], tf.int64)
    emb({"a": ids} if layer == "group" else ids)

    @tf.function(jit_compile=True)
    def step(ids):
        return emb({"a": ids} if layer == "group" else ids, training=True)

    with pytest.raises(ValueError, match=r"lookup cannot run inside an XLA-compiled "
                                         r"function \(`jit_compile=True`\).*jit_compile"):
        step(ids)


_DISTRIBUTED = r'''
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
import keras_rec_emb as kre
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
assert strategy.num_replicas_in_sync == 2
x, y = np.arange(32).reshape(16, 2), np.ones((16, 1))
for what in ("layer", "group"):
    try:
        with strategy.scope():
            ids = keras.Input((2,), dtype="int64")
            if what == "layer":
                kre.layers.EmbeddingVariable(4, combiner="sum")(ids)
            else:
                kre.layers.GroupEmbedding({"a": kre.layers.FeatureSpec({"embedding_dim": 4})})(
                    {"a": ids})
        print("BUILT", what)
    except ValueError as e:
        print("REFUSED", what, e)
ids = keras.Input((2,), dtype="int64")
ev = kre.layers.EmbeddingVariable(4, combiner="sum")
model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
with strategy.scope():
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    try:
        model.fit(x, y, verbose=0, batch_size=8)
        print("FIT", ev.table_size())
    except ValueError as e:
        print("REFUSED fit", " ".join(str(e).split()))
with strategy.scope():
    dense = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    dense.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
callback = kre.callbacks.EvictionCallback(every_n_steps=1)
dense.fit(x.astype("float32"), y, verbose=0, batch_size=8, epochs=2, callbacks=[callback])
print("EVICTION CALLBACK", int(dense.optimizer.iterations.numpy()), callback.evicted)
'''


def test_distribution_strategy_is_refused_clearly(tmp_path):
    """Under MirroredStrategy over 2 CPU devices (configured in a fresh
    process, before TensorFlow starts): a GroupEmbedding, or fitting a model
    whose table was built outside the scope, raises an error naming the
    strategy; EvictionCallback works."""
    import subprocess
    import sys

    script = tmp_path / "distributed.py"
    script.write_text(_DISTRIBUTED)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    refused = [line for line in lines if line.startswith("REFUSED")]
    # EmbeddingVariable built inside MirroredStrategy's scope is sharded over
    # the replicas (tests/distribute/test_mirrored.py); a table built outside
    # the scope and fitted inside is still refused (a GroupEmbedding's sharded
    # tables are refused at lookup: tests/distribute/test_parameter_servers.py).
    assert "BUILT layer" in lines and "BUILT group" in lines
    assert [line.split()[1] for line in refused] == ["fit"], lines
    for line in refused:
        assert "MirroredStrategy (2 replicas) is not supported for this table" in line
        assert "outside any strategy scope" in line
    assert "EVICTION CALLBACK 4 0" in lines


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_files_respect_the_umask(tmp_path, umask):
    import os
    import stat

    model, _ = table_model(kre.optimizers.Adagrad(0.1))
    model.fit(X, Y, verbose=0)
    old = os.umask(umask)
    try:
        kre.save_model(model, tmp_path / "m.keras")
        model.save(tmp_path / "plain.keras")
        kre.export_for_serving(model, str(tmp_path / "serving"))
    finally:
        os.umask(old)

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(tmp_path / "m.keras") == mode(tmp_path / "plain.keras") == 0o666 & ~umask
    assert mode(tmp_path / "serving") == 0o777 & ~umask
    for root, dirs, files in os.walk(tmp_path / "serving"):
        for name in dirs:
            assert mode(os.path.join(root, name)) == 0o777 & ~umask, name
        for name in files:
            assert mode(os.path.join(root, name)) == 0o666 & ~umask, name


def test_loading_needs_the_import_and_the_error_names_the_class(tmp_path):
    """Keras imports only its own packages while deserializing (see
    keras/src/saving/serialization_lib.py, `_retrieve_class_or_fn`), so a
    fresh process must `import keras_rec_emb` before `load_model`; without
    it the error names the class and its registered package name."""
    import subprocess
    import sys

    model, _ = table_model(kre.optimizers.Adagrad(0.1))
    model.fit(X, Y, verbose=0)
    path = str(tmp_path / "m.keras")
    kre.save_model(model, path)
    load = f"import keras\nmodel = keras.saving.load_model({path!r})\nprint('LOADED')\n"
    for prefix, loads in (("", False), ("import keras_rec_emb\n", True)):
        result = subprocess.run([sys.executable, "-c", prefix + load], capture_output=True,
                                text=True, timeout=300,
                                env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert ("LOADED" in result.stdout) == loads, result.stderr[-2000:]
        if not loads:
            assert "Could not locate class 'EmbeddingVariable'" in result.stderr
            assert "keras_rec_emb>EmbeddingVariable" in result.stderr


@pytest.mark.parametrize("layer_kind", ["embedding_variable", "group_embedding"])
def test_subclassed_model_without_a_training_argument_counts_and_filters_in_fit(layer_kind):
    """Keras passes `training=None` to the layers of a subclassed model whose
    `call` takes no `training`, in `fit` too: the tables must still count
    (frequencies, admission filters) as in the functional form, and predict
    and evaluate must still insert nothing."""
    ids = np.array([[1, 2], [2, 3], [3, 4], [1, 2]] * 2, np.int64)
    y = np.ones((8, 1), np.float32)

    def table():
        option = kre.EmbeddingVariableOption(
            filter_option=kre.CounterFilter(filter_freq=5), track_meta=True)
        return kre.layers.EmbeddingVariable(2, ev_option=option, initializer="ones",
                                            name="tab")

    class NoTraining(keras.Model):
        def __init__(self):
            super().__init__()
            self.tab = table()
            if layer_kind == "group_embedding":
                self.group = kre.layers.GroupEmbedding(
                    {"f": kre.layers.FeatureSpec(self.tab, combiner="sum")},
                    output_mode="concat")
            self.head = keras.layers.Dense(1, kernel_initializer="ones")

        def call(self, x):  # no `training`: Keras gives the layers None
            if layer_kind == "group_embedding":
                return self.head(self.group({"f": x}))
            return self.head(keras.ops.sum(self.tab(x), axis=1))

    functional_in = keras.Input((2,), dtype="int64")
    functional_tab = table()
    if layer_kind == "group_embedding":
        emb = kre.layers.GroupEmbedding({"f": kre.layers.FeatureSpec(
            functional_tab, combiner="sum")}, output_mode="concat")({"f": functional_in})
    else:
        emb = keras.ops.sum(functional_tab(functional_in), axis=1)
    functional = keras.Model(functional_in, keras.layers.Dense(1, kernel_initializer="ones")(emb))
    sub = NoTraining()
    exports = []
    for model, tab in ((functional, functional_tab), (sub, sub.tab)):
        model.compile(optimizer=kre.optimizers.SGD(0.1), loss="mse")
        model.fit(ids, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        before = tab.export()
        model.predict(np.array([[7, 8]]), verbose=0)
        model.evaluate(np.array([[9, 9]]), np.ones((1, 1)), verbose=0)
        after = tab.export()
        assert sorted(after["keys"].tolist()) == sorted(before["keys"].tolist())
        order = np.argsort(before["keys"])
        exports.append({k: before[k][order] for k in ("keys", "values", "freqs")})
    # Over 2 epochs ids 1, 2 and 3 occur 8, 12 and 8 times and pass the
    # filter's count of 5; id 4 (4 times) is counted but not admitted.
    np.testing.assert_array_equal(exports[0]["keys"], [1, 2, 3])
    for k in ("keys", "values", "freqs"):
        np.testing.assert_allclose(exports[1][k], exports[0][k], rtol=1e-6, err_msg=k)
