"""export_for_serving: SavedModels that stock TensorFlow serves in a process
that never imports keras_rec_emb, with the predictions of the Keras model;
the stock group lookup against the fused kernel; atomicity; bad input."""

import json
import os
import subprocess
import sys
import tempfile
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb import ops
from keras_rec_emb.backend.tensorflow import serving
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context
from keras_rec_emb.distribute.collective_tables import CollectiveShardedTable
from keras_rec_emb.distribute.ps_tables import ShardedEmbeddingTable
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

_SERVER = """
import json, sys, traceback
import numpy as np
import tensorflow as tf
for line in sys.stdin:
    path, inputs = json.loads(line)
    try:
        model = tf.saved_model.load(path)
        if isinstance(inputs, dict):
            args = [{k: tf.constant(v, tf.int64) for k, v in inputs.items()}]
        else:
            args = [tf.constant(inputs, tf.int64)]
        reply = {"out": np.asarray(model.serve(*args)).tolist()}
        del model
    except Exception:
        reply = {"error": traceback.format_exc()}
    reply["kre_imported"] = any(m.startswith("keras_rec_emb") for m in sys.modules)
    print(json.dumps(reply), flush=True)
"""


class _StockServer:
    """A Python that imports only TensorFlow (not even the repository is on
    its path) and serves each SavedModel it is sent: one TensorFlow start
    for every serving test of this module."""

    def __init__(self):
        self.proc = None

    def serve(self, path, inputs):
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, PYTHONPATH="")
            self.stderr = tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env, cwd="/")
        self.proc.stdin.write(json.dumps([path, inputs]) + "\n")
        self.proc.stdin.flush()
        lines = []
        reader = threading.Thread(target=lambda: lines.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=300)
        if not lines or not lines[0]:
            self.stderr.seek(0)
            tail = self.stderr.read()[-3000:]
            self.stop()
            raise AssertionError(f"the serving process gave no answer: {tail}")
        return json.loads(lines[0])

    def stop(self):
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()  # by its pid
            self.proc.wait(timeout=30)
            self.proc.stdin.close()
            self.proc.stdout.close()
            self.stderr.close()
            self.proc = None


_STOCK_SERVER = _StockServer()


@pytest.fixture(scope="module", autouse=True)
def _stop_the_stock_server():
    yield
    _STOCK_SERVER.stop()


def serve_elsewhere(path, inputs):
    """Runs the SavedModel in a Python that never imported keras_rec_emb."""
    result = _STOCK_SERVER.serve(path, inputs)
    assert "error" not in result, result["error"][-3000:]
    assert result["kre_imported"] is False
    return np.asarray(result["out"], np.float32)


def test_embedding_variable_model_serves_without_the_package(tmp_path):
    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int64")
    ev64 = EmbeddingVariable(4, combiner="mean", name="ev64")
    ev32 = EmbeddingVariable(3, combiner="sum", key_dtype="int32", name="ev32")
    x = keras.layers.Concatenate()([ev64(ids), ev32(ids)])
    model = keras.Model(ids, keras.layers.Dense(2)(x))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    train = np.random.default_rng(0).integers(0, 50, (64, 3))
    model.fit(train, np.zeros((64, 2)), batch_size=16, epochs=2, verbose=0)
    # Seen ids, unseen ids (initializer rows), negative ids. (An id beyond
    # int32 is refused by the int32 table instead of wrapping onto a key.)
    query = [[1, 2, 3], [10**9, 7, -5], [49, 49, 0]]
    want = model.predict(np.array(query), verbose=0)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    np.testing.assert_allclose(serve_elsewhere(path, query), want, rtol=1e-5, atol=1e-6)


