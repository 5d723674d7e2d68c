"""The file tier (StorageOption("FILE")): identical results to DRAM side by
side (training with filters and eviction, export/import, model.save,
tf.train.Checkpoint, export_for_serving), snapshots, statistics, faults;
the tests marked `both` under both backends (the JAX-only ones are in
tests/jax_backend/test_jax_file_tier.py)."""

import gc
import inspect
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable
from tests._file_tier import (DIM, VOCAB, build_model, data, ev_option, file_option, same_export,
                              table_error)

both = pytest.mark.backends("tensorflow", "jax")

@both
@pytest.mark.parametrize("policy", ["none", "counter", "bloom", "evict"])
def test_file_tier_trains_like_dram(tmp_path, policy):
    filters = {"counter": kre.CounterFilter(filter_freq=3),
               "bloom": kre.CBFFilter(filter_freq=2, max_element_size=10000,
                                      false_positive_probability=0.01)}
    evict = kre.GlobalStepEvict(steps_to_live=4) if policy == "evict" else None
    dram = build_model(ev_option(None, filters.get(policy), evict))
    file = build_model(ev_option(file_option(tmp_path), filters.get(policy), evict))
    ids, y = data()
    dram.fit(ids, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
    file.fit(ids, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
    d, f = dram.get_layer("ev"), file.get_layer("ev")
    if evict is not None:
        assert d.evict() == f.evict() > 0
    same_export(d.export(), f.export())
    np.testing.assert_array_equal(dram.predict(ids, verbose=0), file.predict(ids, verbose=0))
    stats = f.stats()
    assert stats["storage"] == "FILE" and d.stats()["storage"] == "DRAM"
    assert d.storage_dir is None
    assert stats["rows"] == stats["size"] == d.stats()["size"]
    assert 0 < stats["cached_rows"] <= 4 * (4096 // 4 // (2 * DIM * 4)) < stats["rows"]
    assert stats["disk_bytes"] > 0 and stats["file_writes"] > 0 and stats["file_reads"] > 0
    assert 0.0 < stats["cache_hit_rate"] < 1.0
    # The rows' files are under storage_path, in a folder named after the layer.
    assert f.storage_dir == os.path.join(str(tmp_path), "ev_embeddings")
    assert f.snapshot() == 1  # flushes the buffered appends to the files
    live = [os.path.join(f.storage_dir, name) for name in os.listdir(f.storage_dir)
            if name.startswith("live-")]
    assert len(live) == 1
    on_disk = sum(os.path.getsize(os.path.join(live[0], name)) for name in os.listdir(live[0]))
    stats = f.stats()
    # Each row on file: its value and Adagrad accumulator, 2 * DIM floats.
    assert on_disk >= (stats["rows"] - stats["cached_rows"]) * 2 * DIM * 4


def test_file_tier_save_load_checkpoint_and_serving(tmp_path):
    import tensorflow as tf
    # The file-tier model trains and saves in another process (a live table
    # locks its folder, so the reload below needs that process gone), the
    # DRAM twin here; then the file-tier model is loaded here.
    ids, y = data(1)
    dram = build_model(ev_option())
    dram.fit(ids, y, batch_size=128, epochs=1, verbose=0, shuffle=False)
    expect = dram.predict(ids, verbose=0)
    path = str(tmp_path / "m.keras")
    source = "\n".join(inspect.getsource(f) for f in (ev_option, file_option, build_model,
                                                        data))
    script = f"""
import keras, numpy as np, keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable
DIM, VOCAB = {DIM}, {VOCAB}
{source}
ids, y = data(1)
model = build_model(ev_option(file_option({str(tmp_path / "store")!r})))
model.fit(ids, y, batch_size=128, epochs=1, verbose=0, shuffle=False)
kre.save_model(model, {path!r})
print("SAVED-OK")
"""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300)
    assert "SAVED-OK" in result.stdout, result.stderr[-3000:]

    file = kre.load_model(path, storage_root=tmp_path)
    layer = file.get_layer("ev")
    assert layer.stats()["storage"] == "FILE"
    assert layer.table.storage_dir == os.path.join(str(tmp_path / "store"), "ev_embeddings")
    assert layer.storage_dir == layer.table.storage_dir  # as the JAX layer has it
    exported = layer.export()
    same_export(dram.get_layer("ev").export(), exported)
    np.testing.assert_array_equal(file.predict(ids, verbose=0), expect)

    # tf.train.Checkpoint into a fresh file-tier model on another folder.
    ckpt = tf.train.Checkpoint(model=file).write(str(tmp_path / "ckpt" / "c"))
    other = build_model(ev_option(file_option(tmp_path / "other")))
    other(ids[:1])
    tf.train.Checkpoint(model=other).read(ckpt).expect_partial()
    same_export(exported, other.get_layer("ev").export())

    # export_for_serving: stock TensorFlow serves what the DRAM model predicts.
    kre.export_for_serving(file, str(tmp_path / "serving"))
    served = tf.saved_model.load(str(tmp_path / "serving"))
    fn = served.signatures["serving_default"]
    out = list(fn(ids=tf.constant(ids)).values())[0].numpy()
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)


@both
def test_snapshot_restores_exactly_and_refuses_a_corrupt_one(tmp_path):
    ids, y = data(2)
    model = build_model(ev_option(file_option(tmp_path)))
    model.fit(ids, y, batch_size=128, epochs=1, verbose=0)
    layer = model.get_layer("ev")
    assert layer.snapshot() == 1
    at_snapshot = layer.export()
    model.fit(ids, y, batch_size=128, epochs=1, verbose=0)
    assert not np.array_equal(layer.export()["values"], at_snapshot["values"])
    assert layer.restore_snapshot() == len(at_snapshot["keys"])
    same_export(at_snapshot, layer.export())

    # A second live table on the same folder works in a folder of its own
    # (tests/test_file_tier_reload.py).
    with pytest.warns(UserWarning, match="held by another live table"):
        second = build_model(ev_option(file_option(tmp_path)))
        second(ids[:1])
    assert ".copy-" in second.get_layer("ev").storage_dir
    del second

    # A corrupt snapshot index: a clear error naming it; the table unchanged.
    index = os.path.join(layer.storage_dir, "snap-1", "index")
    with open(index, "r+b") as f:
        f.seek(50)
        byte = f.read(1)
        f.seek(50)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(table_error(), match=f"corrupt.*{index}"):
        layer.restore_snapshot()
    same_export(at_snapshot, layer.export())
    with pytest.raises(table_error(), match="snapshot restore failed"):
        layer.restore_snapshot(str(tmp_path / "nothing_here"))
    same_export(at_snapshot, layer.export())


@both
def test_bad_input_names_it(tmp_path):
    # Snapshots need the file tier, a built table and a path.
    dram = EmbeddingVariable(DIM, name="dram")
    dram(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="needs a file-tier table.*'dram/embeddings'"):
        dram.snapshot()
    with pytest.raises(ValueError, match="needs a file-tier table.*'dram/embeddings'"):
        dram.restore_snapshot()
    file = EmbeddingVariable(DIM, ev_option=ev_option(file_option(tmp_path)), name="f")
    file(np.array([1, 2], np.int32))
    with pytest.raises(TypeError, match="path.*Received: path=3"):
        file.restore_snapshot(3)
    with pytest.raises(ValueError, match="not built yet"):
        EmbeddingVariable(DIM, ev_option=ev_option(file_option(tmp_path / "x"))).snapshot()
    # A storage path under a plain file: the error names it.
    plain = tmp_path / "plain"
    plain.write_text("x")
    layer = EmbeddingVariable(DIM, ev_option=ev_option(file_option(plain / "sub")), name="bad")
    with pytest.raises(table_error(), match=str(plain)):
        layer(np.array([1, 2], np.int32))


@both
@pytest.mark.parametrize("kwargs, error, match", [
    ({"storage_type": "FILE"}, ValueError, "storage_path.*required"),
    ({"storage_type": "FILE", "storage_path": ""}, TypeError, "storage_path=''"),
    ({"storage_type": "FILE", "storage_path": 3}, TypeError, "storage_path=3"),
    ({"storage_type": "FILE", "storage_path": "/tmp/x", "storage_size": 0}, ValueError,
     "storage_size"),
])
def test_storage_option_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kre.StorageOption(**kwargs)


@both
def test_storage_option_round_trip():
    option = kre.StorageOption("FILE", storage_path="/tmp/kre_x", storage_size=1 << 20)
    with kre.storage_root("/tmp"):
        again = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(option))
    assert again.get_config() == option.get_config()
    assert again.cache_bytes == 1 << 20


