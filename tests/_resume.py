"""One scenario for both backends: a table with its own optimizer trained
1 epoch, saved as `.keras`, loaded and trained 1 more epoch ends where 2
uninterrupted epochs end (rows, slots, frequencies, dense weights).

The last batch holds only ids the admission filter does not admit yet, so
the table's last step stamps no version: the step the loaded layer resumes
at must come from the file, not from the rows."""

import keras
import numpy as np

import keras_rec_emb as kre

DIM, FEATURES, BATCH = 3, 2, 4
KINDS = ("adam", "adagrad", "adam_async", "schedule")
FORMS = ("embedding_variable", "group_embedding")


def _optimizer(kind):
    if kind == "adam":
        return kre.optimizers.Adam(0.05)
    if kind == "adagrad":
        return kre.optimizers.Adagrad(0.1)
    if kind == "adam_async":
        return kre.optimizers.AdamAsync(0.05)
    return kre.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5))


def _model(kind, form):
    option = kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=5),
        filter_option=kre.CounterFilter(filter_freq=2))
    table = kre.layers.EmbeddingVariable(
        DIM, optimizer=_optimizer(kind), ev_option=option, name="ev",
        initializer=keras.initializers.RandomUniform(seed=1))
    inputs = keras.Input(shape=(FEATURES,), dtype="int64")
    if form == "embedding_variable":
        rows = keras.layers.Flatten()(table(inputs))
    else:
        group = kre.layers.GroupEmbedding(
            {"a": kre.layers.FeatureSpec(table), "b": kre.layers.FeatureSpec(table)},
            output_mode="concat")
        rows = group({"a": inputs[:, 0], "b": inputs[:, 1]})
    dense = keras.layers.Dense(1, name="dense",
                               kernel_initializer=keras.initializers.RandomNormal(seed=3))
    model = keras.Model(inputs, dense(rows))
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 6, size=(16, FEATURES)).astype(np.int64)
    ids[-BATCH:] = 100 + np.arange(BATCH * FEATURES).reshape(BATCH, FEATURES)
    return ids, rng.normal(size=(16, 1)).astype(np.float32)


def _state(model):
    table = next(t for layer in model.layers
                 for t in [layer, *getattr(layer, "tables", ())] if t.name == "ev")
    parts = table.export()
    order = np.argsort(parts["keys"])
    out = {name: np.asarray(parts[name])[order] for name in ("keys", "values", "freqs")}
    out.update({f"slot:{n}": np.asarray(v)[order] for n, v in parts["slots"].items()})
    out.update({f"dense:{i}": np.asarray(w)
                for i, w in enumerate(model.get_layer("dense").get_weights())})
    return out


def resumed_and_uninterrupted(kind, form, path):
    """(state after 1 epoch + save/load at `path` + 1 epoch, state after 2
    uninterrupted epochs)."""
    ids, labels = _data()
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    whole = _model(kind, form)
    whole.fit(ids, labels, epochs=2, **fit)
    first = _model(kind, form)
    first.fit(ids, labels, epochs=1, **fit)
    first.save(path)
    loaded = keras.saving.load_model(path)
    loaded.fit(ids, labels, epochs=1, **fit)
    return _state(loaded), _state(whole)


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