class ServedTower(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(x)


class ServedRanker(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.user = EmbeddingVariable(4, combiner="mean", name="user")
        self.item = EmbeddingVariable(4, key_dtype="int32", name="item")
        self.tower = ServedTower()

    def call(self, inputs):
        item = keras.ops.reshape(self.item(inputs["item"]), (-1, 4))
        return self.tower(keras.ops.concatenate([self.user(inputs["user"]), item], axis=-1))


def test_a_subclassed_model_exports_without_an_input_signature(tmp_path):
    """Its ids are exported with the dtypes of its first call, not Keras's
    float `input_dtype` (which the tables refuse and which would round ids
    above 2**24)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = {"user": rng.integers(0, 10**12, (32, 3)),
         "item": rng.integers(0, 2**31 - 1, (32, 1)).astype(np.int32)}
    model = ServedRanker()
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.fit(x, rng.normal(size=(32, 1)), batch_size=8, verbose=0)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    served = tf.saved_model.load(path)
    spec = served.serve.concrete_functions[0].structured_input_signature
    (inputs,), _ = spec
    assert {k: s.dtype for k, s in inputs.items()} == {"user": tf.int64, "item": tf.int32}
    query = {"user": x["user"][:4], "item": x["item"][:4]}
    np.testing.assert_allclose(
        served.serve({k: tf.constant(v) for k, v in query.items()}).numpy(),
        model.predict(query, verbose=0), rtol=1e-5, atol=1e-6)


def test_filtered_table_serves_no_permission_value(tmp_path):
    opt = kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(filter_freq=3))
    ev = EmbeddingVariable(2, combiner=None, ev_option=opt, name="filtered")
    ids = keras.Input((1,), dtype="int64")
    model = keras.Model(ids, ev(ids))
    for _ in range(3):
        model(np.array([[1]]), training=True)  # admitted
    model(np.array([[2]]), training=True)  # counted once, not admitted
    query = [[1], [2], [3]]
    want = model.predict(np.array(query), verbose=0)
    assert np.all(want[1:] == 0.0) and np.any(want[0] != 0.0)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    np.testing.assert_allclose(serve_elsewhere(path, query), want, rtol=1e-6)


def test_group_embedding_model_serves_without_the_package(tmp_path):
    keras.utils.set_random_seed(1)
    shared = EmbeddingVariable(4, name="shared")
    dense = keras.layers.Embedding(100, 4, name="dense")
    group = GroupEmbedding({
        "a": FeatureSpec(shared, combiner="sum"),
        "b": FeatureSpec(shared, combiner="mean", max_norm=0.05),
        "c": FeatureSpec(dense, combiner="sqrtn", default_id=3),
        "d": FeatureSpec(EmbeddingVariable(4, name="seq"), sequence=True),
    })
    inputs = {k: keras.Input((3,), dtype="int64", name=k) for k in "abcd"}
    outs = group(inputs)
    x = keras.layers.Concatenate()([outs["a"], outs["b"], outs["c"],
                                    keras.ops.max(outs["d"], axis=1)])
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    rng = np.random.default_rng(1)
    batch = {k: rng.integers(-1, 30, (32, 3)) for k in "abcd"}
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    model.fit(batch, np.ones((32, 1)), batch_size=8, verbose=0)
    query = {k: rng.integers(-1, 60, (5, 3)).tolist() for k in "abcd"}
    query["c"][0] = [-1, -1, -1]  # an empty row: default_id
    want = model.predict({k: np.array(v) for k, v in query.items()}, verbose=0)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    np.testing.assert_allclose(serve_elsewhere(path, query), want, rtol=1e-5, atol=1e-6)


def test_export_traces_the_model_once_plus_the_save_trace(tmp_path, monkeypatch):
    """The stock tables are made while the endpoint first traces; made as
    plain `tf.Variable`s, tf.function saw variables created by that trace
    and traced the whole model again (3 traces, a third of the export time
    of a large model, instead of the endpoint's and the save's own)."""
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(4, combiner="sum", name="ev")
    group = GroupEmbedding({"g": FeatureSpec(EmbeddingVariable(4, name="gt"), combiner="mean")})
    x = keras.layers.Concatenate()([ev(ids), group({"g": ids})["g"]])
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.fit(np.arange(48).reshape(16, 3), np.ones(16), batch_size=8, verbose=0)
    traces = []
    for layer in (ev, group):
        call = layer.call
        monkeypatch.setattr(layer, "call",
                            lambda *a, _call=call, _name=layer.name, **k:
                            traces.append(_name) or _call(*a, **k))
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    assert sorted(traces) == sorted(["ev", "ev", group.name, group.name]), traces
    query = [[1, 2, 3], [100, 4, 5]]
    np.testing.assert_allclose(serve_elsewhere(path, query),
                               model.predict(np.array(query), verbose=0), rtol=1e-5, atol=1e-6)


def test_stacked_group_embedding_model_serves_without_the_package(tmp_path):
    """GroupEmbedding fed one stacked [batch, F, L] tensor: the served graph
    slices it with stock ops (no KRE>UnstackFeatureIds)."""
    group = GroupEmbedding({f"f{j}": FeatureSpec(EmbeddingVariable(3, name=f"t{j}"),
                                                 combiner=c)
                            for j, c in enumerate(("sum", "mean", "sqrtn"))},
                           output_mode="concat")
    ids = keras.Input((3, 2), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(group(ids)))
    rng = np.random.default_rng(2)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    model.fit(rng.integers(-1, 30, (16, 3, 2)), np.ones((16, 1)), verbose=0)
    query = rng.integers(-1, 40, (4, 3, 2))
    query[0] = -1
    want = model.predict(query, verbose=0)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    np.testing.assert_allclose(serve_elsewhere(path, query.tolist()), want,
                               rtol=1e-5, atol=1e-6)


def test_adaptive_embedding_model_serves_without_the_package(tmp_path):
    keras.utils.set_random_seed(2)
    layer = kre.layers.AdaptiveEmbedding(3, hash_bucket_size=7, promote_threshold=2,
                                         combiner="sum")
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, layer(ids))
    for _ in range(2):
        model(np.array([[5, 6], [5, 9]]), training=True)  # 5 promoted, 6 and 9 not
    query = [[5, 6], [9, 11], [5, 5]]
    want = model.predict(np.array(query), verbose=0)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    np.testing.assert_allclose(serve_elsewhere(path, query), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_stock_group_lookup_matches_the_fused_kernel(combiner, matrix_initializer):
    """The stock-op path (what a served model runs) against KRE>GroupLookup,
    with weights, invalid ids, empty rows, default ids, max_norm, sequences,
    a filtered table and a dense variable."""
    rng = np.random.default_rng(3)
    matrix = rng.normal(size=(5, 3)).astype(np.float32)
    plain = EmbeddingVariable(3, initializer=matrix_initializer(matrix),
                              ev_option=kre.EmbeddingVariableOption(
                                  init_option=kre.InitializerOption(default_value_dim=5)))
    filtered = EmbeddingVariable(3, ev_option=kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(filter_freq=2)))
    dense = keras.Variable(rng.normal(size=(20, 3)).astype(np.float32))
    params = [plain, plain, filtered, dense, plain]
    rows = [[[1, 2, -1], [], [7, 7]], [[3], [4, 5], []], [[1, 1, 2], [2], [9]],
            [[0, 19], [], [3]], [[8, 2], [1], []]]
    ids = [tf.ragged.constant(r, dtype=tf.int64) for r in rows]
    weights = [tf.ragged.constant([[float(len(x)) + 0.5 * j for j in range(len(x))] for x in r])
               for r in rows]
    ops.group_embedding_lookup_sparse([plain, filtered], [ids[0], ids[2]], ["sum"] * 2,
                                      training=True)  # rows to read; key 1 admitted
    kwargs = dict(sp_weights=weights, is_sequence=[False, False, False, False, True],
                  max_norm=[None, 0.5, None, 1.0, 0.7], default_id=[None, 6, 3, 2, None])
    want = ops.group_embedding_lookup_sparse(params, ids, [combiner] * 5, **kwargs)
    stock = serving._StockTables()
    with _serving_context.stock_tables(stock.get):
        # One trace: its graph is checked, its call gives the values.
        served = tf.function(lambda: ops.group_embedding_lookup_sparse(
            params, ids, [combiner] * 5, **kwargs)).get_concrete_function()
        got = served()
    assert serving._custom_ops(served.graph.as_graph_def()) == set()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("splits", [[], [1, 2, 3], [0, 3, 2], [0, 1, 2]],
                         ids=["no entry", "not from 0", "decreasing", "short of the values"])
def test_served_group_lookup_refuses_malformed_row_splits(splits):
    """A served request's ragged ids arrive as (values, row_splits) that
    nothing else checks: malformed splits are an InvalidArgument, never rows
    read from the wrong places."""
    table = EmbeddingVariable(3)
    stock = serving._StockTables()
    with _serving_context.stock_tables(stock.get):
        served = tf.function(lambda v, s: ops.group_embedding_lookup_sparse(
            [table], [tf.RaggedTensor.from_row_splits(v, s, validate=False)], ["sum"])[0],
            input_signature=[tf.TensorSpec([None], tf.int64)] * 2)
        good = served(tf.constant([1, 2, 3], tf.int64), tf.constant([0, 1, 3], tf.int64))
        assert good.shape == (2, 3)
        with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits of a ragged input"):
            served(tf.constant([1, 2, 3], tf.int64), tf.constant(splits, tf.int64))


def _graph_ops(fn, *specs):
    """The op types of `fn` traced over `specs`, its nested functions included."""
    graph = tf.function(fn).get_concrete_function(*specs).graph.as_graph_def()
    found = {n.op for n in graph.node}
    for function in graph.library.function:
        found.update(n.op for n in function.node_def)
    return found


class _Probe(keras.layers.Layer):
    """Passes its input through; traced while `_PROBES` holds a callable, it
    runs that callable once, in the tracing thread."""

    def call(self, x):
        if _PROBES:
            _PROBES.pop()()
        return x


_PROBES = []


def test_export_reads_stock_twins_in_its_thread_only_without_touching_tables(tmp_path):
    """While `export_for_serving` traces the model, a trainer in another
    thread keeps the package's ops: its lookups of the same tables (the
    table's own `lookup`, an inference and a training call of the layers)
    trace `KRE>` ops and insert keys, while the export's own thread reads
    the stock twins. No table gets a `lookup` of its own."""
    keras.utils.set_random_seed(2)
    ids = keras.Input((3,), dtype="int64")
    pooled = EmbeddingVariable(4, combiner="sum", name="pooled")  # the fused group path
    rows = EmbeddingVariable(2, name="rows")  # the table's own lookup
    x = _Probe()(ids)
    x = keras.layers.Concatenate()([pooled(x), keras.layers.Flatten()(rows(x))])
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model(np.array([[1, 2, 3]]), training=True)
    tables = [pooled.table, rows.table]
    spec = tf.TensorSpec([None, 3], tf.int64)
    seen = {}

    def train_elsewhere():
        try:
            seen["trainer_stock_reader"] = _serving_context.stock_reader()
            for layer in (pooled, rows):
                seen[f"{layer.name}_training"] = _graph_ops(
                    lambda z, layer=layer: layer(z, training=True), spec)
                seen[f"{layer.name}_inference"] = _graph_ops(
                    lambda z, layer=layer: layer(z, training=False), spec)
                seen[f"{layer.name}_table"] = _graph_ops(layer.table.lookup, spec)
                layer(np.array([[40, 41, 42]]), training=True)  # eager: inserts
            seen["sizes"] = [t.size() for t in tables]
        except BaseException as e:  # reported by the test, not lost in the thread
            seen["error"] = e

    def probe():  # in the export's thread, while it traces
        seen["own_lookup"] = [t.name for t in tables if "lookup" in vars(t)]
        seen["export_table"] = _graph_ops(rows.table.lookup, spec)
        trainer = threading.Thread(target=train_elsewhere)
        trainer.start()
        trainer.join(timeout=300)
        seen["joined"] = not trainer.is_alive()

    _PROBES.append(probe)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    assert not _PROBES, "the probe did not run while the export traced"
    assert seen.pop("joined")
    assert "error" not in seen, seen["error"]
    assert seen["own_lookup"] == []
    assert not any(op.startswith("KRE>") for op in seen["export_table"])
    assert "LookupTableFindV2" in seen["export_table"]
    assert seen["trainer_stock_reader"] is None
    for key in ("pooled_training", "pooled_inference", "rows_training", "rows_inference",
                "rows_table", "pooled_table"):
        assert any(op.startswith("KRE>") for op in seen[key]), (key, seen[key])
        assert "LookupTableFindV2" not in seen[key], key
    assert seen["sizes"] == [6, 6]  # 1, 2, 3 from the model's call; 40, 41, 42 inserted
    assert all("lookup" not in vars(t) for t in tables)
    assert _serving_context.stock_reader() is None
    query = np.array([[1, 40, 7]])
    loaded = tf.saved_model.load(path)  # kept: its functions read its variables
    np.testing.assert_allclose(loaded.serve(tf.constant(query)),
                               model.predict(query, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", [EmbeddingTable, ShardedEmbeddingTable,
                                  CollectiveShardedTable])
def test_every_table_kind_reads_its_stock_twin_when_serving(kind):
    """Each table kind's `lookup` consults the one serving state: inside
    `stock_tables` it reads `read(table)` and refuses to insert; outside it
    runs its own code. (Called unbound on a stand-in object: a sharded
    table needs devices or workers, and inside the state its own code must
    not run at all.)"""
    class Twin:
        def lookup(self, keys):
            return ("twin", keys)

    table = object()
    read_for = []

    def read(t):
        read_for.append(t)
        return Twin()

    with _serving_context.stock_tables(read):
        assert kind.lookup(table, "keys") == ("twin", "keys")
        assert kind.lookup(table, "keys", insert=False) == ("twin", "keys")
        with pytest.raises(ValueError, match=r"inference only \(insert=False\)"):
            kind.lookup(table, "keys", insert=True)
        with _serving_context.stock_tables(None):  # nested: the package's ops again
            with pytest.raises(AttributeError):  # its own code, on no table
                kind.lookup(table, "keys")
        assert _serving_context.stock_reader() is read
    assert read_for == [table, table]
    assert _serving_context.stock_reader() is None
    with pytest.raises(AttributeError):
        kind.lookup(table, "keys")


def test_failed_export_keeps_the_previous_one(tmp_path):
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, EmbeddingVariable(2, combiner="sum")(ids))
    model(np.array([[1, 2]]), training=True)
    path = str(tmp_path / "serving")
    kre.export_for_serving(model, path)
    before = sorted(os.listdir(path))
    with pytest.raises(Exception):  # a signature the model cannot take
        kre.export_for_serving(model, path, input_signature=[tf.TensorSpec([None, 2, 2],
                                                                            tf.string)])
    assert sorted(os.listdir(path)) == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")] == []
    np.testing.assert_allclose(serve_elsewhere(path, [[1, 2]]),
                               model.predict(np.array([[1, 2]]), verbose=0), rtol=1e-6)


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        kre.export_for_serving("model", str(tmp_path / "x"))
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, EmbeddingVariable(2, combiner="sum")(ids))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="`filepath` must be a directory"):
        kre.export_for_serving(model, str(a_file))


def test_empty_tables_serve_what_they_give_in_process(tmp_path):
    """Tables with no rows (never trained; a filter that admitted nothing
    yet; every key evicted) serve their initializer rows or
    `no_permission_value` in stock TensorFlow, as `predict` gives them."""
    keras.utils.set_random_seed(5)
    ids = keras.Input((3,), dtype="int64")
    untrained = EmbeddingVariable(4, combiner="sum", name="untrained")
    filtered = EmbeddingVariable(3, combiner="mean", name="filtered", ev_option=(
        kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(filter_freq=5),
                                    init_option=kre.InitializerOption(
                                        default_value_no_permission=0.25))))
    evicted = EmbeddingVariable(2, combiner="sum", name="evicted", ev_option=(
        kre.EmbeddingVariableOption(evict_option=kre.GlobalStepEvict(steps_to_live=1))))
    group = GroupEmbedding({"g": FeatureSpec(EmbeddingVariable(3, name="grouped"),
                                             combiner="sqrtn")})
    x = keras.layers.Concatenate()([untrained(ids), filtered(ids), evicted(ids),
                                    group({"g": ids})["g"]])
    model = keras.Model(ids, keras.layers.Dense(2)(x))
    filtered(np.array([[1, 2, 3]]), training=True)  # counted once: not admitted
    evicted(np.array([[1, 2, 3]]), training=True)
    assert evicted.evict(step=100) == 3
    for layer in (untrained, filtered, evicted):
        assert layer.table.size() == 0
    query = [[1, 2, 3], [7, -4, 10**12], [0, 0, 0]]
    want = model.predict(np.array(query), verbose=0)
    assert np.all(np.isfinite(want)) and np.any(want != 0.0)
    path = kre.export_for_serving(model, str(tmp_path / "serving"))
    np.testing.assert_allclose(serve_elsewhere(path, query), want, rtol=1e-5, atol=1e-6)


_EXPORT_GROWTH = r"""
import ctypes, gc, json, os, sys, tempfile
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import keras
import keras_rec_emb as kre

libc = ctypes.CDLL("libc.so.6")

def rss():
    gc.collect()
    libc.malloc_trim(0)  # freed heap goes back to the OS: RSS shows what is kept
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

keys = int(sys.argv[1])
ids = keras.Input((1,), dtype="int64")
ev = kre.layers.EmbeddingVariable(4, combiner="sum", name="ev")
model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
ev.table.import_({"keys": np.arange(keys) * 7919, "values": np.ones((keys, 4), np.float32)})
path = os.path.join(tempfile.mkdtemp(), "served")
sizes = []
for _ in range(13):  # three to warm up one-time caches and pools, then ten
    kre.export_for_serving(model, path)
    sizes.append(rss())
print(json.dumps({"bytes_per_key_per_export": (sizes[-1] - sizes[2]) / 10 / keys}))
"""


def test_repeated_exports_keep_no_memory_per_key():
    """Each export made a stock hash table in TensorFlow's resource manager
    that lived until the process ended (~46 bytes per key per export): a
    trainer exporting every hour grew without bound."""
    r = subprocess.run([sys.executable, "-c", _EXPORT_GROWTH, "200000"], capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    growth = json.loads(r.stdout.strip().splitlines()[-1])["bytes_per_key_per_export"]
    assert growth < 4, f"{growth:.1f} bytes per key kept by each export"
