"""Tables beyond one process: asynchronous parameter-server tables and
synchronous tables sharded over MultiWorkerMirroredStrategy workers."""

from keras_rec_emb.distribute.collective_tables import CollectiveShardedTable  # noqa: F401

from keras_rec_emb.distribute.ps_tables import (  # noqa: F401
    ShardedEmbeddingTable,
    connect,
    parameter_servers,
    shard_of,
)
