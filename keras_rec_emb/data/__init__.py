"""Input pipelines: Parquet and Kafka into tf.data (issue 3)."""
