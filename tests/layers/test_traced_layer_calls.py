"""EmbeddingVariable calls in a traced function mean what they mean eagerly
(looked up at the call, in program order, under the tapes recording there,
a tf.Tensor out); the calls of one Functional model call share one fused
op, with the numbers of one op per layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

DIM = 3
DVD = 7
MATRIX = np.arange(DVD * DIM, dtype=np.float32).reshape(DVD, DIM) / 10.0
F = 4


def make_layers(matrix_initializer, n=F, **kwargs):
    opt = kre.EmbeddingVariableOption(init_option=kre.InitializerOption(default_value_dim=DVD))
    kwargs.setdefault("combiner", "sum")
    kwargs.setdefault("prune_invalid_ids", True)
    return [EmbeddingVariable(DIM, initializer=matrix_initializer(MATRIX), ev_option=opt,
                              name=f"f{j}", **kwargs) for j in range(n)]


def numpy_sum(ids):
    """Sum pooling of the rows of ids >= 0 over the last axis (the rows
    drawn by the initializer: id mod DVD)."""
    ids = np.asarray(ids)
    rows = MATRIX[np.mod(np.where(ids >= 0, ids, 0), DVD)] * (ids >= 0)[..., None]
    return rows.sum(-2)


def stacked_ids(seed=0, batch=32, length=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 40, size=(batch, F, length))
    ids[rng.random(ids.shape) < 0.3] = -1
    return ids


def op_types(fn, *args):
    return [op.type for op in fn.get_concrete_function(*args).graph.get_operations()]


@pytest.mark.parametrize("training", [False, True])
def test_layers_in_a_tf_function_look_up_at_their_calls_with_numpy_values(
        matrix_initializer, training):
    layers = make_layers(matrix_initializer)
    ids = tf.constant(stacked_ids())

    @tf.function
    def embed(x):
        return tf.concat([layer(c, training=training)
                          for layer, c in zip(layers, tf.unstack(x, axis=1))], 1)

    out = embed(ids).numpy()
    want = np.concatenate([numpy_sum(ids.numpy()[:, j]) for j in range(F)], 1)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert op_types(embed, ids).count("KRE>GroupLookup") == F  # each at its call
    inserted = sum(layer.table_size() for layer in layers)
    assert inserted == (sum(len(np.unique(ids.numpy()[:, j][ids.numpy()[:, j] >= 0]))
                            for j in range(F)) if training else 0)


def test_ragged_sparse_weighted_and_dense_calls_match_eager(matrix_initializer):
    layers = make_layers(matrix_initializer, n=4)
    layers[2] = EmbeddingVariable(DIM, combiner="mean", prune_invalid_ids=True,
                                  initializer=matrix_initializer(MATRIX), name="mean",
                                  ev_option=layers[0].ev_option)
    ragged = tf.ragged.constant([[1, 2], [], [3]], dtype=tf.int64)
    sparse = tf.sparse.from_dense(tf.constant([[0, 4], [5, 0], [6, 6]], tf.int64))
    weighted = tf.constant([[1, 2], [3, -1], [4, 5]], tf.int64)
    weights = tf.constant([[1.0, 3.0], [2.0, 1.0], [0.0, 1.0]])
    dense3 = tf.constant([[[1, 2], [3, -1]], [[4, 4], [-1, -1]], [[0, 1], [2, 3]]], tf.int64)

    def run(fn):
        return fn(ragged, sparse, weighted, weights, dense3)

    def calls(r, s, w, ws, d):
        return [layers[0](r), layers[1](s), layers[2](w, weights=ws), layers[3](d)]

    eager = [o.numpy() for o in run(calls)]
    traced = tf.function(calls)
    assert [o.shape for o in eager] == [(3, DIM), (3, DIM), (3, DIM), (3, 2, DIM)]
    for got, want in zip(run(traced), eager):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(eager[0], [MATRIX[1] + MATRIX[2], np.zeros(DIM), MATRIX[3]])
    np.testing.assert_allclose(eager[2][2], MATRIX[5])  # the weight-0 id is dropped
    np.testing.assert_allclose(eager[3], numpy_sum(dense3.numpy()), rtol=1e-6)
    types = op_types(traced, ragged, sparse, weighted, weights, dense3)
    assert types.count("KRE>GroupLookup") == 4


def test_rows_never_used_are_still_looked_up_and_counted(matrix_initializer):
    filtered = kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(filter_freq=2),
        init_option=kre.InitializerOption(default_value_dim=DVD))
    layer, twin = (EmbeddingVariable(DIM, combiner="sum", prune_invalid_ids=True,
                                     initializer=matrix_initializer(MATRIX), ev_option=filtered)
                   for _ in range(2))
    x = tf.constant([[5, 6], [7, 5]], tf.int64)

    @tf.function
    def warm(x):
        layer(x, training=True)  # its rows are never used
        return tf.constant(0)

    warm(x)
    twin(x, training=True)  # eager: looked up at the call
    got, want = layer.export(), twin.export()
    assert sorted(got["keys"].tolist()) == [5]  # 5 seen twice: admitted
    for part in ("keys", "values", "freqs"):
        np.testing.assert_array_equal(got[part], want[part])
    assert got["freqs"].tolist() == [2]


def test_training_and_inference_calls_and_a_frozen_layer_keep_their_own_insert(
        matrix_initializer):
    a, b, c = make_layers(matrix_initializer, n=3)
    c.trainable = False
    x = tf.constant([[1, 2]], tf.int64)

    @tf.function
    def step(x):
        return tf.concat([a(x, training=True), b(x, training=False), c(x, training=True)], 1)

    np.testing.assert_allclose(step(x).numpy(),
                               np.tile(numpy_sum(x.numpy()), 3), rtol=1e-6)
    assert (a.table_size(), b.table_size(), c.table_size()) == (2, 0, 0)
    assert op_types(step, x).count("KRE>GroupLookup") == 3  # one per call


def test_rows_used_inside_a_branch_are_looked_up_at_the_call(matrix_initializer):
    layer, = make_layers(matrix_initializer, n=1)

    @tf.function
    def branch(x, take):
        rows = layer(x, training=True)
        return tf.cond(take, lambda: tf.reduce_sum(rows), lambda: tf.constant(0.0))

    x = tf.constant([[1, 2]], tf.int64)
    assert float(branch(x, tf.constant(False))) == 0.0
    assert layer.table_size() == 2  # inserted whichever branch runs
    np.testing.assert_allclose(float(branch(x, tf.constant(True))),
                               numpy_sum(x.numpy()).sum(), rtol=1e-6)


def test_float_ids_are_refused_at_the_call(matrix_initializer):
    layer, = make_layers(matrix_initializer, n=1)

    @tf.function
    def bad(x):
        layer(x)
        return tf.constant(0)

    with pytest.raises(TypeError, match="expects integer ids"):
        bad(tf.constant([[1.0, 2.0]]))


@pytest.mark.parametrize("training", [False, True])
def test_single_id_layers_every_id_a_key(matrix_initializer, training):
    layers = make_layers(matrix_initializer, combiner=None, prune_invalid_ids=False)
    ids = stacked_ids(seed=3, length=1)[:, :, 0]  # -1 is a key here
    x = tf.constant(ids)

    @tf.function
    def embed(x):
        return tf.concat([layer(c, training=training)
                          for layer, c in zip(layers, tf.unstack(x, axis=1))], 1)

    want = np.concatenate([MATRIX[np.mod(ids[:, j], DVD)] for j in range(F)], 1)
    np.testing.assert_allclose(embed(x).numpy(), want, rtol=1e-6)
    assert op_types(embed, x).count("KRE>TableLookup") == F  # each at its call, as eagerly
    assert [layer.table_size() for layer in layers] == (
        [len(np.unique(ids[:, j])) for j in range(F)] if training else [0] * F)

    @tf.function
    def rank2(x):  # [batch, L] ids without a combiner: [batch, L, dim] rows
        return layers[0](x)

    np.testing.assert_allclose(rank2(x).numpy(), MATRIX[np.mod(ids, DVD)], rtol=1e-6)


class Separate(keras.Model):
    """The natural subclassed form: one layer per feature."""

    def __init__(self, tables, single=False, **kwargs):
        super().__init__(**kwargs)
        self.tables = tables
        self.single = single
        self.head = keras.layers.Dense(1, kernel_initializer="ones")

    def call(self, x, training=None):
        cols = tf.unstack(x[:, :, 0] if self.single else x, axis=1)
        return self.head(tf.concat([t(c, training=training)
                                    for t, c in zip(self.tables, cols)], 1))


def _model(form, matrix_initializer, single=False):
    if single:
        filtered = kre.EmbeddingVariableOption(
            filter_option=kre.CounterFilter(filter_freq=2),
            init_option=kre.InitializerOption(default_value_dim=DVD))
        tables = [EmbeddingVariable(DIM, initializer=matrix_initializer(MATRIX),
                                    ev_option=filtered, name=f"s{j}") for j in range(F)]
        if form == "functional single ids":  # fused: one id a row, every id a key
            inputs = [keras.Input(shape=(), dtype="int64") for _ in range(F)]
            merged = keras.layers.Concatenate()([t(i) for t, i in zip(tables, inputs)])
            return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(merged))
        return Separate(tables, single=True)
    tables = make_layers(matrix_initializer)
    if form == "subclassed":
        return Separate(tables)
    inputs = [keras.Input(shape=(3,), dtype="int64") for _ in range(F)]
    merged = keras.layers.Concatenate()([t(i) for t, i in zip(tables, inputs)])
    out = keras.layers.Dense(1, kernel_initializer="ones")(merged)
    if form == "functional":
        return keras.Model(inputs, out)
    return keras.Sequential([tables[0], keras.layers.Dense(1, kernel_initializer="ones")])


@pytest.mark.parametrize("form", ["subclassed", "functional", "sequential", "single ids",
                                  "functional single ids"])
def test_fit_with_separate_layers_matches_eager_fit(matrix_initializer, form):
    single = form.endswith("single ids")
    ids = stacked_ids(seed=1, batch=64, length=1 if single else 3)
    labels = np.random.default_rng(2).random((64, 1)).astype("float32")
    if form == "functional":
        x = [ids[:, j] for j in range(F)]
    elif form == "functional single ids":
        x = [ids[:, j, 0] for j in range(F)]
    elif form == "sequential":
        x = ids[:, 0]
    else:
        x = ids
    states = []
    for eager in (True, False):
        model = _model(form, matrix_initializer, single=single)
        model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse", run_eagerly=eager)
        model.fit(x, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
        tables = {}
        for layer in model.tables if isinstance(model, Separate) else model.layers:
            if isinstance(layer, EmbeddingVariable):
                data = layer.export()
                order = np.argsort(data["keys"])
                tables[layer.name] = (data["keys"][order], data["values"][order],
                                      data["freqs"][order],
                                      {k: v[order] for k, v in data["slots"].items()})
        dense = [w.numpy() for w in model.weights if "kernel" in w.path or "bias" in w.path]
        states.append((tables, dense))
    (eager_tables, eager_dense), (traced_tables, traced_dense) = states
    assert sorted(eager_tables) == sorted(traced_tables) and eager_tables
    for name, (keys, values, freqs, slots) in eager_tables.items():
        got = traced_tables[name]
        np.testing.assert_array_equal(got[0], keys)
        np.testing.assert_allclose(got[1], values, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[2], freqs)
        for k, v in slots.items():
            np.testing.assert_allclose(got[3][k], v, rtol=1e-5, atol=1e-6)
    for got, want in zip(traced_dense, eager_dense):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- a traced call means what the eager call means (issue 56) ------------------
def _twins(matrix_initializer, n=1, **kwargs):
    """Two sets of the same fresh layers: one run eagerly, one traced."""
    return make_layers(matrix_initializer, n=n, **kwargs), make_layers(matrix_initializer, n=n,
                                                                       **kwargs)


def _both(fn, eager_args, traced_args):
    """`fn` run eagerly on `eager_args` and as a tf.function on `traced_args`,
    both results as NumPy (nested lists / tuples kept)."""
    def numpy(x):
        if isinstance(x, (list, tuple)):
            return type(x)(numpy(v) for v in x)
        return x.numpy() if hasattr(x, "numpy") else x
    return numpy(fn(*eager_args)), numpy(tf.function(fn)(*traced_args))


def _dense_grad(grad):
    """A table gradient (IndexedSlices over keys) as {key: summed row}; None stays."""
    if grad is None:
        return None
    out = {}
    for k, row in zip(grad.indices.numpy().tolist(), grad.values.numpy()):
        out[k] = out.get(k, 0) + row
    return out


def test_rows_read_before_an_optimizer_update_are_the_old_rows(matrix_initializer):
    x = tf.constant([[1, 2], [3, -1]], tf.int64)

    def make():
        layer, = make_layers(matrix_initializer, n=1)
        layer(x, training=True)  # the rows exist before the step
        opt = kre.optimizers.Adagrad(0.5)
        opt.build(layer.trainable_variables)
        return layer, opt

    def step(layer, opt):
        def run(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x, training=True))
            grads = tape.gradient(loss, layer.trainable_variables)
            before = layer(x, training=False)  # read before the update ...
            opt.apply_gradients(zip(grads, layer.trainable_variables))
            after = layer(x, training=False)
            return before * 1.0, after * 1.0  # ... used after it
        return run

    eager_layer, eager_opt = make()
    traced_layer, traced_opt = make()
    want = step(eager_layer, eager_opt)(x)
    got = tf.function(step(traced_layer, traced_opt))(x)
    np.testing.assert_allclose(want[0].numpy(), numpy_sum(x.numpy()), rtol=1e-6)
    assert np.abs(want[1].numpy() - want[0].numpy()).max() > 1e-3  # the update moved them
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)


def test_table_size_between_a_training_call_and_its_rows_counts_the_inserts(
        matrix_initializer):
    (eager,), (traced,) = _twins(matrix_initializer)
    x = tf.constant([[1, 2, 3], [4, 5, 6]], tf.int64)

    def fn(layer):
        def run(x):
            rows = layer(x, training=True)
            size = layer.table.size()  # between the call and the use of its rows
            return size, rows + 1.0
        return run

    want = fn(eager)(x)
    got = tf.function(fn(traced))(x)
    assert int(want[0]) == 6 and int(got[0]) == 6
    np.testing.assert_allclose(got[1].numpy(), want[1].numpy(), rtol=1e-6)


def test_rows_made_inside_a_tape_and_first_used_under_stop_recording_keep_their_gradient(
        matrix_initializer):
    x = tf.constant([[1, 2], [2, -1]], tf.int64)

    def fn(layer):
        def run(x):
            with tf.GradientTape() as tape:
                rows = layer(x, training=True)
                with tape.stop_recording():
                    norm = tf.reduce_sum(rows * rows)  # a metric, not differentiated
                loss = tf.reduce_sum(rows * 2.0)
            grad = tape.gradient(loss, layer.table.variable)
            return norm, grad.indices, grad.values
        return run

    (eager,), (traced,) = _twins(matrix_initializer)
    want = fn(eager)(x)
    got = tf.function(fn(traced))(x)
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-6)
    as_dict = [_dense_grad(tf.IndexedSlices(r[2], r[1])) for r in (want, got)]
    assert sorted(as_dict[0]) == [1, 2]
    assert sorted(as_dict[1]) == sorted(as_dict[0])
    for k, v in as_dict[0].items():
        np.testing.assert_allclose(as_dict[1][k], v, rtol=1e-6)
        np.testing.assert_allclose(v, 2.0 * (x.numpy() == k).sum() * np.ones(DIM))


def test_rows_made_outside_a_tape_and_used_inside_it_get_no_gradient(matrix_initializer):
    x = tf.constant([[1, 2]], tf.int64)
    seen = {}

    def fn(layer, key):
        def run(x):
            rows = layer(x, training=True)  # before the tape
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(rows * 3.0)
            seen[key] = tape.gradient(loss, layer.table.variable)
            return loss
        return run

    (eager,), (traced,) = _twins(matrix_initializer)
    want = fn(eager, "eager")(x)
    got = tf.function(fn(traced, "traced"))(x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    assert seen == {"eager": None, "traced": None}


def test_with_two_tapes_the_gradient_goes_to_the_tape_that_recorded_the_call(
        matrix_initializer):
    x = tf.constant([[1, 2], [3, 3]], tf.int64)
    seen = {}

    def fn(layer, key):
        def run(x):
            with tf.GradientTape(persistent=True) as outer:
                rows = layer(x, training=True)  # recorded by `outer` only
                with tf.GradientTape() as inner:
                    loss = tf.reduce_sum(rows * 3.0)  # first used under both
            seen[key] = (inner.gradient(loss, layer.table.variable),
                         outer.gradient(loss, layer.table.variable))
            g = seen[key][1]
            return g.indices, g.values
        return run

    (eager,), (traced,) = _twins(matrix_initializer)
    want = fn(eager, "eager")(x)
    got = tf.function(fn(traced, "traced"))(x)
    assert seen["eager"][0] is None and seen["traced"][0] is None  # not on `inner`
    assert seen["eager"][1] is not None and seen["traced"][1] is not None
    want_d = _dense_grad(tf.IndexedSlices(want[1], want[0]))
    got_d = _dense_grad(tf.IndexedSlices(got[1], got[0]))
    assert sorted(got_d) == sorted(want_d) == [1, 2, 3]
    for k, v in want_d.items():
        np.testing.assert_allclose(got_d[k], v, rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", None])
def test_a_traced_call_returns_a_tensor_that_a_nested_tf_function_takes(
        matrix_initializer, combiner):
    kwargs = {} if combiner else {"combiner": None, "prune_invalid_ids": False}
    (eager,), (traced,) = _twins(matrix_initializer, **kwargs)
    x = tf.constant([[1, 2], [3, 4]], tf.int64)
    seen = []
    doubled = tf.function(lambda rows: rows * 2.0)

    def fn(layer):
        def run(x):
            rows = layer(x, training=True)
            seen.append((tf.is_tensor(rows), keras.ops.is_tensor(rows),
                         isinstance(rows, tf.Tensor)))
            return doubled(rows)
        return run

    want = fn(eager)(x)
    got = tf.function(fn(traced))(x)
    assert seen == [(True, True, True)] * 2
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


# -- one Functional model call: its layers share one fused op ------------------
def _functional(layers, extra=None):
    inputs = [keras.Input(shape=(3,), dtype="int64", name=f"in{j}")
              for j in range(len(layers))]
    outs = [layer(i) for layer, i in zip(layers, inputs)]
    if extra is not None:
        outs.append(extra(inputs[0]))
    merged = keras.layers.Concatenate()(outs)
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(merged))


def test_a_functional_model_call_looks_its_layers_up_in_one_op(matrix_initializer):
    layers = make_layers(matrix_initializer)
    model = _functional(layers)
    ids = stacked_ids(seed=4)
    xs = [tf.constant(ids[:, j]) for j in range(F)]
    outs = {}

    @tf.function
    def step(*xs):
        with tf.GradientTape() as tape:
            out = model(list(xs), training=True)
            loss = tf.reduce_sum(out)
        grads = tape.gradient(loss, [layer.table.variable for layer in layers])
        outs["tensor"] = tf.is_tensor(out)
        return out, [(g.indices, g.values) for g in grads]

    got, grads = step(*xs)
    assert outs["tensor"]
    assert op_types(step, *xs).count("KRE>GroupLookup") == 1
    want = numpy_sum(ids).sum((1, 2))[:, None]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
    for j, (idx, vals) in enumerate(grads):
        g = _dense_grad(tf.IndexedSlices(vals, idx))
        col = ids[:, j]
        assert sorted(g) == sorted(np.unique(col[col >= 0]).tolist())
        for k, v in g.items():
            np.testing.assert_allclose(v, (col == k).sum() * np.ones(DIM), rtol=1e-6)
    assert [layer.table_size() for layer in layers] == [
        len(np.unique(ids[:, j][ids[:, j] >= 0])) for j in range(F)]


def test_a_functional_graph_whose_table_another_layer_reads_is_not_fused(matrix_initializer):
    layers = make_layers(matrix_initializer)
    group = kre.layers.GroupEmbedding(
        {"g": kre.layers.FeatureSpec(layers[1], combiner="sum")}, output_mode="concat")
    model = _functional(layers, extra=lambda x: group({"g": x}))
    xs = [tf.constant(stacked_ids(seed=5)[:, j]) for j in range(F)]
    fn = tf.function(lambda *xs: model(list(xs), training=False))
    types = op_types(fn, *xs)
    # layers[1] is held by the group: it looks up at its call, the group at
    # its own, and the three others share one op.
    assert types.count("KRE>GroupLookup") == 3
    eager = model(xs, training=False).numpy()
    np.testing.assert_allclose(fn(*xs).numpy(), eager, rtol=1e-5)


def test_a_functional_node_with_its_own_training_is_not_fused(matrix_initializer):
    def build(layers):
        inputs = [keras.Input(shape=(3,), dtype="int64") for _ in range(3)]
        outs = [layers[0](inputs[0], training=False), layers[1](inputs[1]),
                layers[2](inputs[2])]
        return keras.Model(inputs, keras.layers.Concatenate()(outs))

    ids = stacked_ids(seed=6)
    xs = [tf.constant(ids[:, j]) for j in range(3)]
    for training in (None, True):
        model, twin = build(make_layers(matrix_initializer, n=3)), build(
            make_layers(matrix_initializer, n=3))
        fn = tf.function(lambda *xs: model(list(xs), training=training))
        got = fn(*xs).numpy()
        assert op_types(fn, *xs).count("KRE>GroupLookup") == 3
        want = twin(xs, training=training).numpy()  # eager
        np.testing.assert_allclose(got, want, rtol=1e-6)
        sizes = [layer.table_size() for layer in model.layers[3:6]]
        assert sizes == [layer.table_size() for layer in twin.layers[3:6]]
