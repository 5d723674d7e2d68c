"""Pooled EmbeddingVariable calls in a traced step are looked up together:
one fused op for all layers, the same numbers as one op per layer."""

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
def test_unstacked_layers_are_one_op_with_numpy_values(matrix_initializer, training):
    layers = make_layers(matrix_initializer)
    ids = tf.constant(stacked_ids())

    @tf.function
    def embed(x):
        return tf.concat([layer(c, training=training)
                          for layer, c in zip(layers, tf.unstack(x, axis=1))], 1)

    out = embed(ids).numpy()
    want = np.concatenate([numpy_sum(ids.numpy()[:, j]) for j in range(F)], 1)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    types = op_types(embed, ids)
    kre_ops = [t for t in types if t.startswith("KRE>")]
    # Inference: GroupEmbedding's stacked op on the stacked ids; training:
    # their split without padding, then one group lookup for all layers.
    assert kre_ops == (["KRE>UnstackKeptIds", "KRE>GroupLookup"] if training
                       else ["KRE>StackedPooledLookup"])
    assert "ConcatV2" not in types  # written side by side by the op
    inserted = sum(layer.table_size() for layer in layers)
    assert inserted == (sum(len(np.unique(ids.numpy()[:, j][ids.numpy()[:, j] >= 0]))
                            for j in range(F)) if training else 0)


def test_ragged_sparse_weighted_and_dense_calls_share_one_op(matrix_initializer):
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
    assert types.count("KRE>GroupLookup") == 1


def test_a_deferred_rows_object_acts_as_its_tensor(matrix_initializer):
    layer, = make_layers(matrix_initializer, n=1)
    ids = tf.constant([[1, 2], [3, -1]], tf.int64)
    seen = {}

    @tf.function
    def use(x):
        rows = layer(x)
        seen["type"] = type(rows).__name__
        seen["static"] = (rows.shape.as_list(), rows.dtype, rows.ndim)
        return (rows * 2.0 + 1.0, -rows[0], tf.reduce_sum(rows, 1), keras.ops.sum(rows),
                rows == rows[0])

    doubled, negated, summed, total, equal = use(ids)
    want = numpy_sum(ids.numpy())
    assert seen["type"] == "DeferredRows"
    assert seen["static"] == ([2, DIM], tf.float32, 2)
    np.testing.assert_allclose(doubled.numpy(), want * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(negated.numpy(), -want[0], rtol=1e-6)
    np.testing.assert_allclose(summed.numpy(), want.sum(1), rtol=1e-6)
    np.testing.assert_allclose(total.numpy(), want.sum(), rtol=1e-6)
    np.testing.assert_array_equal(equal.numpy(), want == want[0])


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
    assert op_types(step, x).count("KRE>GroupLookup") == 2  # one per insert flag


def test_rows_used_inside_a_branch_are_looked_up_outside_it(matrix_initializer):
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
def test_single_id_layers_are_one_op_and_every_id_is_a_key(matrix_initializer, training):
    layers = make_layers(matrix_initializer, combiner=None, prune_invalid_ids=False)
    ids = stacked_ids(seed=3, length=1)[:, :, 0]  # -1 is a key here
    x = tf.constant(ids)

    @tf.function
    def embed(x):
        return tf.concat([layer(c, training=training)
                          for layer, c in zip(layers, tf.unstack(x, axis=1))], 1)

    want = np.concatenate([MATRIX[np.mod(ids[:, j], DVD)] for j in range(F)], 1)
    np.testing.assert_allclose(embed(x).numpy(), want, rtol=1e-6)
    types = op_types(embed, x)
    assert [t for t in types if t.startswith("KRE>")] == ["KRE>UnstackFeatureIds",
                                                          "KRE>GroupLookup"]
    assert "ConcatV2" not in types
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


@pytest.mark.parametrize("form", ["subclassed", "functional", "sequential", "single ids"])
def test_fit_with_separate_layers_matches_eager_fit(matrix_initializer, form):
    ids = stacked_ids(seed=1, batch=64, length=1 if form == "single ids" else 3)
    labels = np.random.default_rng(2).random((64, 1)).astype("float32")
    if form == "functional":
        x = [ids[:, j] for j in range(F)]
    elif form == "sequential":
        x = ids[:, 0]
    else:
        x = ids
    states = []
    for eager in (True, False):
        model = _model(form, matrix_initializer, single=form == "single ids")
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


def test_rows_made_in_one_thread_and_used_in_another(matrix_initializer):
    """MirroredStrategy traces each replica in its own thread: a call
    deferred there and used elsewhere is looked up by itself."""
    import threading

    a, b = make_layers(matrix_initializer, n=2)
    x = tf.constant([[1, 2]], tf.int64)

    @tf.function
    def run(x):
        made = {}
        graph = tf.compat.v1.get_default_graph()

        def replica():
            with graph.as_default():
                made["rows"] = a(x)

        thread = threading.Thread(target=replica)
        thread.start()
        thread.join()
        mine = b(x)  # pending in this thread
        return made["rows"] + 0.0, mine + 0.0

    theirs, mine = run(x)
    np.testing.assert_allclose(theirs.numpy(), numpy_sum(x.numpy()), rtol=1e-6)
    np.testing.assert_allclose(mine.numpy(), numpy_sum(x.numpy()), rtol=1e-6)
