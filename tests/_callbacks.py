"""The model and the per-step recorder of the callback tests
(tests/test_callbacks.py, tests/test_table_stats.py and
tests/jax_backend/test_callbacks.py). No TensorFlow here."""

import keras

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable


def table_model(name="ids", filter_freq=None, steps_to_live=None, width=2, dtype="int64",
                **option):
    """ids [batch, width] -> a summing EmbeddingVariable (an optional
    CounterFilter and GlobalStepEvict, more EmbeddingVariableOption
    arguments in `option`) -> Dense(1), compiled with Adagrad; the model
    and its table."""
    ids = keras.Input((width,), dtype=dtype)
    layer = EmbeddingVariable(4, combiner="sum", name=name, ev_option=kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(filter_freq) if filter_freq else None,
        evict_option=kre.GlobalStepEvict(steps_to_live) if steps_to_live else None, **option))
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(layer(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model, layer


class EachStep(keras.callbacks.Callback):
    """Records `record()` (a table's export, its size) after every training
    step, in `values`; after the callbacks before it in the list."""

    def __init__(self, record):
        super().__init__()
        self.record, self.values = record, []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(self.record())