# Trains (the table by its own optimizer: its slots exist before the
# restore) and snapshots in a loop, saving what each snapshot must hold just
# before taking it; says READY once it has taken its first.
WRITER = """
import os, sys, numpy as np, keras, keras_rec_emb as kre
folder = sys.argv[1]
option = kre.EmbeddingVariableOption(num_shards=4, storage_option=kre.StorageOption(
    "FILE", storage_path=folder, storage_size=4096))
layer = kre.layers.EmbeddingVariable(4, ev_option=option, name="w",
                                     optimizer=kre.optimizers.Adagrad(0.1))
ids = keras.Input((), dtype="int32")
model = keras.Model(ids, layer(ids))
model.compile(optimizer=kre.optimizers.SGD(0.1), loss=lambda _, emb: keras.ops.sum(emb ** 2))
current = os.path.join(folder, "w_embeddings", "CURRENT")
if os.path.exists(current):
    layer.restore_snapshot()
rng = np.random.default_rng(os.getpid())
while True:
    x = rng.integers(0, 5000, size=256).astype(np.int32)
    model.train_on_batch(x, np.zeros(len(x), np.float32))
    data = layer.export()
    seq = int(open(current).read()[5:]) + 1 if os.path.exists(current) else 1
    tmp = os.path.join(folder, f"expect-{seq}.tmp.npz")
    np.savez(tmp, keys=data["keys"], values=data["values"],
             acc=data["slots"]["accumulator"])
    os.replace(tmp, os.path.join(folder, f"expect-{seq}.npz"))
    assert layer.snapshot() == seq
    print("READY", flush=True)
"""


