"""Model bits shared by the distributed runners (mirrored_run.py,
mwms_run.py). No import-time side effects beyond importing the package:
a runner that configures logical devices does so before importing this."""

import keras
import numpy as np

import keras_rec_emb as kre

# The optimizers the distributed tests compare, by name (fresh each call).
OPTIMIZERS = {"sgd": lambda: kre.optimizers.SGD(0.1),
              "adagrad": lambda: kre.optimizers.Adagrad(0.1),
              "adam": lambda: kre.optimizers.Adam(0.05)}


def counted_table(dim, combiner, filter_freq):
    """The runners' "emb" table: rows uniform in [-1, 1) (seed 7),
    frequencies tracked, keys admitted once counted `filter_freq` times."""
    return kre.layers.EmbeddingVariable(
        dim, combiner=combiner, name="emb",
        initializer=keras.initializers.RandomUniform(-1, 1, seed=7),
        ev_option=kre.EmbeddingVariableOption(
            track_meta=True, filter_option=kre.CounterFilter(filter_freq=filter_freq)))


def compile_mse(inputs, outputs, optimizer, steps_per_execution=1, metrics=None):
    """`keras.Model(inputs, outputs)` compiled with `OPTIMIZERS[optimizer]`
    and the mean squared error."""
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse", metrics=metrics,
                  steps_per_execution=steps_per_execution)
    return model


def table_arrays(table):
    """The table's rows sorted by key (`export` gathers every shard): keys,
    values, freqs, the filtered keys (sorted) and each slot as `slot_NAME`."""
    exported = table.export()
    order = np.argsort(exported["keys"])
    out = {"keys": exported["keys"][order], "values": exported["values"][order],
           "freqs": exported["freqs"][order],
           "keys_filtered": np.sort(exported["keys_filtered"])}
    for name, rows in exported["slots"].items():
        out["slot_" + name] = rows[order]
    return out
