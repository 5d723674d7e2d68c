"""The TensorFlow tables' change tracking for incremental checkpoints
(keras_rec_emb/incremental.py): the tables are the `EmbeddingTable`s of
the model's `TableVariable`s, which track changes themselves."""

from keras_rec_emb.backend.tensorflow import variables as _variables


def tables(model):
    """(name, EmbeddingTable) of every table of `model`, in variable order."""
    out, seen = [], set()
    for v in model.variables:
        if _variables.is_table(v) and id(v.table) not in seen:
            seen.add(id(v.table))
            out.append((v.path, v.table))
    return out


def dense_variables(model):
    return [v for v in model.variables if not _variables.is_table(v)]


def optimizer_variables(optimizer):
    return [v for v in optimizer.variables if not _variables.is_table(v)]
