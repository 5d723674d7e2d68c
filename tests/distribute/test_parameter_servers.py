"""Asynchronous parameter-server tables: 2 PS and 2 worker processes on
127.0.0.1 (TensorFlow's gRPC runtime carries the traffic)."""

import json
import glob
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import variables as tf_variables
from keras_rec_emb.distribute import ps_tables

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import ps_worker  # noqa: E402
from _net import free_ports  # noqa: E402


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # by its pid
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _run(cmd, log, timeout):
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    return proc


def _wait_ok(proc, log, timeout, servers=(), server_logs=()):
    """Waits for `proc`; on failure says how it and the servers ended,
    with the end of each one's log."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    if rc == 0:
        return
    with open(log) as f:
        text = f.read()
    report = [f"{proc.args} ended with {rc}:\n{text[-3000:]}"]
    for server, server_log in zip(servers, server_logs):
        with open(server_log) as f:
            tail = f.read()[-1500:]
        report.append(f"server {server.args[-1]}: exit {server.poll()} (None: running)\n{tail}")
    raise AssertionError("\n".join(report))


def expected_table(default_values):
    """Initial rows minus the sum of both workers' SGD pushes (order-free),
    and every key's lookup count."""
    pushes, counts = {}, {}
    all_ids, all_weights = ps_worker.all_data()
    for task in (0, 1):
        rows = ps_worker.worker_rows(task)
        ids, weights = all_ids[rows], all_weights[rows]
        for start in range(0, len(ids), ps_worker.BATCH):
            b_ids = ids[start:start + ps_worker.BATCH]
            b_w = weights[start:start + ps_worker.BATCH]
            for row, w in zip(b_ids, b_w):
                for key in row:
                    pushes[int(key)] = pushes.get(int(key), 0.0) + float(w) / len(b_ids)
                    counts[int(key)] = counts.get(int(key), 0) + 1
    keys = np.array(sorted(pushes), np.int64)
    init = default_values[keys % default_values.shape[0]]
    values = init - ps_worker.LR * np.array([pushes[k] for k in keys])[:, None]
    return keys, values.astype(np.float32), np.array([counts[k] for k in keys])


@pytest.mark.multiprocess
def test_two_ps_two_workers_sum_of_pushes(tmp_path):
    ps_ports = free_ports(2)
    ps = ",".join(f"127.0.0.1:{p}" for p in ps_ports)
    worker_ports = free_ports(3)
    ps_worker.write_parquet(tmp_path / "train.parquet")
    procs = []
    try:
        for task in (0, 1):
            procs.append(_run([sys.executable, "-m", "keras_rec_emb.distribute.ps",
                               "--ps", ps, "--task", str(task)],
                              tmp_path / f"ps{task}.log", 60))
        workers = []
        # Both workers start together, in no order (the PS tasks hold an
        # eager context of their own: see ps_tables._hold_own_context).
        for task in (0, 1):
            workers.append(_run(
                [sys.executable, os.path.join(HERE, "ps_worker.py"), "train", "--ps", ps,
                 "--worker", f"127.0.0.1:{worker_ports[task]}", "--task", str(task),
                 "--out", str(tmp_path)], tmp_path / f"worker{task}.log", 300))
        procs += workers
        for task, proc in enumerate(workers):
            _wait_ok(proc, tmp_path / f"worker{task}.log", 300, servers=procs[:2],
                     server_logs=[tmp_path / f"ps{i}.log" for i in (0, 1)])
        checker = _run([sys.executable, os.path.join(HERE, "ps_worker.py"), "check",
                        "--ps", ps, "--worker", f"127.0.0.1:{worker_ports[2]}",
                        "--task", "2", "--out", str(tmp_path)], tmp_path / "check.log", 300)
        procs.append(checker)
        _wait_ok(checker, tmp_path / "check.log", 300)
    finally:
        _stop(procs)

    for task in (0, 1):
        placed = (tmp_path / f"placed_{task}.txt").read_text().split()
        assert placed == ["/job:ps/replica:0/task:0/device:CPU:0",
                          "/job:ps/replica:0/task:1/device:CPU:0"]
    got = np.load(tmp_path / "table.npz")
    keys, values, counts = expected_table(got["default_values"])
    order = np.argsort(got["keys"])
    np.testing.assert_array_equal(got["keys"][order], keys)
    np.testing.assert_allclose(got["values"][order], values, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["freqs"][order], counts)
    # Both PS tasks hold rows, exactly the keys that hash to them.
    sizes = got["shard_sizes"]
    assert sizes.sum() == len(keys) and sizes.min() > 0
    np.testing.assert_array_equal(
        np.bincount(ps_tables.shard_of_numpy(keys, 2), minlength=2), sizes)

    # The checker's model.save holds the ordinary format: it loads into one
    # process without parameter servers (2 shards -> 1 table).
    model = keras.saving.load_model(tmp_path / "ps_model.keras",
                                    custom_objects={"linear_loss": ps_worker.linear_loss})
    table = model.get_layer("emb").table
    assert isinstance(table, tf_variables.EmbeddingTable)
    data = table.export()
    order = np.argsort(data["keys"])
    np.testing.assert_allclose(data["values"][order], values, rtol=1e-5, atol=1e-5)
    ids = keys[:6].reshape(2, 3)
    np.testing.assert_allclose(
        model.predict(ids, verbose=0),
        values[:6].reshape(2, 3, -1).sum(axis=(1, 2)), rtol=1e-5, atol=1e-5)


