"""`model.export` SavedModels under every loader: TensorFlow 2's
`tf.saved_model.load` and the TF1 loader in a Session (what C++ model servers
run), in processes beside the live trainer, several versions in one process,
file-tier tables included. Each serves what `model.predict` gives."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding
from tests import _stacked_group

pytestmark = pytest.mark.tensorflow_only  # `model.export` SavedModels of this package's TF ops

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

# Loads each SavedModel of argv[1] (a JSON list) with the TF1 loader in a
# Session of its own, serves the batch in argv[2] twice (a table must live
# across `Session.run` calls), and prints the outputs.
_TF1_SERVE = r"""
import json, sys
import numpy as np
import tensorflow as tf
import keras_rec_emb  # registers the ops a model.export SavedModel runs
tf.compat.v1.disable_eager_execution()
paths, batch = json.loads(sys.argv[1]), np.load(sys.argv[2])
outs = []
for path in paths:
    graph = tf.Graph()
    sess = tf.compat.v1.Session(graph=graph)
    meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], path)
    sig = meta.signature_def["serving_default"]
    (inp,), (out,) = sig.inputs.values(), sig.outputs.values()
    first = sess.run(out.name, {inp.name: batch})
    second = sess.run(out.name, {inp.name: batch})
    assert np.array_equal(first, second), "the tables changed between runs"
    outs.append(first.tolist())
print(json.dumps(outs))
"""

# Loads each SavedModel of argv[1] with tf.saved_model.load, all kept alive
# together, and serves the batch in argv[2] with each.
_TF2_SERVE = r"""
import json, sys
import numpy as np
import tensorflow as tf
import keras_rec_emb  # registers the ops a model.export SavedModel runs
paths, batch = json.loads(sys.argv[1]), np.load(sys.argv[2])
loaded = [tf.saved_model.load(p) for p in paths]
print(json.dumps([m.serve(tf.constant(batch)).numpy().tolist() for m in loaded]))
"""


def serve_in_a_process(script, paths, batch, tmp_path):
    """Runs `script` on SavedModels `paths` in a fresh process; returns one
    output array per path."""
    np.save(tmp_path / "batch.npy", batch)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", script, json.dumps([str(p) for p in paths]),
                        str(tmp_path / "batch.npy")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [np.asarray(o, np.float32) for o in json.loads(r.stdout.strip().splitlines()[-1])]


def test_tf1_session_loader_serves_the_trained_tables(tmp_path):
    """Under the TF1 loader the graph's table-creating op runs at every
    `Session.run`: the tables served were new and empty (initializer rows),
    not those the restore filled, with no error."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((3,), dtype="int64")
    plain = EmbeddingVariable(4, combiner="mean", name="plain")
    filtered = EmbeddingVariable(2, combiner="sum", name="filtered", ev_option=(
        kre.EmbeddingVariableOption(filter_option=kre.CounterFilter(filter_freq=2))))
    group = GroupEmbedding({"g": FeatureSpec(EmbeddingVariable(3, name="grouped"),
                                             combiner="sum")})
    x = keras.layers.Concatenate()([plain(ids), filtered(ids), group({"g": ids})["g"]])
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=kre.optimizers.Adagrad(0.5), loss="mse")
    rng = np.random.default_rng(3)
    model.fit(rng.integers(0, 40, (64, 3)), rng.normal(size=(64, 1)), batch_size=16,
              epochs=3, verbose=0)
    batch = np.concatenate([rng.integers(0, 40, (6, 3)), rng.integers(40, 10**9, (2, 3))])
    want = model.predict(batch, verbose=0)
    path = tmp_path / "served"
    model.export(str(path), verbose=False)
    (got,) = serve_in_a_process(_TF1_SERVE, [path], batch, tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _file_tier_model(storage):
    opt = kre.EmbeddingVariableOption(storage_option=kre.StorageOption(
        "FILE", storage_path=str(storage), storage_size=4096))  # rows spill to files
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(8, combiner="sum", name="ev", ev_option=opt)
    model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.3), loss="mse")
    return model, ev


def test_file_tier_exports_load_beside_the_live_trainer(tmp_path):
    """A loaded `model.export` of a file-tier model took the trainer's
    storage_path lock: no server could load it while the trainer lived, in
    its process or another, nor load a second version in one process."""
    keras.utils.set_random_seed(4)
    storage = tmp_path / "store"
    model, ev = _file_tier_model(storage)
    rng = np.random.default_rng(4)
    batch = rng.integers(0, 3000, (16, 3))
    versions, wants = [], []
    for v in range(2):
        model.fit(rng.integers(0, 3000, (600, 3)), rng.normal(size=(600, 1)), batch_size=64,
                  verbose=0)
        assert ev.stats()["file_writes"] > 0  # rows really went to files
        wants.append(model.predict(batch, verbose=0))
        versions.append(tmp_path / "base" / str(v + 1))
        model.export(str(versions[-1]), verbose=False)
    assert not np.allclose(wants[0], wants[1])
    before = sorted(os.listdir(storage))
    # In the trainer's process, both versions at once.
    loaded = [tf.saved_model.load(str(p)) for p in versions]
    for m, want in zip(loaded, wants):
        np.testing.assert_allclose(m.serve(tf.constant(batch)).numpy(), want,
                                   rtol=1e-5, atol=1e-6)
    # Servers in other processes, while the trainer lives: both loaders.
    for script in (_TF2_SERVE, _TF1_SERVE):
        for got, want in zip(serve_in_a_process(script, versions, batch, tmp_path), wants):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The trainer's folder is untouched and still its own: it trains on and
    # snapshots.
    assert sorted(os.listdir(storage)) == before
    model.fit(batch, np.zeros((16, 1)), verbose=0)
    assert ev.snapshot() >= 0
    del loaded