@both
def test_a_killed_snapshot_never_destroys_the_previous_one(tmp_path):
    """A writer (WRITER) of this test's backend is killed with
    SIGKILL at a random point after its first snapshot, three times; each
    time the latest complete snapshot restores exactly, and the next writer
    goes on from it."""
    import signal
    import time

    rng = np.random.default_rng(3)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND=keras.config.backend(),
               JAX_PLATFORMS="cpu")
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            line = proc.stdout.readline().strip()
            assert line == b"READY", proc.stderr.read()[-2000:] if proc.poll() else line
            time.sleep(0.3 + rng.random() * 1.5)
        finally:
            proc.send_signal(signal.SIGKILL)
            code = proc.wait(timeout=60)
        assert code == -signal.SIGKILL, proc.stderr.read()[-2000:]  # not a crash
        seq = int((tmp_path / "w_embeddings" / "CURRENT").read_text()[5:])
        expect = np.load(tmp_path / f"expect-{seq}.npz")
        layer = EmbeddingVariable(4, name="w", optimizer=kre.optimizers.Adagrad(0.1),
                                  ev_option=kre.EmbeddingVariableOption(
                                      num_shards=4, storage_option=file_option(tmp_path)))
        layer.build()
        assert layer.restore_snapshot() == len(expect["keys"])
        data = layer.export()
        a, b = np.argsort(expect["keys"]), np.argsort(data["keys"])
        np.testing.assert_array_equal(expect["keys"][a], data["keys"][b])
        np.testing.assert_array_equal(expect["values"][a], data["values"][b])
        np.testing.assert_array_equal(expect["acc"][a], data["slots"]["accumulator"][b])
        del layer, data  # releases the folder for the next writer
        gc.collect()


_FULL_DISK_CHILD = r"""
import resource, signal, sys
import numpy as np
import tensorflow as tf
import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

path, limit = sys.argv[1], int(sys.argv[2])
option = kre.EmbeddingVariableOption(storage_option=kre.StorageOption(
    "FILE", storage_path=path, storage_size=4096), num_shards=1)
layer = EmbeddingVariable(16, ev_option=option, name="full")
layer(np.array([0], np.int64), training=True)
first = layer.table.export()["values"].copy()
# From here on no file of this process may grow past `limit` bytes: a write
# past it fails with EFBIG, as a write to a full disk fails with ENOSPC.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
try:
    for start in range(0, 400_000, 20_000):
        layer(np.arange(start, start + 20_000, dtype=np.int64), training=True)
    print("NO ERROR")
except tf.errors.OpError as e:
    print("ERROR", type(e).__name__, " ".join(str(e).split()))
# Space again (the limit lifted): the table goes on, nothing was lost.
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
np.testing.assert_array_equal(layer.table.lookup(np.array([0], np.int64)).numpy(), first)
layer(np.arange(0, 1000, dtype=np.int64), training=True)
print("ALIVE", layer.table.size())
"""


def test_full_storage_path_names_it_and_the_process_survives(tmp_path):
    """A storage path that cannot take more bytes (here RLIMIT_FSIZE, which
    fails writes as a full disk does): a clear error naming the path and the
    reason, no crash; once there is room again the table goes on with every
    row it held."""
    store = tmp_path / "store"
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(store), str(1 << 20)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    out = result.stdout
    assert result.returncode == 0, out[-2000:] + result.stderr[-3000:]
    error = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert error, out
    assert "ResourceExhausted" in error[0], error[0]
    assert str(store) in error[0] and "File too large" in error[0], error[0]
    alive = [line for line in out.splitlines() if line.startswith("ALIVE")]
    assert alive and int(alive[0].split()[1]) >= 1000, out
