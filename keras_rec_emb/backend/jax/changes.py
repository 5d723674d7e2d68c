"""The change tracking of the JAX tables, for incremental checkpoints: the
TensorFlow `EmbeddingTable`'s methods that `incremental.py` uses, so that one
file format serves both backends. A link saves each JAX table's step counter
as `step` (TensorFlow skips it); a link without it restores the optimizer's.
"""

import keras
import numpy as np

from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.backend.jax.optimizers import tables_of
from keras_rec_emb.backend.jax.saving import saved_variables as optimizer_variables  # noqa: F401  (incremental's)


class TableChanges:
    """The change-tracking view of one JAX `EmbeddingVariable`'s table."""

    def __init__(self, layer):
        self.layer = layer

    @property
    def dim(self):
        return self.layer.embedding_dim

    @property
    def key_dtype(self):
        return np.dtype(self.layer.key_dtype)

    def _specs(self):
        return self.layer.table.slot_specs

    def mark_changes(self):
        return ffi.mark_changes(self.layer.handle)

    def export_changes(self, since):
        return ffi.export_changes(self.layer.handle, self.layer.key_dtype, self.dim,
                                  self._specs(), since)

    def trim_erased(self, upto):
        return ffi.trim_erased(self.layer.handle, upto)

    def export(self):
        return self.layer.export()

    def import_(self, data, clear=True):
        if clear:
            self.layer.import_(data)
        else:
            ffi.import_parts(self.layer.handle, self.layer.key_dtype, self.dim, data, clear=False)

    def apply_changes(self, delta):
        """Erases `delta["erased"]`, then writes its rows into the table."""
        if delta["erased"].size:
            ffi.erase(self.layer.handle, self.layer.key_dtype, delta["erased"])
        self.import_({k: v for k, v in delta.items() if k not in ("erased", "complete")},
                     clear=False)

    def counters(self):
        return ffi.stats(self.layer.handle)

    @property
    def step(self):
        return int(keras.ops.convert_to_numpy(self.layer.iterations.value))

    @step.setter
    def step(self, value):
        self.layer.iterations.assign(int(value))


def tables(model):
    """(name, TableChanges) of every table of `model`, in variable order,
    named `<layer name>/embeddings` as under TensorFlow (Keras numbers the
    paths of unnamed holders per process: a model built again would differ)."""
    out, seen = [], set()
    for variable in model.variables:
        for layer in tables_of([variable]):
            if id(layer) not in seen and layer.handle is not None:
                seen.add(id(layer))
                out.append((f"{layer.name}/embeddings", TableChanges(layer)))
    return out


def dense_variables(model):
    """The model's variables a TensorFlow model also has: not those of the
    tables' layers (anchor, step counter, own learning rate)."""
    skip = {id(v) for layer in tables_of(model.variables) for v in layer.variables}
    return [v for v in model.variables if id(v) not in skip]