def test_workers_read_disjoint_parts_of_the_parquet_file(tmp_path):
    """Input sharding: each worker's ParquetDataset partition, together
    exactly the file's rows once."""
    path = str(tmp_path / "train.parquet")
    ps_worker.write_parquet(path)
    all_ids, all_weights = ps_worker.all_data()
    seen = []
    for task in (0, 1):
        ids = np.concatenate([i.numpy() for i, _ in ps_worker.worker_dataset(path, task)])
        rows = ps_worker.worker_rows(task)
        np.testing.assert_array_equal(ids, all_ids[rows])
        seen.append(rows)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(len(all_ids)))


def test_unreachable_parameter_server_names_the_address():
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    with pytest.raises(ConnectionError, match=address):
        kre.distribute.connect([address], "127.0.0.1:0", timeout=1.0)


def test_ps_command_checks_task_index(capsys):
    import keras_rec_emb_cli

    with pytest.raises(SystemExit) as e:
        keras_rec_emb_cli.main(["ps", "--ps", "127.0.0.1:1,127.0.0.1:2", "--task", "2"])
    assert e.value.code == 2
    assert "--task must be in [0, 2)" in capsys.readouterr().err


@pytest.mark.parametrize("devices, error", [
    ("/job:ps/task:0", ValueError), ([], ValueError), ([3], TypeError), ([""], TypeError)])
def test_parameter_servers_bad_devices(devices, error):
    with pytest.raises(error, match="devices"):
        with kre.distribute.parameter_servers(devices):
            pass


def test_sharded_table_in_one_process_matches_one_table():
    """Two shards on the local CPU: lookups, gradients through the stitch,
    export/import across shard counts (2 -> 3 -> 1) keep every row."""
    init = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    sharded = ps_tables.ShardedEmbeddingTable(["/cpu:0", "/device:CPU:0"], 3, "int64", init,
                                              name="sharded_local", track_meta=True)
    plain = tf_variables.EmbeddingTable(3, "int64", init, name="plain_local",
                                         track_meta=True)
    keys = tf.constant([[5, 9, 5], [100, 2, 77]], tf.int64)
    for table in (sharded, plain):
        with tf.GradientTape() as tape:
            rows = table.lookup(keys, insert=True)
            loss = tf.reduce_sum(rows * tf.reshape(tf.range(18, dtype=tf.float32), [2, 3, 3]))
        grads = tape.gradient(loss, [v for v in getattr(table, "variables")])
        for var, grad in zip(table.variables, grads):
            if grad is not None:
                kre._ops.sparse_apply(var.handle, grad.indices, grad.values, "sgd",
                                      {"learning_rate": 0.01, "decay": 0.0}, 1, [])
    np.testing.assert_allclose(sharded.lookup(keys).numpy(), plain.lookup(keys).numpy())
    assert sharded.size() == plain.size() == 5
    assert min(s.size() for s in sharded.shards) > 0
    assert sharded.stats()["size"] == 5
    data = sharded.export()
    three = ps_tables.ShardedEmbeddingTable(["/cpu:0"] * 3,
                                            3, "int64", init, name="three_local")
    three.import_(data)
    one = tf_variables.EmbeddingTable(3, "int64", np.zeros((1, 3), np.float32), name="one")
    one.import_(three.export())
    for table in (three, one):
        np.testing.assert_allclose(table.lookup(keys).numpy(), plain.lookup(keys).numpy())
    np.testing.assert_array_equal(np.sort(one.export()["freqs"]),
                                  np.sort(plain.export()["freqs"]))


