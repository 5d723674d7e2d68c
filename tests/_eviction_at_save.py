"""The model the eviction-at-save tests of tests/test_filters_eviction.py
train (under both backends).

L2WeightEvict(1.0) at dim 16: trained rows have 0.5 * sum(row**2) far below
1.0, so a save evicts every row of that table (issue 56: an ESMM lost all
17 tables)."""

import keras
import numpy as np

import keras_rec_emb as kre


def two_table_model(at_save=True):
    """A trained model with a table every row of which L2WeightEvict(1.0)
    evicts ('clicks') and one that GlobalStepEvict keeps whole ('items')."""
    def table(name, rule):
        return kre.layers.EmbeddingVariable(
            16, name=name, combiner="mean",
            ev_option=kre.EmbeddingVariableOption(evict_option=rule))

    ids = keras.Input((4,), dtype="int64")
    clicks = table("clicks", kre.L2WeightEvict(1.0, at_save=at_save))(ids[:, :2])
    items = table("items", kre.GlobalStepEvict(steps_to_live=1000))(ids[:, 2:])
    model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(
        keras.layers.Concatenate()([clicks, items])))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    rng = np.random.default_rng(5)
    x = rng.integers(0, 300, size=(256, 4))
    model.fit(x, rng.integers(0, 2, size=(256, 1)).astype(np.float32), batch_size=32,
              verbose=0)
    return model, x


def eviction_logs(caplog):
    """{table name: its eviction-at-save log line} of the records caught."""
    return {r.getMessage().split("table '")[1].split("'")[0]: r.getMessage()
            for r in caplog.records if r.name == "keras_rec_emb" and "at save" in r.getMessage()}
