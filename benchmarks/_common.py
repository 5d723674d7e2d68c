"""What the benchmark scripts share beside the machine (_machine.py):
their options, and their child processes' addresses and result lines."""

import argparse
import json
import socket
import sys


def parser(doc, **options):
    """An `argparse` parser described by the first line of `doc`, with an
    option `--NAME` (underscores as dashes) per keyword, in order: its
    default, or a (default, help) pair; typed as its default."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name, value in options.items():
        default, help_text = value if isinstance(value, tuple) else (value, None)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=help_text)
    return p


def free_addresses(n):
    """`n` distinct 127.0.0.1:PORT addresses free now (bound together, then
    released)."""
    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    addresses = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in socks]
    for sock in socks:
        sock.close()
    return addresses


def stop(procs):
    """Kills each `subprocess.Popen` of `procs` still running (by its pid),
    and reaps them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def child_result(returncode, out, err):
    """The JSON of a child's `RESULT {...}` line; None (its stderr's end
    written to ours) where it failed or printed none."""
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if returncode or not line:
        sys.stderr.write(err[-3000:])
        return None
    return json.loads(line[0][len("RESULT "):])


def child_results(procs, outs):
    """`child_result` of each `subprocess.Popen` and its `communicate()`;
    None where any failed."""
    results = [child_result(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
    return None if None in results else results