def _group_model(devices):
    import keras

    def build():
        ids = {"a": keras.Input(shape=(3,), dtype="int64", name="a"),
               "b": keras.Input(shape=(2,), dtype="int64", name="b")}
        table = kre.layers.EmbeddingVariable(
            4, name="group_sharded",
            initializer=keras.initializers.RandomUniform(-1, 1, seed=3))
        group = kre.layers.GroupEmbedding(
            {"a": kre.layers.FeatureSpec(table, combiner="mean"),
             "b": kre.layers.FeatureSpec(table, combiner="sum")}, output_mode="concat")
        out = keras.layers.Dense(1, kernel_initializer="ones", name="dense")(group(ids))
        model = keras.Model(ids, out)
        model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
        return model, table

    if devices is None:
        return build()
    with kre.distribute.parameter_servers(devices):
        return build()


def test_group_embedding_over_sharded_tables_matches_one_table():
    """GroupEmbedding over a table sharded over 2 devices (each table's rows
    from its sharded lookup, combined with stock ops) trains to the same
    rows, slots, counts and predictions as over one table (fused kernel)."""
    rng = np.random.default_rng(4)
    x = {"a": rng.integers(0, 30, (16, 3)), "b": rng.integers(20, 50, (16, 2))}
    y = rng.uniform(size=(16, 1)).astype(np.float32)
    got = []
    for devices in (None, ["/cpu:0", "/cpu:0"]):
        model, table = _group_model(devices)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        data = table.table.export()
        order = np.argsort(data["keys"])
        got.append((data, order, model.predict(x, verbose=0)))
        assert getattr(table.table, "num_shards", 1) == (1 if devices is None else 2)
    (one, o1, p1), (two, o2, p2) = got
    np.testing.assert_array_equal(one["keys"][o1], two["keys"][o2])
    np.testing.assert_array_equal(one["freqs"][o1], two["freqs"][o2])
    np.testing.assert_allclose(one["values"][o1], two["values"][o2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one["slots"]["accumulator"][o1],
                               two["slots"]["accumulator"][o2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p1, p2, rtol=1e-5, atol=1e-6)
    assert np.abs(one["slots"]["accumulator"]).max() > 0.1  # it trained


def test_checkpoint_reshards_on_restore(tmp_path):
    """tf.train.Checkpoint of a sharded table is the ordinary per-table
    format: 1 -> 2 -> 3 -> 1 shards keep every row, slot and count."""
    init = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    keys = tf.constant(np.arange(-20, 40, 3), tf.int64)

    def make(n, name):
        if n == 1:
            return tf_variables.EmbeddingTable(3, "int64", init, name=name, track_meta=True)
        return ps_tables.ShardedEmbeddingTable(["/cpu:0"] * n, 3, "int64", init, name=name,
                                               track_meta=True)

    first = make(1, "ckpt_one")
    first.add_slot("accumulator", 0.5)
    first.lookup(keys, insert=True)
    kre._ops.sparse_apply(first.handle, keys, tf.ones([keys.shape[0], 3]), "adagrad",
                          {"learning_rate": 0.1, "decay": 0.0, "epsilon": 1e-7}, 1,
                          ["accumulator"])
    want = first.export()
    order = np.argsort(want["keys"])
    path = tf.train.Checkpoint(table=first).write(str(tmp_path / "one"))
    for n, name in ((2, "ckpt_two"), (3, "ckpt_three"), (1, "ckpt_back")):
        table = make(n, name)
        table.add_slot("accumulator", 0.5)
        tf.train.Checkpoint(table=table).read(path).assert_consumed()
        got = table.export()
        mine = np.argsort(got["keys"])
        np.testing.assert_array_equal(got["keys"][mine], want["keys"][order])
        np.testing.assert_allclose(got["values"][mine], want["values"][order])
        np.testing.assert_array_equal(got["freqs"][mine], want["freqs"][order])
        np.testing.assert_allclose(got["slots"]["accumulator"][mine],
                                   want["slots"]["accumulator"][order])
        if n > 1:
            assert min(s.size() for s in table.shards) > 0
        path = tf.train.Checkpoint(table=table).write(str(tmp_path / name))


def test_model_checkpoint_from_sharded_layer_restores_into_one_table(tmp_path):
    def model(devices=None):
        ids = keras.Input((2,), dtype="int64")
        layer = kre.layers.EmbeddingVariable(
            3, combiner="sum", name="ckpt_layer",
            initializer=keras.initializers.RandomUniform(seed=3))
        if devices:
            with kre.distribute.parameter_servers(devices):
                out = layer(ids)
        else:
            out = layer(ids)
        return keras.Model(ids, out), layer

    sharded, layer = model(["/cpu:0", "/cpu:0"])
    ids = np.array([[1, 2], [3, 900]], np.int64)
    sharded(ids, training=True)
    assert isinstance(layer.table, ps_tables.ShardedEmbeddingTable)
    path = tf.train.Checkpoint(model=sharded).write(str(tmp_path / "m"))
    plain, plain_layer = model()
    tf.train.Checkpoint(model=plain).read(path).assert_existing_objects_matched()
    assert plain_layer.table.size() == 4
    np.testing.assert_allclose(plain(ids).numpy(), sharded(ids).numpy())


def test_export_for_serving_of_a_sharded_table(tmp_path):
    """The SavedModel of a model with a sharded table reads its rows with
    stock TensorFlow ops (loaded in a process without this package)."""
    ids = keras.Input((2,), dtype="int64")
    with kre.distribute.parameter_servers(["/cpu:0", "/cpu:0"]):
        rows = kre.layers.EmbeddingVariable(3, combiner="mean", name="serve_sharded")(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(rows))
    x = np.array([[1, 2], [3, 900], [7, 7]], np.int64)
    model(x, training=True)
    kre.export_for_serving(model, str(tmp_path / "sm"))
    script = (
        "import json, tensorflow as tf\n"
        f"m = tf.saved_model.load({str(tmp_path / 'sm')!r})\n"
        f"print(json.dumps(m.serve(tf.constant({x.tolist()}, tf.int64)).numpy().ravel()"
        ".tolist()))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = np.array(json.loads(proc.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(served, model.predict(x, verbose=0).ravel(), rtol=1e-5)


def test_file_tier_snapshot_restores_only_into_its_shard_count(tmp_path):
    """A sharded file-tier table snapshots per shard; the same count restores
    every row, another count is refused naming both counts (a checkpoint
    reshards instead)."""
    init = np.random.default_rng(2).normal(size=(4, 3)).astype(np.float32)
    store = str(tmp_path / "tier")

    def make(n, tag):
        return ps_tables.ShardedEmbeddingTable(["/cpu:0"] * n, 3, "int64", init,
                                               name=f"snap_{tag}", storage_path=store)

    keys = tf.constant(np.arange(0, 50, 7), tf.int64)
    two = make(2, "a")
    assert two.storage_dir == os.path.abspath(store)
    want = two.lookup(keys, insert=True).numpy()
    assert len(two.snapshot()) == 2
    two.import_({"keys": np.zeros(0, np.int64), "values": np.zeros((0, 3), np.float32)})
    assert two.size() == 0
    # The replaced rows' segment files went with the import (none left in
    # the live directories to pile up or to collide with a restore's names).
    live = [f for f in glob.glob(os.path.join(store, "*", "live-*", "*.seg"))]
    assert live == []
    assert two.restore_snapshot() == keys.shape[0]
    np.testing.assert_allclose(two.lookup(keys).numpy(), want)

    # The same table name with 3 shards: its folders are not there, the 2's are.
    three = ps_tables.ShardedEmbeddingTable(["/cpu:0"] * 3, 3, "int64", init,
                                            name="snap_a", storage_path=str(tmp_path / "t3"))
    with pytest.raises(ValueError, match=r"saved with 2 shards and this table has 3 shards"):
        three.restore_snapshot(store)
    with pytest.raises(ValueError, match="No file-tier snapshot"):
        make(2, "b").restore_snapshot(str(tmp_path / "empty"))
    with pytest.raises(TypeError, match="path"):
        two.restore_snapshot(3)
