"""Faults of the file tier with real files: segments truncated or corrupted
under a live table or in a snapshot, restores that fail part-way (all or
nothing), descriptors and mappings bounded over many snapshots, bad cache
sizes. Processes that could die of a signal run as subprocesses."""

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")


def run_child(script, *args, timeout=300):
    """Runs `script` in a fresh interpreter; returns (returncode, stdout, stderr)."""
    result = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                            capture_output=True, text=True, timeout=timeout, env=ENV)
    return result.returncode, result.stdout, result.stderr


def lines(out, tag):
    return [line[len(tag) + 1:] for line in out.splitlines() if line.startswith(tag + " ")]


_TRUNCATED_CHILD = r"""
import glob, os, sys
import numpy as np
import tensorflow as tf
import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

folder = sys.argv[1]
option = kre.EmbeddingVariableOption(num_shards=2, storage_option=kre.StorageOption(
    "FILE", storage_path=folder, storage_size=4096))
layer = EmbeddingVariable(8, ev_option=option, name="t")
keys = np.arange(200_000, dtype=np.int64)
for start in range(0, len(keys), 50_000):
    layer(keys[start:start + 50_000], training=True)
segments = glob.glob(os.path.join(folder, "*", "live-*", "*.seg"))
for path in segments:
    os.truncate(path, 32)
print("TRUNCATED", len(segments), flush=True)
for what, fn in (("lookup", lambda: layer(keys[:1000])),
                 ("export", lambda: layer.table.export())):
    try:
        fn()
        print("NOERROR", what, flush=True)
    except tf.errors.OpError as e:
        print("ERROR", what, type(e).__name__, " ".join(str(e).split()), flush=True)
print("ALIVE", flush=True)
"""


def test_segments_truncated_under_a_live_table_raise_not_kill(tmp_path):
    """Issue 43.1: segment files cut to their 32-byte header while the table
    lives (a tool rewriting them, a full disk): the next read of a row on
    file raised SIGBUS through the memory map and killed the process. Now
    each read is an error naming the file and the offset, and the process
    lives on."""
    code, out, err = run_child(_TRUNCATED_CHILD, tmp_path)
    assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert int(lines(out, "TRUNCATED")[0]) >= 2
    errors = lines(out, "ERROR")
    assert [e.split()[0] for e in errors] == ["lookup", "export"], out
    for error in errors:
        assert error.split()[1] == "DataLossError", error
        assert "was truncated under the table" in error and "offset" in error, error
        assert str(tmp_path) in error and ".seg" in error and "/live-" in error, error
    assert lines(out, "ALIVE") is not None and "ALIVE" in out


def file_layer(folder, name, shards=2, dim=8):
    option = kre.EmbeddingVariableOption(num_shards=shards, storage_option=kre.StorageOption(
        "FILE", storage_path=str(folder), storage_size=4096))
    return EmbeddingVariable(dim, ev_option=option, name=name)


def assert_same_export(a, b):
    order_a, order_b = np.argsort(a["keys"]), np.argsort(b["keys"])
    for key in ("keys", "values", "freqs", "versions"):
        np.testing.assert_array_equal(a[key][order_a], b[key][order_b], err_msg=key)
    assert sorted(a["slots"]) == sorted(b["slots"])
    for name in a["slots"]:
        np.testing.assert_array_equal(a["slots"][name][order_a], b["slots"][name][order_b])


def record_bytes(path):
    """Bytes per record of a segment file (its header holds the floats per
    record at bytes 8..16; each record is followed by a 4-byte checksum)."""
    with open(path, "rb") as f:
        header = f.read(32)
    return int.from_bytes(header[8:16], "little") * 4 + 4


def rewrite_with_flipped_byte(path, offset):
    """Writes a new file in place of `path` (parting the hard link the live
    table shares) with the byte at `offset` changed."""
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x20
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


