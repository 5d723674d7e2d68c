"""Tables beyond one process: asynchronous parameter-server tables."""

from keras_rec_emb.distribute.ps_tables import (  # noqa: F401
    ShardedEmbeddingTable,
    connect,
    parameter_servers,
    shard_of,
)
