"""`connect` ends in bounded time with an error naming the task and address
when a PS address is an open port that is not the TensorFlow server of that
task: a silent socket, a socket that answers something else, another task.

Each worker runs in a subprocess under a hard timeout: before the probe,
`connect` returned and building the model waited forever on the silent
socket (TensorFlow's RPCs carry no deadline)."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _net import free_ports  # noqa: E402

# A worker that connects and builds and runs the parameter-server test model.
WORKER = """
import sys
sys.path.insert(0, {here!r})
import numpy as np
import keras_rec_emb as kre
import ps_worker
devices = kre.distribute.connect({ps!r}, {worker!r}, 0, timeout={timeout!r})
with kre.distribute.parameter_servers(devices):
    model = ps_worker.build_model()
print("PREDICTED", model.predict(np.zeros((2, ps_worker.IDS_PER_ROW), np.int64), verbose=0))
"""

HARD_TIMEOUT = 90


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_worker(ps, timeout=3.0):
    """Runs the worker against `ps`; returns (exit code, output, seconds)."""
    (port,) = free_ports(1)
    code = WORKER.format(here=HERE, ps=list(ps), worker=f"127.0.0.1:{port}", timeout=timeout)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, text=True)
    try:
        out, _ = proc.communicate(timeout=HARD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()  # by its pid
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the worker still waited after {HARD_TIMEOUT} s (a hang):\n{out[-3000:]}")
    return proc.returncode, out, time.monotonic() - start


@contextlib.contextmanager
def _listener(answer):
    """A real socket on 127.0.0.1 that accepts every connection and then
    sends `answer` (bytes; None: nothing, ever) and keeps it open."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    conns, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conns.append(conn)
            if answer is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(answer)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}", conns
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in conns:
            conn.close()
        server.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("answer, says", [
    (None, "did not answer within"),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "ps task 0"),
], ids=["silent", "http"])
def test_open_port_that_is_not_a_tensorflow_server(answer, says):
    with _listener(answer) as (address, conns):
        rc, out, seconds = _run_worker([address], timeout=3.0)
        assert conns, "the worker never connected to the socket:\n" + out[-3000:]
    assert rc != 0, out[-3000:]
    assert "PREDICTED" not in out
    assert "ConnectionError" in out, out[-3000:]
    assert address in out and says in out, out[-3000:]
    # The error comes from the 3 s probe, not from the hard timeout.
    assert seconds < HARD_TIMEOUT / 2, seconds


