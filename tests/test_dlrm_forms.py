"""The DLRM-DCNv2 of guides/porting_from_keras_rs.py (keras-rs's example
ported) in its subclassed, functional and `Sequential` forms: fit, evaluate,
predict, an exact `.keras` round trip, `model.export` served in process and
`export_for_serving` served by stock TensorFlow (in a process that never
imports this package for the functional form, in process for the others)."""

import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from tests._model_forms import assert_state_equal, state

_GUIDE = os.path.join(os.path.dirname(__file__), "..", "guides", "porting_from_keras_rs.py")
_spec = importlib.util.spec_from_file_location("porting_from_keras_rs", _GUIDE)
guide = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(guide)  # definitions only: its training runs under __main__
# Six of Criteo's 26 features (C5 and C6 share a table): every trace of the
# model (fit, evaluate, predict, reload, two exports) costs per feature, and
# tests/test_guides.py runs the guide itself with all 26.
guide.NUM_SPARSE = 6

ROWS = 512


def build(form):
    configs = guide.make_feature_configs(embedding_dim=4)
    if form == "subclassed":
        model = guide.DLRMDCNv2(configs, **guide.MODEL_ARGS)
    elif form == "functional":
        model = guide.make_functional(configs, **guide.MODEL_ARGS)
    else:
        args = {k: v for k, v in guide.MODEL_ARGS.items() if k != "bottom_mlp_dims"}
        model = guide.make_sequential(configs, **args)
    model.compile(optimizer=kre.optimizers.Adam(0.001), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


def data(form, seed):
    x, y = guide.make_data(ROWS, seed=seed)
    return (guide.stack_ids(x) if form == "sequential" else x), y


def signature(form):
    if form == "subclassed":  # Keras records only shapes for subclassed models
        return guide.input_signature()
    return None


_SERVE = textwrap.dedent("""
    import pickle, sys
    import numpy as np
    import tensorflow as tf
    path, inputs_path, out_path = sys.argv[1:]
    with open(inputs_path, "rb") as f:
        inputs = pickle.load(f)
    served = tf.saved_model.load(path)
    to_tensor = lambda v: tf.constant(v) if not isinstance(v, dict) else {
        k: to_tensor(u) for k, u in v.items()}
    out = served.serve(to_tensor(inputs))
    assert not any(m.startswith("keras_rec_emb") for m in sys.modules)
    np.save(out_path, np.asarray(out))
""")


def serve_without_the_package(path, inputs, tmp_path):
    with open(tmp_path / "inputs.pkl", "wb") as f:
        pickle.dump(inputs, f)
    env = dict(os.environ, PYTHONPATH="", TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", _SERVE, path, str(tmp_path / "inputs.pkl"),
                        str(tmp_path / "out.npy")], capture_output=True, text=True,
                       env=env, cwd="/", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(tmp_path / "out.npy")


def _package_ops(path):
    """This package's op types (KRE>...) in the SavedModel at `path`."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    ops = {n.op for n in graph.node}
    for function in graph.library.function:
        ops.update(n.op for n in function.node_def)
    return sorted(op for op in ops if op.startswith("KRE>"))


def head(x, n):
    if isinstance(x, dict):
        return {k: head(v, n) for k, v in x.items()}
    return x[:n]


@pytest.mark.parametrize("form", ["subclassed", "functional", "sequential"])
def test_guide_dlrm_in_every_form(tmp_path, form):
    model = build(form)
    x, y = data(form, 0)
    x_new, y_new = data(form, 1)  # mostly ids the tables have not seen
    history = model.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    group = next(layer for layer in model.layers if isinstance(layer, kre.layers.GroupEmbedding)) \
        if form != "subclassed" else model.embedding_layer
    assert len(group.tables) == guide.NUM_SPARSE - 1  # the last two features share one table
    assert all(t.table_size() > 0 for t in group.tables)
    assert all(sorted(t.export()["slots"]) == ["accumulator"] for t in group.tables)
    scores = model.evaluate(x_new, y_new, batch_size=256, verbose=0, return_dict=True)
    assert set(scores) == {"loss", "auc"} and np.isfinite(scores["loss"])
    expect = model.predict(x_new, batch_size=256, verbose=0)
    assert expect.shape == (ROWS, 1)

    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    assert_state_equal(state(model), state(loaded))
    np.testing.assert_array_equal(loaded.predict(x_new, batch_size=256, verbose=0), expect)
    for m in (model, loaded):  # both keep training alike
        m.fit(x_new, y_new, batch_size=128, epochs=1, shuffle=False, verbose=0)
    assert_state_equal(state(model), state(loaded))
    expect = model.predict(x_new, batch_size=256, verbose=0)

    sizes = [t.table_size() for t in group.tables]
    exported = str(tmp_path / "exported")
    model.export(exported, input_signature=signature(form), verbose=False)
    served = tf.saved_model.load(exported)
    batch = head(x_new, 16)
    np.testing.assert_allclose(served.serve(batch), expect[:16], rtol=1e-5, atol=1e-6)

    stock = kre.export_for_serving(model, str(tmp_path / "stock"),
                                   input_signature=signature(form))
    if form == "functional":
        # A process that never imports this package serves it (one form: the
        # three export the same stock graph; a child costs a TensorFlow start).
        served_stock = serve_without_the_package(stock, batch, tmp_path)
    else:
        reloaded = tf.saved_model.load(stock)  # kept: its variables live with it
        served_stock = reloaded.serve(batch)
        assert not _package_ops(stock)
    np.testing.assert_allclose(served_stock, expect[:16], rtol=1e-5, atol=1e-6)
    assert [t.table_size() for t in group.tables] == sizes  # serving inserts nothing
