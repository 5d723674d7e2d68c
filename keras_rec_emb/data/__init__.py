"""Input pipelines: Parquet and Kafka into tf.data (TensorFlow backend) or
NumPy batches (JAX backend), both for `model.fit`; synthetic click data."""

from keras_rec_emb.data.dataframe import DataFrame
from keras_rec_emb.data.decoders import decode_csv
from keras_rec_emb.data.decoders import decode_example
from keras_rec_emb.data.decoders import decode_json
from keras_rec_emb.data.kafka import KafkaDataset
from keras_rec_emb.data.kafka import KafkaGroupIODataset
from keras_rec_emb.data.kafka import KafkaPosition
from keras_rec_emb.data.parquet import ParquetDataset
from keras_rec_emb.data.parquet import read_parquet
from keras_rec_emb.data.synthetic import synthetic_ctr

__all__ = [
    "DataFrame",
    "KafkaDataset",
    "KafkaGroupIODataset",
    "KafkaPosition",
    "ParquetDataset",
    "decode_csv",
    "decode_example",
    "decode_json",
    "read_parquet",
    "synthetic_ctr",
]


def __dir__():
    return list(__all__)  # the public names only, not the implementing modules
