"""TensorBoard scalars without TensorFlow: an event file of TFRecord-framed
`tensorboard.Event` protos encoded by hand, so that `callbacks.TableStats`
writes the same files under either backend without TensorFlow or `tensorboard`.

A record is `uint64 length, uint32 masked_crc32c(length), data,
uint32 masked_crc32c(data)`, little-endian (TensorFlow's
`io/record_writer.cc`). An Event is `wall_time` (field 1, double), `step`
(2, int64), `file_version` (3, string) or `summary` (5): a Summary of
`value`s (1), each a `tag` (1, string) and a `simple_value` (2, float),
which TensorBoard's scalar dashboard reads as it reads `tf.summary.scalar`'s.
"""

import itertools
import os
import socket
import struct
import time


def _crc32c_table():
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()
_FILES = itertools.count()  # one name per writer in this process


def masked_crc32c(data):
    """CRC-32C of `data`, masked as TFRecord files store it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value):
    value &= 0xFFFFFFFFFFFFFFFF  # an int64 as protobuf encodes it
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _bytes_field(tag, payload):
    return tag + _varint(len(payload)) + payload


def _event(step, file_version=None, scalars=()):
    out = b"\x09" + struct.pack("<d", time.time()) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _bytes_field(b"\x1a", file_version.encode())
    if scalars:
        summary = b"".join(
            _bytes_field(b"\x0a", _bytes_field(b"\x0a", tag.encode())
                         + b"\x15" + struct.pack("<f", value))
            for tag, value in scalars)
        out += _bytes_field(b"\x2a", summary)
    return out


class EventFileWriter:
    """Appends scalar events to a new event file in `log_dir` (made if
    missing)."""

    def __init__(self, log_dir):
        os.makedirs(log_dir, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_FILES)}.v2")
        self.path = os.path.join(log_dir, name)
        self._file = open(self.path, "wb")  # open until close()
        self._write(_event(0, file_version="brain.Event:2"))

    def _write(self, data):
        length = struct.pack("<Q", len(data))
        self._file.write(length + struct.pack("<I", masked_crc32c(length)) + data
                         + struct.pack("<I", masked_crc32c(data)))

    def scalars(self, step, values):
        """One event at `step` holding `values` ({tag: number}) as scalars."""
        self._write(_event(int(step), scalars=[(t, float(v)) for t, v in values.items()]))

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()
