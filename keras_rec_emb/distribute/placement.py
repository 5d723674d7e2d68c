"""Which kind of table a layer gets, decided in one place from the scope it
is built in. Layers create tables only through `make_table`; the core table
(`variables.EmbeddingTable`) knows nothing of the choice."""

import tensorflow as tf

from keras_rec_emb.backend.tensorflow import variables as _variables
from keras_rec_emb.distribute import collective_tables, ps_tables, ps_variables


def table_kind():
    """The kind of table a layer built now gets: `"collective"` (in a
    MultiWorkerMirroredStrategy's scope), `"parameter_servers"`, `"replicas"`
    (in a MirroredStrategy's scope), else `"local"`."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "collective"
    if ps_variables.scope_devices() is not None:
        return "parameter_servers"
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return "replicas"
    return "local"


def make_table(dim, key_dtype, default_values, name, **kwargs):
    """The table a layer built now gets, by `table_kind()` (`**kwargs`: the
    other arguments of `EmbeddingTable`)."""
    kind = table_kind()
    if kind == "collective":
        return collective_tables.CollectiveShardedTable(
            tf.distribute.get_strategy(), dim, key_dtype, default_values, name=name, **kwargs)
    if kind == "parameter_servers":
        return ps_tables.ShardedEmbeddingTable(
            ps_variables.scope_devices(), dim, key_dtype, default_values, name=name, **kwargs)
    if kind == "replicas":
        devices = list(tf.distribute.get_strategy().extended.worker_devices)
        return ps_tables.ShardedEmbeddingTable(devices, dim, key_dtype, default_values,
                                               name=name, replicas=True, **kwargs)
    return _variables.EmbeddingTable(dim, key_dtype, default_values, name=name, **kwargs)
