"""Reads TensorBoard event files back with the `tensorboard` package's
protos and CRC (not the package's writer): for the TableStats tests of
both backends. No TensorFlow: `EventAccumulator` would import it."""

import glob
import os
import struct

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c


def events(path):
    """The `Event` protos of the file at `path`, each record's CRCs checked."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
        body = data[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == \
            masked_crc32c(body)
        out.append(event_pb2.Event.FromString(body))
        pos += 16 + length
    return out


def scalars(log_dir):
    """[(step, {tag: value})] of every summary event of the one event file
    in `log_dir`; asserts the file starts with its version event."""
    (path,) = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    found = events(path)
    assert found[0].file_version == "brain.Event:2"
    return [(e.step, {v.tag: v.simple_value for v in e.summary.value})
            for e in found[1:]]
