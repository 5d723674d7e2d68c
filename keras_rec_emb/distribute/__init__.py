"""Tables beyond one process: asynchronous parameter-server tables and
synchronous tables sharded over MultiWorkerMirroredStrategy workers."""

from keras_rec_emb import _compat as _compat
from keras_rec_emb.distribute.collective_tables import CollectiveShardedTable  # noqa: F401
from keras_rec_emb.distribute.multi_worker import multi_worker_strategy  # noqa: F401

from keras_rec_emb.distribute.ps_tables import (  # noqa: F401
    ShardedEmbeddingTable,
    connect,
    parameter_servers,
    shard_of,
)

__all__ = ["CollectiveShardedTable", "ShardedEmbeddingTable", "connect", "multi_worker_strategy",
           "parameter_servers", "shard_of"]

# model.fit / evaluate under a multi-worker strategy (keras-team/keras#20585):
# see _compat.fix_keras_multi_worker; nothing changes elsewhere.
_compat.fix_keras_multi_worker()


def __dir__():
    return list(__all__)  # the public names only, not the implementing modules