@pytest.mark.multiprocess
def test_second_task_of_a_silent_cluster_is_named():
    """The first task is a real TensorFlow server; the second is silent:
    the error names task 1 and its address, not task 0."""
    (ps_port,) = free_ports(1)
    with _listener(None) as (silent, _):
        ps = [f"127.0.0.1:{ps_port}", silent]
        server = subprocess.Popen(
            [sys.executable, "-m", "keras_rec_emb.distribute.ps", "--ps", ",".join(ps),
             "--task", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=_env(), cwd=ROOT)
        try:
            rc, out, _ = _run_worker(ps, timeout=20.0)
        finally:
            server.kill()  # by its pid
            server.wait(timeout=30)
    assert rc != 0, out[-3000:]
    assert f"The TensorFlow server of ps task 1 ({silent}) did not answer" in out, out[-3000:]


@pytest.mark.multiprocess
def test_addresses_out_of_task_order_name_the_task():
    """A real PS task 1 given at position 0: the error says which task it is."""
    ports = free_ports(2)
    ps = [f"127.0.0.1:{p}" for p in ports]
    server = subprocess.Popen(
        [sys.executable, "-m", "keras_rec_emb.distribute.ps", "--ps", ",".join(ps),
         "--task", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=_env(), cwd=ROOT)
    try:
        rc, out, _ = _run_worker([ps[1]], timeout=20.0)
    finally:
        server.kill()  # by its pid
        server.wait(timeout=30)
    assert rc != 0, out[-3000:]
    assert f"The TensorFlow server at {ps[1]} is not ps task 0" in out, out[-3000:]
    assert "/job:ps/replica:0/task:1/device:CPU:0" in out, out[-3000:]


def _listening(pid):
    """{(ip, port)} of the TCP sockets process `pid` listens on: its file
    descriptors' socket inodes looked up in /proc/PID/net/tcp and tcp6
    (v4-mapped IPv6 addresses as their IPv4 address, "::" as "[::]")."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
        for row in rows:
            if row[3] != "0A" or row[9] not in inodes:
                continue
            ip_hex, port_hex = row[1].split(":")
            words = [bytes.fromhex(ip_hex[i:i + 8])[::-1] for i in range(0, len(ip_hex), 8)]
            ip = socket.inet_ntop(family, b"".join(words))
            ip = ip.removeprefix("::ffff:") if "." in ip else ("[::]" if ip == "::" else ip)
            found.add((ip, int(port_hex, 16)))
    return found


@pytest.mark.multiprocess
def test_ps_listens_only_on_the_address_it_names():
    """`--ps 127.0.0.2:P` (a loopback address other than 127.0.0.1, so that
    "the named address" and "loopback" differ): the PS server listens on
    exactly that address and its helper client's server on 127.0.0.1; no
    socket of the process listens on every interface. Workers still train
    against it."""
    port, other = free_ports(2)
    ps = [f"127.0.0.2:{port}", f"127.0.0.1:{other}"]  # task 0 of a 2-task cluster
    server = subprocess.Popen(
        [sys.executable, "-m", "keras_rec_emb.distribute.ps", "--ps", ",".join(ps),
         "--task", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(),
        cwd=ROOT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + HARD_TIMEOUT
        while "serving at" not in line and time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line or server.poll() is None, "the PS task exited"
        assert "serving at 127.0.0.2:" in line, line
        sockets = _listening(server.pid)  # the PID of the process that serves (exec)
        assert ("127.0.0.2", port) in sockets, sockets
        assert len(sockets) == 2, sockets
        (helper,) = sockets - {("127.0.0.2", port)}
        assert helper[0] == "127.0.0.1", sockets
        assert not [s for s in sockets if s[0] in ("0.0.0.0", "[::]")], sockets
        rc, out, _ = _run_worker(ps[:1], timeout=30.0)
        assert rc == 0 and "PREDICTED" in out, out[-3000:]
    finally:
        server.kill()  # by its pid
        server.wait(timeout=30)


def test_bind_map_names_the_address_and_loopback_for_the_rest():
    from keras_rec_emb.distribute import ps

    assert ps.bind_map("127.0.0.2:2300") == "2300=127.0.0.2,*=127.0.0.1"
    assert ps.bind_map("localhost:2300") == "2300=127.0.0.1,*=127.0.0.1"
    assert ps.bind_map("[::1]:2300") == "2300=::1,*=127.0.0.1"
    # 0.0.0.0 asks for every interface: that port stays a wildcard.
    assert ps.bind_map("0.0.0.0:2300") == "2300=*,*=127.0.0.1"


def test_ps_address_that_does_not_resolve_is_named(capsys):
    import keras_rec_emb_cli

    with pytest.raises(SystemExit) as info:
        keras_rec_emb_cli.main(["ps", "--ps", "no-such-host.invalid:2300", "--task", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--ps" in err and "no-such-host.invalid:2300" in err, err


@pytest.mark.multiprocess
def test_ps_that_listens_wider_than_asked_exits_with_the_sockets_named():
    """The shim kept out (KRE_BIND_MAP already set, so the command does not
    start itself again with it preloaded): TensorFlow binds every interface,
    the command reads that from its sockets and exits naming them."""
    from keras_rec_emb.distribute import ps as ps_module

    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    env = dict(_env(), KRE_BIND_MAP=ps_module.bind_map(address))
    result = subprocess.run(
        [sys.executable, "-m", "keras_rec_emb.distribute.ps", "--ps", address, "--task", "0"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=HARD_TIMEOUT)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "serving at" not in result.stdout
    assert f"[::]:{port} (should be 127.0.0.1)" in result.stderr, result.stderr[-3000:]
    assert "it was not preloaded" in result.stderr
