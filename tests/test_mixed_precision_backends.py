"""Mixed precision under both backends: `compile` under "mixed_float16"
wraps an optimizer of ours in our `LossScaleOptimizer`, which trains the
tables and Dense weights as float32 training does (to float16 precision),
and skips the whole step, table update included, when its gradients
overflow (the loss scale then halves)."""

import keras
import numpy as np
import pytest

import keras_rec_emb as kre

pytestmark = pytest.mark.backends("tensorflow", "jax")

DIM, DVD = 4, 8
rng = np.random.default_rng(3)
IDS = rng.integers(-1, 12, size=(32, 3)).astype(np.int64)
LABELS = rng.random((32, 1)).astype(np.float32)
MATRIX = np.linspace(-0.5, 0.5, DVD * DIM).reshape(DVD, DIM).astype(np.float32)
OPTIMIZERS = {"SGD": lambda: kre.optimizers.SGD(0.1),
              "Adagrad": lambda: kre.optimizers.Adagrad(0.1),
              "Adam": lambda: kre.optimizers.Adam(0.01),
              "AdamAsync": lambda: kre.optimizers.AdamAsync(0.01)}


@pytest.fixture(autouse=True)
def float32_after():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _model(policy, optimizer, track_meta=None):
    keras.mixed_precision.set_global_policy(policy)
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD), track_meta=track_meta)
    ids = keras.Input((3,), dtype="int64")
    ev = kre.layers.EmbeddingVariable(DIM, initializer=keras.initializers.Constant(MATRIX),
                                      combiner="sum", prune_invalid_ids=True, ev_option=option,
                                      name="ev")
    hidden = keras.layers.Dense(3, activation="tanh", name="hidden",
                                kernel_initializer=keras.initializers.RandomNormal(stddev=0.5, seed=1))
    head = keras.layers.Dense(1, dtype="float32", name="head",
                              kernel_initializer=keras.initializers.RandomNormal(stddev=0.5, seed=2))
    model = keras.Model(ids, head(hidden(ev(ids))))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _state(model, keys=None):
    """The table's keys and rows, the Dense weights; with `keys`, those
    keys with their initial rows (an untrained model's)."""
    if keys is None:
        parts = model.get_layer("ev").export()
        order = np.argsort(parts["keys"])
        keys, values = np.asarray(parts["keys"])[order], np.asarray(parts["values"])[order]
    else:  # DeepRec's default values: row `id % default_value_dim` of the matrix
        values = MATRIX[keys % DVD]
    out = {"keys": keys, "values": values}
    for layer in ("hidden", "head"):
        for i, w in enumerate(model.get_layer(layer).get_weights()):
            out[f"{layer} {i}"] = np.asarray(w)
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mixed_float16_trains_like_float32(name):
    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    mixed = _model("mixed_float16", OPTIMIZERS[name]())
    assert type(mixed.optimizer) is kre.optimizers.LossScaleOptimizer
    assert mixed.get_layer("hidden").compute_dtype == "float16"
    mixed.fit(IDS, LABELS, **fit)
    assert float(mixed.optimizer.dynamic_scale) == 2.0**15  # no step overflowed
    assert int(mixed.optimizer.iterations) == 8
    reference = _model("float32", OPTIMIZERS[name]())
    reference.fit(IDS, LABELS, **fit)
    got, want = _state(mixed), _state(reference)
    before = _state(_model("float32", OPTIMIZERS[name]()), keys=want["keys"])
    np.testing.assert_array_equal(got["keys"], want["keys"])
    for key in want:
        # float16 activations and gradients: a few thousandths.
        np.testing.assert_allclose(got[key], want[key], atol=3e-3, err_msg=key)
        if key != "keys":  # and they did train, by more than that
            assert np.abs(want[key] - before[key]).max() > 0.01, key


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_an_overflowing_step_skips_the_table_and_dense_updates(name):
    # 2**60 times any gradient overflows float16: the one step is skipped.
    optimizer = kre.optimizers.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=2.0**60)
    model = _model("mixed_float16", optimizer)
    model.fit(IDS[:8], LABELS[:8], batch_size=8, verbose=0)
    assert float(optimizer.dynamic_scale) == 2.0**59
    assert int(optimizer.iterations) == 0
    got = _state(model)
    assert got["keys"].tolist() == sorted(set(IDS[:8].ravel()) - {-1})
    want = _state(_model("float32", OPTIMIZERS[name]()), keys=got["keys"])
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _table_state(model):
    """Everything a step may change: the table's rows, slots, frequencies
    and versions (by id), the Dense weights, the optimizer's step."""
    parts = model.get_layer("ev").export()
    order = np.argsort(parts["keys"])
    out = {name: np.asarray(parts[name])[order] for name in ("keys", "values", "versions")}
    for name, slot in parts["slots"].items():
        out[f"slot {name}"] = np.asarray(slot)[order]
    for layer in ("hidden", "head"):
        for i, w in enumerate(model.get_layer(layer).get_weights()):
            out[f"{layer} {i}"] = np.asarray(w)
    out["step"] = int(model.optimizer.iterations)
    return out


@pytest.mark.parametrize("name", ["Adam", "AdamAsync", "Adagrad"])
def test_a_non_finite_step_changes_nothing_and_the_next_step_resumes(name):
    # The step counter drives Adam's bias correction and the versions: a
    # skipped step must not advance it, so that the next finite step is the
    # one an uninterrupted run takes.
    first, second = slice(0, 8), slice(8, 16)
    bad = np.full((8, 1), np.inf, np.float32)
    skipped = _model("mixed_float16", OPTIMIZERS[name](), track_meta=True)
    skipped.train_on_batch(IDS[first], LABELS[first])
    before = _table_state(skipped)
    skipped.train_on_batch(IDS[first], bad)
    assert float(skipped.optimizer.dynamic_scale) == 2.0**14  # the step overflowed
    after = _table_state(skipped)
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    skipped.train_on_batch(IDS[second], LABELS[second])
    straight = _model("mixed_float16", OPTIMIZERS[name](), track_meta=True)
    straight.train_on_batch(IDS[first], LABELS[first])
    straight.train_on_batch(IDS[second], LABELS[second])
    got, want = _table_state(skipped), _table_state(straight)
    assert got["step"] == want["step"] == 2
    assert got["versions"].max() == 1  # the second step is step 1, as uninterrupted
    for key in want:
        # The scales differ by a power of two: the unscaled float16
        # gradients are the same.
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