# Feeds the SavedModel's serving signature directly, as TF Serving does
# (tf.function's own input check is skipped): argv[3] "tf1" in a Session,
# else `loaded.signatures`; argv[4] "stock" without importing this package.
_SIGNATURE_SERVE = r"""
import json, sys
import numpy as np
import tensorflow as tf
path, shapes, loader, package = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
if package != "stock":
    import keras_rec_emb  # registers the ops a model.export SavedModel runs
results = []
if loader == "tf1":
    tf.compat.v1.disable_eager_execution()
    sess = tf.compat.v1.Session(graph=tf.Graph())
    meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], path)
    sig = meta.signature_def["serving_default"]
    (inp,), (out,) = sig.inputs.values(), sig.outputs.values()
    # Session::RunCallable of the C API, as a C++ server calls it: no Python
    # check of the feed's shape (`Session.run` has one).
    from tensorflow.core.protobuf import config_pb2
    callable_ = sess._make_callable_from_options(
        config_pb2.CallableOptions(feed=[inp.name], fetch=[out.name]))
    run = lambda x: callable_(x)[0]
else:
    fn = tf.saved_model.load(path).signatures["serving_default"]
    run = lambda x: list(fn(tf.constant(x)).values())[0].numpy()
for shape in shapes:
    x = (np.arange(int(np.prod(shape))).reshape(shape) % 23).astype(np.int64)
    try:
        results.append({"out": run(x).tolist()})
    except tf.errors.InvalidArgumentError as e:
        results.append({"error": e.message})
print(json.dumps({"results": results,
                  "kre_imported": any(m.startswith("keras_rec_emb") for m in sys.modules)}))
"""


def _serve_signature_here(path, shapes):
    """The "tf2" loader of _SIGNATURE_SERVE in this process (which has the
    package's ops): the serving signature of a fresh tf.saved_model.load."""
    fn = tf.saved_model.load(path).signatures["serving_default"]
    results = []
    for shape in shapes:
        x = (np.arange(int(np.prod(shape))).reshape(shape) % 23).astype(np.int64)
        try:
            results.append({"out": list(fn(tf.constant(x)).values())[0].numpy().tolist()})
        except tf.errors.InvalidArgumentError as e:
            results.append({"error": e.message})
    return {"results": results}


def test_served_stacked_ids_refuse_another_length_or_rank(tmp_path):
    """The signatures of a served stacked-id GroupEmbedding model read ids
    of another length, another feature count or an extra rank as if valid
    (tf.function's shape check runs only for Python callers of `serve`)."""
    model = _stacked_group.trained_model()
    good = _stacked_group.QUERY.shape
    bad = [(4, 3, 3), (4, 3, 1), (4, 3, 2, 1), (4, 4, 2), (4, 2, 2), (4, 6)]
    want = model.predict(_stacked_group.QUERY, verbose=0)
    exported = str(tmp_path / "export")
    model.export(exported, verbose=False)
    stock = kre.export_for_serving(model, str(tmp_path / "stock"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH="")
    for path, loader, package in ((exported, "tf1", "kre"), (exported, "tf2", "kre"),
                                  (stock, "tf2", "stock"), (stock, "tf1", "stock")):
        if (loader, package) == ("tf2", "kre"):  # needs neither a graph-mode nor a bare process
            result = _serve_signature_here(path, [good] + bad)
        else:
            r = subprocess.run([sys.executable, "-c", _SIGNATURE_SERVE, path,
                                json.dumps([good] + bad), loader, package],
                               capture_output=True, text=True, timeout=300,
                               env=env if package == "stock" else dict(env, PYTHONPATH=_ROOT),
                               cwd="/" if package == "stock" else None)
            assert r.returncode == 0, r.stderr[-3000:]
            result = json.loads(r.stdout.strip().splitlines()[-1])
            assert result["kre_imported"] is (package != "stock")
        first, *others = result["results"]
        np.testing.assert_allclose(np.asarray(first["out"], np.float32), want,
                                   rtol=1e-5, atol=1e-6, err_msg=f"{path} {loader}")
        for shape, got in zip(bad, others):
            assert "error" in got, (path, loader, shape, got)
            dims = ",".join(str(d) for d in shape)
            assert f"[{dims}] is not compatible with expected shape [?,3,2]" in got["error"], (
                path, loader, got["error"][:500])
