"""A request too large for the memory left fails alone: the process that
serves it answers the next request.

Each case runs in a child process whose address space is capped
(`RLIMIT_AS`) a little above what it holds once warmed up, so the large
request is sized against the cap, not against the test machine's memory:
it touches a few hundred MiB at most."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Room above the warmed-up address space, in bytes.
_HEADROOM = 256 * 2**20

# What the child shares: the cap, and the answer as one JSON line.
_PRELUDE = textwrap.dedent(r'''
    import json, os, resource, sys
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    def cap(headroom):
        """Caps the address space at what the process maps now plus
        `headroom` bytes."""
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))

    def attempt(fn):
        try:
            fn()
            return {"answered": True}
        except tf.errors.OpError as e:
            return {"error": type(e).__name__, "message": e.message[:500]}
''')

# KRE>UnstackKeptIds and KRE>StackedPooledLookup on ids [batch, 1, 0]: no
# ids to copy, so the op's own scratch (the per-row counts of the split,
# int64 for a length known at run time only) is the allocation that fails,
# after its outputs fit. Before the fix its std::bad_alloc left the kernel
# and the process died (SIGSEGV in TensorFlow's Python bindings).
_OPS = _PRELUDE + textwrap.dedent(r'''
    import keras_rec_emb as kre
    from keras_rec_emb.backend.tensorflow import ops as _ops

    headroom = int(sys.argv[1])
    ev = kre.layers.EmbeddingVariable(1, name="t")
    ev(tf.constant([[1, 2, 3, 5]], tf.int64), training=True)  # rows of 1, 2, 3, 5
    rows = {k: ev.table.lookup(tf.constant([k], tf.int64))[0].numpy() for k in (1, 2, 3, 5)}
    small = tf.constant([[[1, -1, 3]], [[-1, -1, -1]], [[2, 2, 5]]], tf.int64)
    # The NumPy reference of the pooled sums of `small`.
    want = [(rows[1] + rows[3]).tolist(), [0.0], (2 * rows[2] + rows[5]).tolist()]

    def unstack(x):
        values, splits = _ops.unstack_kept_ids(x)
        return values[0].numpy().tolist(), splits[0].numpy().tolist()

    def lookup(x):
        return _ops.gen().kre_stacked_pooled_lookup(
            [ev.table.handle], x, num_features=1, table_key_dtypes=[ev.key_dtype],
            table_dims=[1], feature_tables=[0], combiners=["sum"], default_ids=[-1]).numpy()

    before = unstack(small), lookup(small).tolist()
    for _ in range(3):  # warm-up: the pool's threads and their malloc arenas
        unstack(tf.zeros([50000, 1, 0], tf.int64))
        lookup(tf.zeros([50000, 1, 0], tf.int64))
    cap(headroom)
    # Outputs [batch + 1] int64 (UnstackKeptIds), and [batch, 1] float plus
    # a [1, batch + 1] int64 temp (StackedPooledLookup) fit; the counts
    # ([batch] int64) do not.
    huge_unstack = attempt(lambda: unstack(tf.zeros([headroom // 11, 1, 0], tf.int64)))
    huge_lookup = attempt(lambda: lookup(tf.zeros([headroom // 16, 1, 0], tf.int64)))
    after = unstack(small), lookup(small).tolist()
    print(json.dumps({"unstack": huge_unstack, "lookup": huge_lookup,
                      "before": before, "after": after, "want": want}))
''')

# A stock export_for_serving SavedModel of a GroupEmbedding fed stacked
# ids, loaded without the package: one request over max_input_size.
_SERVED = _PRELUDE + textwrap.dedent(r'''
    path, headroom, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fn = tf.saved_model.load(path).signatures["serving_default"]
    query = (np.arange(24).reshape(4, 3, 2) % 23).astype(np.int64)
    serve = lambda x: list(fn(tf.constant(x)).values())[0].numpy()
    serve(query)
    cap(headroom)
    huge = attempt(lambda: serve(np.ones((batch, 3, 2), np.int64)))
    print(json.dumps({"huge": huge, "after": serve(query).tolist(),
                      "kre_imported": "keras_rec_emb" in sys.modules}))
''')


def _child(script, *args, package=True):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=_ROOT if package else "")
    run = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=300,
                         cwd=None if package else "/")
    # A signal (SIGSEGV, SIGABRT) is a negative return code.
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_stacked_id_kernels_fail_a_request_too_large_for_memory_alone():
    result = _child(_OPS, _HEADROOM)
    for op in ("unstack", "lookup"):
        # The op's own scratch ("too large for the memory left") or, where
        # TensorFlow's allocator maps memory in regions, one of its outputs.
        assert result[op].get("error") == "ResourceExhaustedError", result
        assert ("too large for the memory left" in result[op]["message"]
                or "OOM when allocating" in result[op]["message"]), result
    # The same process answers the next request, as before.
    assert result["after"] == result["before"], result
    (values, splits), pooled = result["after"]
    assert (values, splits) == ([1, 3, 2, 2, 5], [0, 2, 2, 5])
    np.testing.assert_allclose(pooled, result["want"], rtol=1e-6)


@pytest.fixture(scope="module")
def stacked_serving(tmp_path_factory):
    from tests import _stacked_group

    model = _stacked_group.trained_model()
    return (model, model.predict(_stacked_group.QUERY, verbose=0),
            tmp_path_factory.mktemp("served"))


def test_served_stacked_model_refuses_a_request_over_max_input_size(stacked_serving):
    """The stock served graph sums rows with TensorFlow's UnsortedSegmentSum,
    whose CPU kernel sizes a std::vector by the batch without checking it:
    a request whose counter does not fit ended the server (SIGABRT, or
    SIGSEGV when the op ran on the caller's thread). The signature refuses
    a request over max_input_size before any op reads it."""
    import keras_rec_emb as kre

    model, want, tmp = stacked_serving
    path = kre.export_for_serving(model, str(tmp / "limited"), max_input_size=6 * 1000)
    result = _child(_SERVED, path, _HEADROOM, 1001, package=False)
    assert result["kre_imported"] is False
    assert result["huge"].get("error") == "InvalidArgumentError", result
    message = result["huge"]["message"]
    assert "6006" in message and "at most 6000" in message and "max_input_size" in message, (
        message)
    np.testing.assert_allclose(np.asarray(result["after"], np.float32), want,
                               rtol=1e-5, atol=1e-6)
    # At the limit the request is served.
    ok = _child(_SERVED, path, 2**40, 1000, package=False)
    assert ok["huge"] == {"answered": True}, ok


def test_export_for_serving_checks_max_input_size(stacked_serving):
    import keras_rec_emb as kre

    model, _, tmp = stacked_serving
    with pytest.raises(ValueError, match=r"`max_input_size` must be .*Received: "
                                         r"max_input_size=0"):
        kre.export_for_serving(model, str(tmp / "bad"), max_input_size=0)
    with pytest.raises(TypeError, match=r"`max_input_size` must be .*Received: "
                                        r"max_input_size=1.5"):
        kre.export_for_serving(model, str(tmp / "bad"), max_input_size=1.5)
    assert not os.path.exists(tmp / "bad")