def test_corrupt_snapshot_record_fails_the_restore_and_changes_nothing(tmp_path):
    """Issue 43.2: a byte changed in a snapshot's segment records (only the
    index had a CRC) restored other rows without a word. Records carry
    CRC-32C checksums now: the restore fails naming the file and the offset
    of the record, and the table keeps exactly what it held."""
    layer = file_layer(tmp_path, "c")
    layer(np.arange(20_000, dtype=np.int64), training=True)
    assert layer.snapshot() == 1
    at_snapshot = layer.export()
    layer(np.arange(20_000, 30_000, dtype=np.int64), training=True)
    before = layer.export()
    segments = glob.glob(os.path.join(layer.table.storage_dir, "snap-1", "*.seg"))
    segment = max(segments, key=os.path.getsize)
    rec = record_bytes(segment)
    size = os.path.getsize(segment)
    assert size > 32 + 10 * rec and (size - 32) % rec == 0
    original = open(segment, "rb").read()
    middle = 32 + ((size - 32) // rec // 2) * rec
    rewrite_with_flipped_byte(segment, middle + 3)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        layer.restore_snapshot()
    message = " ".join(str(info.value).split())
    assert f"corrupt record at offset {middle}" in message and segment in message, message
    assert_same_export(before, layer.export())
    # The segment as it was written restores exactly.
    with open(segment + ".new", "wb") as f:
        f.write(original)
    os.replace(segment + ".new", segment)
    assert layer.restore_snapshot() == len(at_snapshot["keys"])
    assert_same_export(at_snapshot, layer.export())


def test_snapshot_of_the_older_format_is_refused_with_the_reason(tmp_path):
    """A snapshot written before records carried checksums (format 01) is
    refused with an error that says so, not read as a corrupt index; the
    table keeps what it held."""
    layer = file_layer(tmp_path, "o")
    layer(np.arange(1000, dtype=np.int64), training=True)
    assert layer.snapshot() == 1
    before = layer.export()
    index = os.path.join(layer.table.storage_dir, "snap-1", "index")
    data = bytearray(open(index, "rb").read())
    assert data[:8] == b"KRESNP02"
    data[:8] = b"KRESNP01"
    data[-4:] = zlib.crc32(bytes(data[:-4])).to_bytes(4, "little")  # a valid older index
    with open(index + ".new", "wb") as f:
        f.write(data)
    os.replace(index + ".new", index)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        layer.restore_snapshot()
    message = " ".join(str(info.value).split())
    assert "older keras_rec_emb (format 01" in message and index in message, message
    assert_same_export(before, layer.export())


def test_corrupt_live_record_fails_the_read(tmp_path):
    """A byte changed in the table's own segment files while it lives: the
    read of such a row is a DataLossError naming the file and the offset,
    not another row's values."""
    layer = file_layer(tmp_path, "r")
    keys = np.arange(20_000, dtype=np.int64)
    layer(keys, training=True)
    layer.snapshot()  # every row written out (appends are buffered until then)
    segments = glob.glob(os.path.join(layer.table.storage_dir, "live-*", "*.seg"))
    assert sum(os.path.getsize(path) - 32 for path in segments) >= 19_000 * record_bytes(
        segments[0])
    for path in segments:
        rec = record_bytes(path)
        with open(path, "r+b") as f:
            size = os.path.getsize(path)
            for offset in range(32 + 1, size, rec):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(tf.errors.DataLossError) as info:
        layer(keys)
    message = " ".join(str(info.value).split())
    assert "corrupt record at offset" in message and "/live-" in message, message
    assert any(path in message for path in segments), message


_RESTORE_OVER_LIMIT_CHILD = r"""
import os, resource, sys
import numpy as np
import tensorflow as tf
import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

folder, snapshot, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
option = kre.EmbeddingVariableOption(num_shards=2, storage_option=kre.StorageOption(
    "FILE", storage_path=folder, storage_size=4096))
layer = EmbeddingVariable(8, ev_option=option, name="s")
layer(np.arange(1000, 1300, dtype=np.int64), training=True)
layer.snapshot()
before = layer.export()
files = sorted(f for d in os.listdir(layer.table.storage_dir) if d.startswith("live-")
               for f in os.listdir(os.path.join(layer.table.storage_dir, d)))
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ
try:
    layer.restore_snapshot(snapshot)
    print("NOERROR", flush=True)
except tf.errors.OpError as e:
    print("ERROR", type(e).__name__, " ".join(str(e).split()), flush=True)
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
after = layer.export()
same = all(np.array_equal(np.sort(before[k], axis=0), np.sort(after[k], axis=0))
           for k in ("keys", "values", "freqs", "versions"))
print("SAME", same, len(before["keys"]), len(after["keys"]), flush=True)
files_after = sorted(f for d in os.listdir(layer.table.storage_dir) if d.startswith("live-")
                     for f in os.listdir(os.path.join(layer.table.storage_dir, d)))
print("FILES", files == files_after, flush=True)
layer(np.arange(1000, 1400, dtype=np.int64), training=True)
print("TRAINS", int(layer.table.size()), flush=True)
"""


def test_restore_from_another_file_system_is_all_or_nothing(tmp_path):
    """Issue 43.3: `restore_snapshot(path)` of a snapshot on another file
    system (tmpfs) failed after its checks with the table's first shard
    already emptied. Now the segments are copied where a hard link cannot
    cross, so the restore works; and a restore that fails part-way (the
    copies over a file-size limit, as on a full disk) leaves the table
    exactly as it was, with no files added."""
    layer = file_layer(tmp_path / "a", "s")
    layer(np.arange(300, dtype=np.int64), training=True)
    assert layer.snapshot() == 1
    at_snapshot = layer.export()
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        assert os.stat(shm).st_dev != os.stat(tmp_path).st_dev
        for name in ("CURRENT", "snap-1"):
            source = os.path.join(layer.table.storage_dir, name)
            (shutil.copytree if os.path.isdir(source) else shutil.copy)(
                source, os.path.join(shm, name))
        smallest = min(os.path.getsize(p) for p in glob.glob(os.path.join(shm, "snap-1", "*.seg")))
        code, out, err = run_child(_RESTORE_OVER_LIMIT_CHILD, tmp_path / "b", shm, smallest - 1)
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
        error = lines(out, "ERROR")
        assert error and "cannot copy the snapshot segment" in error[0], out
        assert shm in error[0] and "File too large" in error[0], error[0]
        assert lines(out, "SAME") == ["True 300 300"], out
        assert lines(out, "FILES") == ["True"], out
        assert lines(out, "TRAINS") == ["400"], out

        other = file_layer(tmp_path / "c", "s")
        other(np.arange(1000, 1300, dtype=np.int64), training=True)
        assert other.restore_snapshot(shm) == 300
        assert_same_export(at_snapshot, other.export())
    finally:
        shutil.rmtree(shm)
    assert_same_export(at_snapshot, other.export())  # its own copies
    other(np.arange(300, 400, dtype=np.int64), training=True)
    assert other.snapshot() == 1
    trained = other.export()
    assert other.restore_snapshot() == 400
    assert_same_export(trained, other.export())


def open_files_under(folder):
    """Descriptors of this process on files under `folder`, and its
    mappings of such files."""
    folder = os.path.realpath(folder) + os.sep
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(folder)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum(folder in line for line in f)
    return fds, maps


def test_descriptors_and_mappings_stay_bounded_over_many_snapshots(tmp_path):
    """Issue 43.10: each `snapshot()` left one more open segment file (and
    a 64 MiB mapping) per shard: 30 snapshots of a default 32-shard table
    held ~970 descriptors, failing under the common limit of 1024. Now a
    table keeps open only the segments it appends to and a few per shard for
    reading, and maps none."""
    option = kre.EmbeddingVariableOption(storage_option=kre.StorageOption(
        "FILE", storage_path=str(tmp_path), storage_size=4096))
    layer = EmbeddingVariable(8, ev_option=option, name="d")
    shards = 32  # the default
    rng = np.random.default_rng(0)
    most = 0
    for _ in range(30):
        layer(rng.integers(0, 50_000, 3000, dtype=np.int64), training=True)
        layer.snapshot()
        fds, maps = open_files_under(tmp_path)
        most = max(most, fds)
        assert maps == 0
    layer.export()  # reads every row on file
    fds, maps = open_files_under(tmp_path)
    most = max(most, fds)
    segments = glob.glob(os.path.join(layer.table.storage_dir, "live-*", "*.seg"))
    bound = shards * 3 + 1  # per shard: the segment written, 2 for reading; the lock file
    assert len(segments) > 3 * bound
    assert most <= bound and maps == 0, (most, bound)


def test_storage_size_beyond_the_machine_memory_is_refused_naming_it(tmp_path):
    """Issue 43.12: a huge `storage_size` passed the option's check and
    failed at the first lookup with a bare std::bad_alloc. A cache larger
    than the machine's memory is refused where it is given, naming the
    argument, the value and the limit; a large one within it works."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for size in (2**62, memory + 1):
        with pytest.raises(ValueError) as info:
            kre.StorageOption("FILE", storage_path=str(tmp_path), storage_size=size)
        message = str(info.value)
        assert "`storage_size`" in message and f"Received: storage_size={size}" in message
        assert f"at most this machine's memory, {memory} bytes" in message, message
    option = kre.EmbeddingVariableOption(num_shards=2, storage_option=kre.StorageOption(
        "FILE", storage_path=str(tmp_path), storage_size=memory // 16))
    layer = EmbeddingVariable(4, ev_option=option, name="m")
    assert layer(np.arange(100, dtype=np.int64), training=True).shape == (100, 4)


def test_links_planted_under_storage_path_are_removed_not_followed(tmp_path):
    """A symbolic link planted as a stale `live-*` folder of the table, links
    inside (and deeper inside) a stale folder, and a link where a killed
    snapshot's leftovers go: building the table and snapshotting it unlink
    them and delete none of the files of the folder they point to."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    files = {victim / "a": "kept a", victim / "b": "kept b", victim / "sub" / "c": "kept c"}
    for path, text in files.items():
        path.write_text(text)
    folder = tmp_path / "store" / "p_embeddings"
    (folder / "live-2-0" / "deep").mkdir(parents=True)
    os.symlink(victim, folder / "live-1-0")
    os.symlink(victim, folder / "live-2-0" / "link")
    os.symlink(victim / "a", folder / "live-2-0" / "file-link")
    os.symlink(victim, folder / "live-2-0" / "deep" / "link")
    (folder / "live-2-0" / "old.seg").write_bytes(b"stale")
    os.symlink(victim, folder / "snap-1.tmp")
    layer = file_layer(tmp_path / "store", "p")
    layer(np.arange(500, dtype=np.int64), training=True)
    assert layer.table.storage_dir == str(folder)
    assert {path: path.read_text() for path in files if path.exists()} == files
    for name in ("live-1-0", "live-2-0"):
        assert not os.path.lexists(folder / name), name
    layer.snapshot()
    assert not os.path.lexists(folder / "snap-1.tmp")
    assert (folder / "snap-1").is_dir() and not (folder / "snap-1").is_symlink()
    assert {path: path.read_text() for path in files if path.exists()} == files
