"""`python -m keras_rec_emb.distribute.ps --ps HOST:PORT,HOST:PORT --task I`:
runs parameter-server task I (same as `keras-rec-emb ps`).

TensorFlow 2.21 binds its gRPC server, which runs any graph sent to it, to
`0.0.0.0:PORT` whatever the task address names (GrpcServer::Init): this
command starts itself again with `_kre_bind.so` preloaded (csrc/net/kre_bind.c)
so that it listens on the `--ps` address only. See docs/security.md.
"""

import argparse
import faulthandler
import os
import socket
import sys

import keras_rec_emb_cli

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = os.path.join(_PACKAGE_DIR, "_kre_bind.so")
MAP_ENV = "KRE_BIND_MAP"
# Hosts that name every interface: the caller asked for that.
_EVERY_INTERFACE = ("", "0.0.0.0", "::", "*")


def _split(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _numeric_ip(host, port):
    """The address `host` resolves to (IPv4 first, as a client given the
    name tries it first), as text."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def bind_map(address):
    """KRE_BIND_MAP for a PS task at `address`: its port on the named
    address (unless that names every interface), any other port on
    loopback."""
    host, port = _split(address)
    ip = "*" if host in _EVERY_INTERFACE else _numeric_ip(host, port)
    return f"{port}={ip},*=127.0.0.1"


def _reexec_with_shim(argv, mapping):
    """Runs this command again in this process (same pid) with the shim
    preloaded; returns only when the shim is not built."""
    if not os.path.exists(SHIM):
        return
    env = dict(os.environ)
    env[MAP_ENV] = mapping
    env["LD_PRELOAD"] = ":".join(p for p in (SHIM, env.get("LD_PRELOAD")) if p)
    parent = os.path.dirname(_PACKAGE_DIR)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "keras_rec_emb.distribute.ps", *argv], env)


def listening_sockets(pid="self"):
    """(ip, port) of every TCP socket process `pid` listens on, read from
    /proc (the sockets its file descriptors hold, matched by inode); a
    v4-mapped IPv6 address is given as its IPv4 address."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
        for line in lines:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: TCP_LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = socket.inet_ntop(family, raw)
            if ip.startswith("::ffff:") and "." in ip:
                ip = ip[len("::ffff:"):]
            found.append((ip, int(hex_port, 16)))
    return found


def _check_listening(address, mapping):
    """An error message when this process listens wider than `mapping`
    allows (None when it does not)."""
    allowed = dict(entry.split("=", 1) for entry in mapping.split(","))
    wide = []
    for ip, p in listening_sockets():
        want = allowed.get(str(p), allowed["*"])
        if want != "*" and ip != want:
            shown = f"[{ip}]" if ":" in ip else ip
            wide.append(f"{shown}:{p} (should be {want})")
    if not wide:
        return None
    shim = ("it was not preloaded (build it with `make bind-shim`)"
            if SHIM not in os.environ.get("LD_PRELOAD", "").split(":") else
            "it was preloaded but did not take effect")
    return (f"keras-rec-emb ps: task at {address} listens on {', '.join(wide)}. TensorFlow's "
            "gRPC server binds every interface whatever address it is given, and runs any "
            f"graph a client sends, unauthenticated; {SHIM} makes it bind the address --ps "
            f"names, but {shim}.")


def main(argv=None):
    help_text = keras_rec_emb_cli.PS_HELP
    p = argparse.ArgumentParser(prog="keras-rec-emb ps",
                                description=help_text[0].upper() + help_text[1:] + ".")
    keras_rec_emb_cli.add_ps_arguments(p)
    args = p.parse_args(argv)
    ps = keras_rec_emb_cli.ps_addresses(p, args)
    try:
        mapping = bind_map(ps[args.task])
    except (ValueError, OSError) as e:
        p.error(f"--ps: cannot listen on {ps[args.task]!r} (task {args.task}): {e}")
    if os.environ.get(MAP_ENV) != mapping:
        _reexec_with_shim(["--ps", args.ps, "--task", str(args.task)], mapping)
    # A crash of a long-lived server process prints its stacks (to stderr).
    faulthandler.enable()
    from keras_rec_emb.distribute.ps_tables import serve

    server = serve(ps, args.task)
    problem = _check_listening(ps[args.task], mapping)
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        if os.path.exists(SHIM):
            # The shim is there and failed: do not serve wider than asked.
            sys.stdout.flush()
            from keras_rec_emb.backend.tensorflow import compat as _compat

            _compat.exit_now(1)
    print(f"keras-rec-emb ps: task {args.task} serving at {ps[args.task]}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
