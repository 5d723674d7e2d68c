"""Tables beyond one process: asynchronous parameter-server tables and
synchronous tables sharded over MultiWorkerMirroredStrategy workers.
TensorFlow backend only (built on `tf.distribute` and its gRPC runtime)."""

from keras_rec_emb import _backend

if _backend.is_jax():
    raise ImportError(
        "keras_rec_emb.distribute (parameter-server tables, tables sharded over "
        "MirroredStrategy or MultiWorkerMirroredStrategy replicas) runs on Keras's "
        "TensorFlow backend only for now, and the active backend is 'jax'. Under JAX "
        "tables train in one process; set KERAS_BACKEND=tensorflow to distribute them."
    )

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.distribute.collective_tables import CollectiveShardedTable
from keras_rec_emb.distribute.multi_worker import multi_worker_strategy

from keras_rec_emb.distribute.ps_tables import (
    ShardedEmbeddingTable,
    connect,
    parameter_servers,
    shard_of,
)

__all__ = ["CollectiveShardedTable", "ShardedEmbeddingTable", "connect", "multi_worker_strategy",
           "parameter_servers", "shard_of"]

# model.fit / evaluate under a multi-worker strategy (keras-team/keras#20585),
# and several steps an execution under it or a MirroredStrategy of several
# replicas (keras-team/keras#19246): see _compat.fix_keras_multi_worker;
# nothing changes elsewhere.
_compat.fix_keras_multi_worker()


def __dir__():
    return list(__all__)  # the public names only, not the implementing modules
