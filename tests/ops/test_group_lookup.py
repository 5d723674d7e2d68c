"""Fused group lookups: outputs and gradients vs NumPy and vs separate
per-feature lookups, kernel count, training/inference, errors."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb import ops
from keras_rec_emb.layers import EmbeddingVariable
from keras_rec_emb.backend.tensorflow.embed_reduce import combine_rows
from keras_rec_emb.backend.tensorflow.op_args import named_outputs

DVD = 11


def make_table(matrix_initializer, dim, seed, key_dtype="int64"):
    matrix = np.random.default_rng(seed).normal(size=(DVD, dim)).astype(np.float32)
    opt = kre.EmbeddingVariableOption(init_option=kre.InitializerOption(default_value_dim=DVD),
                                      track_meta=True)
    layer = EmbeddingVariable(dim, initializer=matrix_initializer(matrix), ev_option=opt,
                              key_dtype=key_dtype)
    layer.build()
    return layer, lambda ids: matrix[np.mod(np.asarray(ids, np.int64), DVD)]


def make_dense(vocab, dim, seed):
    m = np.random.default_rng(seed).normal(size=(vocab, dim)).astype(np.float32)
    return keras.Variable(m), lambda ids: m[np.asarray(ids, np.int64)]


def random_ids(rng, batch, hi, invalid=True, empty=True):
    rows = []
    for b in range(batch):
        n = int(rng.integers(0 if empty else 1, 5))
        r = rng.integers(0, hi, n).tolist()
        if invalid and n and rng.random() < 0.3:
            r[int(rng.integers(0, n))] = -1
        rows.append(r)
    return rows


def clean(rows, weights, default_id):
    """Prunes ids < 0 and fills empty rows with default_id (weight 1)."""
    out_r, out_w = [], []
    for r, w in zip(rows, weights):
        keep = [(i, x) for i, x in zip(r, w) if i >= 0]
        if not keep and default_id is not None:
            keep = [(default_id, 1.0)]
        out_r.append([k[0] for k in keep])
        out_w.append([k[1] for k in keep])
    return out_r, out_w


def numpy_feature(rows_fn, dim, rows, weights, combiner, max_norm, default_id, seq):
    r_ids, r_w = clean(rows, weights, default_id)
    if seq:
        t = max([len(r) for r in r_ids] + [0])
        out = np.zeros((len(rows), t, dim), np.float32)
    else:
        out = np.zeros((len(rows), dim), np.float32)
    for b, (ids, w) in enumerate(zip(r_ids, r_w)):
        if not ids:
            continue
        x = rows_fn(ids).astype(np.float64)
        if max_norm:
            n = np.linalg.norm(x, axis=1, keepdims=True)
            x = x * np.where(n > max_norm, max_norm / np.maximum(n, 1e-30), 1.0)
        w = np.asarray(w, np.float64)[:, None]
        if seq:
            out[b, :len(ids)] = x * w
            continue
        s = (x * w).sum(0)
        if combiner == "mean":
            s = s / w.sum()
        elif combiner == "sqrtn":
            s = s / np.sqrt((w * w).sum())
        out[b] = s
    return out


def tf_feature(param, rows, weights, combiner, max_norm, default_id, seq):
    """Separate per-feature lookup with stock TF ops (our single-table lookup
    for tables, tf.gather for dense variables)."""
    r_ids, r_w = clean(rows, weights, default_id)
    ragged = tf.ragged.constant(r_ids, dtype=tf.int64, ragged_rank=1)
    w = tf.constant(sum(r_w, []), tf.float32)
    if isinstance(param, EmbeddingVariable):
        x = param.table.lookup(tf.cast(ragged.values, param.table.key_dtype), insert=True)
    else:
        x = tf.gather(param, ragged.values)
    if max_norm:
        x = tf.clip_by_norm(x, max_norm, axes=[1])
    if seq:
        return ragged.with_values(x * w[:, None]).to_tensor()
    return combine_rows(x, ragged.value_rowids(), ragged.nrows(), combiner, w)


def dedupe(grad):
    """{id: summed row} of an IndexedSlices gradient."""
    out = {}
    for i, v in zip(grad.indices.numpy().tolist(), grad.values.numpy()):
        out[i] = out.get(i, 0) + v
    return out


def assert_same_grad(a, b):
    da, db = dedupe(a), dedupe(b)
    assert sorted(da) == sorted(db)
    for k in da:
        np.testing.assert_allclose(da[k], db[k], rtol=1e-5, atol=1e-6)


CASES = [
    # combiner, weights, max_norm, default_id, seq
    ("sum", False, None, None, False),
    ("mean", False, None, None, False),
    ("sqrtn", False, None, None, False),
    ("sum", True, None, None, False),
    ("mean", True, None, 2, False),
    ("sqrtn", True, None, None, False),
    ("mean", False, 0.8, None, False),
    ("sum", True, 0.5, 3, False),
    ("sum", True, None, None, True),
    ("sum", False, 0.7, 1, True),
]


def _extra_tables():
    # The kernel gives each parameter one unit of work (dedupe, lookup and
    # combine) when there are at least two per intra-op thread; fewer take
    # the phase-by-phase path. TensorFlow's intra-op pool has one thread per
    # core by default.
    return 2 * (os.cpu_count() or 1)


@pytest.mark.parametrize("wide", [False, True], ids=["few_params", "param_per_unit"])
@pytest.mark.parametrize("combiner,use_w,max_norm,default_id,seq", CASES)
def test_mixed_group_matches_numpy_and_separate_lookups(
        matrix_initializer, combiner, use_w, max_norm, default_id, seq, wide):
    rng = np.random.default_rng(7)
    batch = 9
    t1, t1_rows = make_table(matrix_initializer, 4, 1)
    t2, t2_rows = make_table(matrix_initializer, 3, 2, key_dtype="int32")
    d1, d1_rows = make_dense(20, 5, 3)
    # Feature 3 shares table t1 with feature 0.
    params = [t1, t2, d1, t1]
    fns = [t1_rows, t2_rows, d1_rows, t1_rows]
    dims = [4, 3, 5, 4]
    his = [10**12, 50, 20, 10**12]
    extras = []
    for e in range(_extra_tables() if wide else 0):
        t, t_rows = make_table(matrix_initializer, 2, 10 + e)
        extras.append(t)
        params.append(t)
        fns.append(t_rows)
        dims.append(2)
        his.append(30)
    id_rows = [random_ids(rng, batch, hi) for hi in his]
    id_rows[0][0] = []  # an empty row
    w_rows = [[rng.uniform(0.5, 2.0, len(r)).tolist() for r in rows] for rows in id_rows]
    if not use_w:
        w_rows = [[[1.0] * len(r) for r in rows] for rows in id_rows]
    sp_ids = [tf.ragged.constant(r, dtype=tf.int64, ragged_rank=1) for r in id_rows]
    sp_ids[1] = tf.cast(sp_ids[1], tf.int32)
    sp_ids[2] = sp_ids[2].to_sparse()  # SparseTensor input too
    sp_w = None
    if use_w:
        sp_w = [tf.ragged.constant(w, dtype=tf.float32, ragged_rank=1) for w in w_rows]
        sp_w[2] = sp_w[2].to_sparse()
    targets = [tf.constant(rng.normal(size=(batch, 4, d) if seq else (batch, d)),
                           tf.float32) for d in dims]

    def loss_of(outs):
        total = 0.0
        for o, t in zip(outs, targets):
            if seq:
                o = tf.pad(o, [[0, 0], [0, 4 - tf.shape(o)[1]], [0, 0]])
            total += tf.reduce_sum(o * t)
        return total

    variables = [t1.table.variable, t2.table.variable, d1] + [t.table.variable for t in extras]
    with tf.GradientTape() as tape:
        outs = ops.group_embedding_lookup_sparse(
            params, sp_ids, [combiner] * len(params), sp_weights=sp_w, is_sequence=seq,
            max_norm=max_norm, default_id=default_id, training=True)
        loss = loss_of(outs)
    fused = tape.gradient(loss, variables)
    with tf.GradientTape() as tape:
        refs = [tf_feature(p, r, w, combiner, max_norm, default_id, seq)
                for p, r, w in zip(params, id_rows, w_rows)]
        loss_ref = loss_of(refs)
    separate = tape.gradient(loss_ref, variables)

    for f in range(len(params)):
        expect = numpy_feature(fns[f], dims[f], id_rows[f], w_rows[f], combiner,
                               max_norm, default_id, seq)
        np.testing.assert_allclose(outs[f].numpy(), expect, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(outs[f].numpy(), refs[f].numpy(), rtol=1e-5, atol=1e-6)
    for a, b in zip(fused, separate):
        assert isinstance(a, tf.IndexedSlices)
        assert_same_grad(a, b)
    # Tables: keys deduplicated, no dense shape (as the single lookup's).
    for g in fused[:2]:
        assert g.dense_shape is None
        assert len(np.unique(g.indices.numpy())) == len(g.indices.numpy())
    assert tuple(fused[2].dense_shape.numpy()) == (20, 5)


@pytest.mark.parametrize("wide", [False, True], ids=["few_params", "param_per_unit"])
@pytest.mark.parametrize("combiner,max_norm", [("sum", None), ("mean", 1.0)])
def test_concat_matches_concatenated_outputs(matrix_initializer, combiner, max_norm, wide):
    # concat=True: the op writes the outputs side by side; outputs and
    # gradients equal tf.concat of the per-feature outputs.
    rng = np.random.default_rng(3)
    batch = 7
    t1, _ = make_table(matrix_initializer, 4, 1)
    t2, _ = make_table(matrix_initializer, 3, 2, key_dtype="int32")
    d1, _ = make_dense(20, 5, 3)
    params, his = [t1, t2, d1, t1], [10**12, 50, 20, 10**12]
    for e in range(_extra_tables() if wide else 0):
        params.append(make_table(matrix_initializer, 2, 10 + e)[0])
        his.append(30)
    sp_ids = [tf.ragged.constant(random_ids(rng, batch, hi), dtype=tf.int64, ragged_rank=1)
              for hi in his]
    sp_w = [tf.ragged.map_flat_values(lambda v: tf.ones_like(v, tf.float32) * 1.5, i)
            for i in sp_ids]
    variables = [t1.table.variable, t2.table.variable, d1] + [
        p.table.variable for p in params[4:]]
    width = sum(4 if p is t1 else 3 if p is t2 else 5 if p is d1 else 2 for p in params)
    target = tf.constant(rng.normal(size=(batch, width)), tf.float32)
    results = []
    for concat in (True, False):
        with tf.GradientTape() as tape:
            out = ops.group_embedding_lookup_sparse(
                params, sp_ids, combiner, sp_weights=sp_w, max_norm=max_norm, default_id=2,
                training=True, concat=concat)
            if not concat:
                out = tf.concat(out, -1)
            loss = tf.reduce_sum(out * target)
        results.append((out, tape.gradient(loss, variables)))
    (out_c, grads_c), (out_s, grads_s) = results
    assert out_c.shape == (batch, width)
    np.testing.assert_allclose(out_c.numpy(), out_s.numpy(), rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_c, grads_s):
        assert_same_grad(a, b)
    with pytest.raises(ValueError, match="concat"):
        ops.group_embedding_lookup_sparse([t1], [sp_ids[0]], "sum", is_sequence=True,
                                          concat=True)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_dense_matches_safe_embedding_lookup_sparse(combiner):
    rng = np.random.default_rng(3)
    var = tf.Variable(rng.normal(size=(30, 6)).astype(np.float32))
    rows = random_ids(rng, 12, 30)
    sp = tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1).to_sparse()
    spw = tf.SparseTensor(sp.indices, tf.constant(rng.uniform(0.5, 2, sp.values.shape[0]),
                                                  tf.float32), sp.dense_shape)
    with tf.GradientTape(persistent=True) as tape:
        ours = ops.embedding_lookup_sparse(var, sp, spw, combiner=combiner,
                                           default_id=4, max_norm=1.5)
        ref = tf.nn.safe_embedding_lookup_sparse(
            [var], sp, spw, combiner=combiner, default_id=4, max_norm=1.5)
        l1, l2 = tf.reduce_sum(ours * ours), tf.reduce_sum(ref * ref)
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tf.convert_to_tensor(tape.gradient(l1, var)).numpy(),
                               tf.convert_to_tensor(tape.gradient(l2, var)).numpy(),
                               rtol=1e-4, atol=1e-5)


def test_matches_keras_embedding_and_embedding_variable(matrix_initializer):
    emb = keras.layers.Embedding(40, 3)
    emb.build()
    ev, _ = make_table(matrix_initializer, 3, 5)
    ids = np.random.default_rng(0).integers(0, 40, (6, 4))
    a, b = ops.group_embedding_lookup([emb, ev], [ids, ids])
    np.testing.assert_allclose(a.numpy(), emb(ids).numpy(), rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), ev(ids).numpy(), rtol=1e-6)
    assert a.shape == (6, 4, 3)


def _graph_op_counts(num_features, per_group=None):
    tables = [EmbeddingVariable(4) for _ in range(num_features)]
    for t in tables:
        t.build()
    dense = keras.Variable(np.ones((100, 4), np.float32))
    params = tables + [dense]
    opt = kre.optimizers.Adagrad(0.1)
    ids = [tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)] * len(params)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            outs = ops.group_embedding_lookup_sparse(
                params, ids, ["sum"] * len(params), params_num_per_group=per_group,
                training=True)
            loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        variables = [t.table.variable for t in tables] + [dense]
        opt.apply(tape.gradient(loss, variables), variables)
        return loss

    graph = step.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    return types.count("KRE>GroupLookup"), types.count("KRE>GroupLookupGrad")


def test_kernel_count_does_not_grow_with_features():
    assert _graph_op_counts(2) == (1, 1)
    assert _graph_op_counts(20) == (1, 1)
    # params_num_per_group splits 21 parameters into ops of at most 5.
    assert _graph_op_counts(20, per_group=5) == (5, 5)


def test_training_inserts_inference_does_not(matrix_initializer):
    t, _ = make_table(matrix_initializer, 2, 0)
    ids = [tf.ragged.constant([[5, 6], [7]], dtype=tf.int64)]
    ops.group_embedding_lookup_sparse([t], ids, ["sum"])
    assert t.table_size() == 0
    ops.group_embedding_lookup_sparse([t], ids, ["sum"], training=True)
    assert t.table_size() == 3
    np.testing.assert_array_equal(np.sort(t.export()["freqs"]), [1, 1, 1])


@pytest.mark.parametrize("filter_option", [
    kre.CounterFilter(filter_freq=4),
    kre.CBFFilter(filter_freq=3, max_element_size=1000, false_positive_probability=0.01,
                  counter_type="uint8"),
], ids=["counter", "bloom"])
def test_filtered_tables_match_separate_lookups(filter_option, matrix_initializer):
    """The group looks each distinct key up once, counted as often as it
    occurs; outputs and the table's counts match one plain lookup of all the
    group's ids (one batch: a key admitted by it reads the no-permission
    value everywhere in it, DeepRec's timing) combined per row."""
    matrix = np.random.default_rng(0).normal(size=(DVD, 3)).astype(np.float32)

    def build():
        opt = kre.EmbeddingVariableOption(
            init_option=kre.InitializerOption(default_value_dim=DVD),
            filter_option=filter_option)
        layer = EmbeddingVariable(3, combiner="sum", ev_option=opt, name="t",
                                  initializer=matrix_initializer(matrix))
        layer.build()
        return layer
    fused, separate = build(), build()
    rng = np.random.default_rng(3)
    for step in range(5):
        # Two features on the same table, with ids repeated within rows.
        feats = [[rng.choice([1, 2, 3, 5, 8], int(rng.integers(1, 6))).tolist()
                  for _ in range(6)] for _ in range(2)]
        ids = [tf.ragged.constant(f, dtype=tf.int64) for f in feats]
        got = ops.group_embedding_lookup_sparse([fused, fused], ids, ["sum", "sum"],
                                                training=True)
        # One batch: feature 0's ids, then feature 1's, looked up at once.
        rows = separate.table.lookup(tf.concat([x.flat_values for x in ids], 0),
                                     insert=True)
        n0 = int(tf.size(ids[0].flat_values))
        want = [tf.reduce_sum(tf.RaggedTensor.from_row_splits(part, x.row_splits), axis=1)
                for part, x in zip((rows[:n0], rows[n0:]), ids)]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)
        a, b = fused.table.export(), separate.table.export()
        for keys, freqs in (("keys", "freqs"), ("keys_filtered", "freqs_filtered")):
            oa, ob = np.argsort(a[keys]), np.argsort(b[keys])
            np.testing.assert_array_equal(a[keys][oa], b[keys][ob])
            np.testing.assert_array_equal(a[freqs][oa], b[freqs][ob])
        np.testing.assert_array_equal(a["bloom"], b["bloom"])
    assert fused.table.size() > 0  # some keys were admitted along the way


def test_optimizer_applies_fused_gradients(matrix_initializer):
    """One SGD step through the fused op equals one through separate lookups."""
    results = []
    for fused in (True, False):
        t, _ = make_table(matrix_initializer, 3, 9)
        d = keras.Variable(np.ones((10, 3), np.float32))
        rows = [[1, 2, 2], [], [4]]
        ids = tf.ragged.constant(rows, dtype=tf.int64)
        opt = kre.optimizers.SGD(0.5)
        with tf.GradientTape() as tape:
            if fused:
                a, b = ops.group_embedding_lookup_sparse([t, d], [ids, ids], ["mean", "sum"],
                                                         training=True)
            else:
                a = tf_feature(t, rows, [[1.0] * len(r) for r in rows], "mean", None, None, False)
                b = tf_feature(d, rows, [[1.0] * len(r) for r in rows], "sum", None, None, False)
            loss = tf.reduce_sum(a * a) + tf.reduce_sum(b * b)
        variables = [t.table.variable, d]
        opt.apply(tape.gradient(loss, variables), variables)
        e = t.export()
        order = np.argsort(e["keys"])
        results.append((e["keys"][order], e["values"][order], d.numpy()))
    for x, y in zip(*results):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    t = EmbeddingVariable(2)
    v = keras.Variable(np.ones((5, 2), np.float32))
    ids = tf.ragged.constant([[1], [2]], dtype=tf.int64)
    with pytest.raises(ValueError, match=r"len\(params\)=2 and len\(sp_ids\)=1"):
        ops.group_embedding_lookup_sparse([t, v], [ids], ["sum", "sum"])
    with pytest.raises(ValueError, match="combiner='max'"):
        ops.group_embedding_lookup_sparse([t], [ids], ["max"])
    with pytest.raises(ValueError, match="len\\(combiners\\)=1"):
        ops.group_embedding_lookup_sparse([t, v], [ids, ids], ["sum"])
    with pytest.raises(TypeError, match="sp_ids\\[0\\].*float32"):
        ops.group_embedding_lookup_sparse([t], [tf.ragged.constant([[1.0]])], ["sum"])
    with pytest.raises(ValueError, match="sp_weights\\[0\\].*2 ids.*3 weights"):
        ops.group_embedding_lookup_sparse([t], [ids], ["sum"], sp_weights=[[1.0, 2.0, 3.0]])
    with pytest.raises(TypeError, match="params\\[0\\]"):
        ops.group_embedding_lookup_sparse(["nope"], [ids], ["sum"])
    with pytest.raises(ValueError, match="params\\[0\\].*vocab, dim"):
        ops.group_embedding_lookup_sparse([keras.Variable(np.ones(3))], [ids], ["sum"])
    with pytest.raises(ValueError, match="params_num_per_group"):
        ops.group_embedding_lookup_sparse([t], [ids], ["sum"], params_num_per_group=0)
    with pytest.raises(TypeError, match="ids\\[0\\]"):
        ops.group_embedding_lookup([t], [tf.constant([1.5])])
    # Out of range ids of a dense variable: InvalidArgument from the kernel.
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range \\[0, 5\\)"):
        ops.group_embedding_lookup_sparse([v], [tf.ragged.constant([[7]], tf.int64)], ["sum"])


def test_kernel_validates_raw_inputs():
    gen = kre._ops.gen()
    v = tf.ones((5, 2))
    common = dict(table_key_dtypes=[], param_dims=[2], feature_params=[0], combiners=["sum"],
                  max_norms=[0.0], default_ids=[-1], prune_invalid_ids=[True],
                  is_sequence=[False])
    fwd = dict(common, num_params=1)
    ids = tf.constant([1, 2], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits"):
        gen.kre_group_lookup([], [v], [ids], [tf.constant([0, 3], tf.int64)],
                             [tf.zeros([0])], **fwd)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-decreasing"):
        gen.kre_group_lookup([], [v], [ids], [tf.constant([0, 2, 1, 2], tf.int64)],
                             [tf.zeros([0])], **fwd)
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights"):
        gen.kre_group_lookup([], [v], [ids], [tf.constant([0, 2], tf.int64)],
                             [tf.zeros([3])], **fwd)
    with pytest.raises(tf.errors.InvalidArgumentError, match="combiners"):
        gen.kre_group_lookup([], [v], [ids], [tf.constant([0, 2], tf.int64)],
                             [tf.zeros([0])], **dict(fwd, combiners=["max"]))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        gen.kre_group_lookup([], [tf.ones((5, 3))], [ids], [tf.constant([0, 2], tf.int64)],
                             [tf.zeros([0])], **fwd)
    splits = [tf.constant([0, 2], tf.int64)]
    uniq, inverse = [tf.constant([1, 2], tf.int64)], [tf.constant([0, 1], tf.int32)]
    with pytest.raises(tf.errors.InvalidArgumentError, match="output_grads"):
        gen.kre_group_lookup_grad([], [v], [ids], splits, [tf.zeros([0])], uniq, inverse,
                                  [tf.zeros((3, 2))], **common)
    # The forward's inverse must index its distinct ids, one entry per id.
    with pytest.raises(tf.errors.InvalidArgumentError, match="inverse\\[0\\]\\[1\\] = 2"):
        gen.kre_group_lookup_grad([], [v], [ids], splits, [tf.zeros([0])], uniq,
                                  [tf.constant([0, 2], tf.int32)], [tf.zeros((1, 2))], **common)
    with pytest.raises(tf.errors.InvalidArgumentError, match="one entry per looked-up id"):
        gen.kre_group_lookup_grad([], [v], [ids], splits, [tf.zeros([0])], uniq,
                                  [tf.constant([0], tf.int32)], [tf.zeros((1, 2))], **common)
    good = gen.kre_group_lookup_grad([], [v], [ids], splits, [tf.zeros([0])], uniq, inverse,
                                     [tf.constant([[1.0, 2.0]])], **common)
    np.testing.assert_allclose(good[0].numpy(), [[1.0, 2.0], [1.0, 2.0]])


# -- the two paths: pooled (a table's only feature, inference) and deduplicating
def _inference_by_path(params, ids, combiners, concat, **kwargs):
    """An inference group lookup's output ([batch, sum(dims)]) by path:
    "pooled" as it is (a table's only feature without weights or max_norm on
    the pooled path, the others deduplicated) and "dedupe" with every
    feature read twice (a table read by two features is deduplicated; the
    first copy's outputs)."""
    n = len(params)
    combiners = [combiners] * n if isinstance(combiners, str) else list(combiners)
    twice = {k: list(v) * 2 if isinstance(v, (list, tuple)) and len(v) == n else v
             for k, v in kwargs.items()}
    out = ops.group_embedding_lookup_sparse(params, ids, combiners, training=False,
                                            concat=concat, **kwargs)
    pooled = out.numpy() if concat else np.concatenate([o.numpy() for o in out], -1)
    out = ops.group_embedding_lookup_sparse(list(params) * 2, list(ids) * 2, combiners * 2,
                                            training=False, concat=concat, **twice)
    dedupe = (out.numpy()[:, :pooled.shape[-1]] if concat
              else np.concatenate([o.numpy() for o in out[:n]], -1))
    return {"pooled": pooled, "dedupe": dedupe}


def _lookup_outputs(out):
    """(rows, unique_ids[0], inverse[0]) of the group lookup op behind `out`."""
    outs = named_outputs(out.op)
    return outs["outputs"][0], outs["unique_ids"][0], outs["inverse"][0]


# -- features of one id per row --------------------------------------------------
def _single_id_features(rng, batch):
    """Ids of five features, repeats within the batch: (ids, weights) per
    feature, feature 4 multi-id (the general path), 0-3 one id per row."""
    single = [tf.constant(rng.integers(0, 9, batch), tf.int64) for _ in range(4)]
    multi = tf.ragged.constant([rng.integers(0, 9, int(rng.integers(1, 4))).tolist()
                                for _ in range(batch)], dtype=tf.int64)
    weights = tf.constant(rng.uniform(0.5, 2.0, batch).astype(np.float32))
    return single + [multi], weights


@pytest.mark.parametrize("wide", [False, True], ids=["few_params", "param_per_unit"])
@pytest.mark.parametrize("concat", [False, True], ids=["dict", "concat"])
def test_single_id_features_match_numpy_by_either_path(matrix_initializer, wide, concat):
    """Inference lookups of features with one id per row equal NumPy's, the
    same by either path, with a table of its own, a table shared by two
    single-id features, per-id weights, max_norm and an int32 table; nothing
    is inserted."""
    t0, m0 = make_table(matrix_initializer, 4, 0)
    t1, m1 = make_table(matrix_initializer, 4, 1, key_dtype="int32")
    t2, m2 = make_table(matrix_initializer, 4, 2)
    params = [t0, t1, t2, t2, t0]
    ids, w = _single_id_features(np.random.default_rng(5), 7)
    extra = []
    if wide:
        extra = [make_table(matrix_initializer, 4, 10 + i)[0] for i in range(_extra_tables())]
    weights = [None, w, None, None, None] + [None] * len(extra)
    results = _inference_by_path(
        params + extra, [x if isinstance(x, tf.RaggedTensor) else x[:, None]
                         for x in ids] + [ids[0][:, None]] * len(extra),
        ["sum", "mean", "sum", "sqrtn", "sum"] + ["sum"] * len(extra), concat,
        sp_weights=weights, max_norm=[None, None, 0.9, None, None] + [None] * len(extra))
    np.testing.assert_array_equal(results["pooled"], results["dedupe"])
    out = results["pooled"]
    a = [x.numpy() for x in ids]
    clip = lambda r: r * np.minimum(1.0, 0.9 / np.linalg.norm(r, axis=1, keepdims=True))
    want = [m0(a[0]), m1(a[1]) * np.sign(w.numpy())[:, None], clip(m2(a[2])), m2(a[3]),
            np.stack([m0(r).sum(0) for r in ids[4].to_list()])]
    np.testing.assert_allclose(out[:, :20], np.concatenate(want, -1), rtol=1e-5, atol=1e-6)
    assert all(t.table_size() == 0 for t in [t0, t1, t2] + extra)


@pytest.mark.parametrize("wide", [False, True], ids=["few_params", "param_per_unit"])
def test_single_id_group_trains_as_separate_layers(matrix_initializer, wide):
    """Four Adagrad steps with a CounterFilter(2) (training lookups
    deduplicate): the group and the tables' own lookups end with the same
    values, frequencies (one per occurrence), filtered keys and Adagrad
    accumulators; then an inference lookup of the group reads what the
    tables' own lookups read (admitted rows, no_permission_value for
    filtered keys, default rows for unseen ones)."""
    matrix = np.random.default_rng(0).normal(size=(DVD, 3)).astype(np.float32)
    n_tables = 2 + (_extra_tables() if wide else 0)

    def build():
        opt = kre.EmbeddingVariableOption(
            init_option=kre.InitializerOption(default_value_dim=DVD),
            filter_option=kre.CounterFilter(filter_freq=2))
        layers = [EmbeddingVariable(3, ev_option=opt, initializer=matrix_initializer(matrix))
                  for _ in range(n_tables)]
        for layer in layers:
            layer.build()
        return layers

    runs = {}
    for mode in ("group", "separate"):
        layers = build()
        opt = kre.optimizers.Adagrad(0.3)
        rng = np.random.default_rng(8)
        outs = []
        for _ in range(4):
            ids = [tf.constant(rng.integers(0, 12, 9), tf.int64) for _ in layers]
            target = tf.constant(rng.normal(size=(9, 3 * len(layers))).astype(np.float32))
            with tf.GradientTape() as tape:
                if mode == "separate":
                    out = tf.concat([t.table.lookup(x, insert=True)
                                     for t, x in zip(layers, ids)], -1)
                else:
                    out = ops.group_embedding_lookup_sparse(
                        layers, [x[:, None] for x in ids], ["sum"] * len(layers),
                        training=True, concat=True)
                loss = tf.reduce_sum(out * target)
            variables = [t.table.variable for t in layers]
            opt.apply(tape.gradient(loss, variables), variables)
            outs.append(out.numpy())
        probe = [tf.constant(rng.integers(0, 14, 9), tf.int64) for _ in layers]
        if mode == "separate":
            served = tf.concat([t.table.lookup(x) for t, x in zip(layers, probe)], -1)
        else:
            served = ops.group_embedding_lookup_sparse(
                layers, [x[:, None] for x in probe], ["sum"] * len(layers), concat=True)
        outs.append(served.numpy())
        runs[mode] = (outs, [t.table.export() for t in layers])
    for mode in ("separate",):
        for a, b in zip(runs["group"][0], runs[mode][0]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        for ea, eb in zip(runs["group"][1], runs[mode][1]):
            oa, ob = np.argsort(ea["keys"]), np.argsort(eb["keys"])
            np.testing.assert_array_equal(ea["keys"][oa], eb["keys"][ob])
            np.testing.assert_array_equal(ea["freqs"][oa], eb["freqs"][ob])
            np.testing.assert_allclose(ea["values"][oa], eb["values"][ob], rtol=1e-6, atol=1e-7)
            assert sorted(ea["slots"]) == sorted(eb["slots"]) != []
            for name in ea["slots"]:
                np.testing.assert_allclose(ea["slots"][name][oa], eb["slots"][name][ob],
                                           rtol=1e-6, atol=1e-7)
            fa, fb = np.argsort(ea["keys_filtered"]), np.argsort(eb["keys_filtered"])
            np.testing.assert_array_equal(ea["keys_filtered"][fa], eb["keys_filtered"][fb])
            np.testing.assert_array_equal(ea["freqs_filtered"][fa], eb["freqs_filtered"][fb])
    assert all(len(e["keys"]) > 0 for e in runs["group"][1])  # admitted and trained


@pytest.mark.parametrize("shared,training,want_unique,want_inverse", [
    (False, False, [4, 4, 7], [0, 1, 2]),
    (True, False, [4, 7], [0, 0, 1]),
    (False, True, [4, 7], [0, 0, 1]),
], ids=["pooled", "shared_table", "training"])
def test_pooled_path_lists_every_id(shared, training, want_unique, want_inverse):
    """On the pooled path (an inference lookup of a table's only feature)
    unique_ids holds every id (repeats too) and inverse counts 0, 1, 2, ...;
    a table read by two features and training lookups deduplicate."""
    t = EmbeddingVariable(2)
    t.build()
    ids = tf.constant([[4], [4], [7]], tf.int64)
    n = 2 if shared else 1

    @tf.function
    def lookup():
        out = ops.group_embedding_lookup_sparse([t] * n, [ids] * n, ["sum"] * n,
                                                training=training)[0]
        return _lookup_outputs(out)

    rows, unique, inverse = lookup()
    np.testing.assert_array_equal(rows.numpy()[0], rows.numpy()[1])
    assert unique.numpy().tolist() == want_unique
    assert inverse.numpy().tolist() == want_inverse


def _single_id_case(matrix_initializer, wide, batch):
    """(params, ids, combiners, weights, default_ids, numpy reference or None
    per feature, the filtered layer): features 0-2 and 5-6 are pooled (int64
    table with [batch] ids, int32 table with [batch, 1] ids, a
    CounterFilter(2) table partly admitted, a pruned -1 id filled with
    default_id, a multi-id feature), the others deduplicated (a table shared
    by two features, one of them with per-id weights; a dense matrix)."""
    rng = np.random.default_rng(3)
    t0, m0 = make_table(matrix_initializer, 4, 0)
    t1, m1 = make_table(matrix_initializer, 4, 1, key_dtype="int32")
    filt = EmbeddingVariable(4, ev_option=kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(filter_freq=2)))
    filt.build()
    filt.table.lookup(tf.constant([1, 1, 2, 3, 3], tf.int64), insert=True)  # 1, 3 admitted
    filt.table.lookup(tf.constant([1, 2, 3, 3], tf.int64), insert=True)  # 2 admitted
    t3, m3 = make_table(matrix_initializer, 4, 3)
    t4, m4 = make_table(matrix_initializer, 4, 4)
    t5, m5 = make_table(matrix_initializer, 4, 5)
    dense, md = make_dense(13, 4, 6)
    a = [rng.integers(0, 12, batch) for _ in range(7)]
    a[4][2] = -1
    multi = tf.ragged.constant([rng.integers(0, 9, int(rng.integers(1, 4))).tolist()
                                for _ in range(batch)], dtype=tf.int64)
    w = rng.uniform(0.5, 2.0, batch).astype(np.float32)
    params = [t0, t1, filt, t3, t3, t4, t5, dense]
    ids = [tf.constant(a[0]), tf.constant(a[1][:, None]), tf.constant(a[2][:, None]),
           tf.constant(a[3][:, None]), tf.constant(a[5][:, None]),
           tf.constant(a[4][:, None]), multi, tf.constant(a[6][:, None])]
    weights = [None, None, None, None, tf.constant(w[:, None]), None, None, None]
    defaults = [None, None, None, None, None, 7, None, None]
    cleaned = np.where(a[4] < 0, 7, a[4])
    want = [m0(a[0]), m1(a[1]), None, m3(a[3]), m3(a[5]) * w[:, None], m4(cleaned),
            np.stack([m5(r).sum(0) for r in multi.to_list()]), md(a[6])]
    if wide:
        for e in range(_extra_tables()):
            t, m = make_table(matrix_initializer, 4, 10 + e)
            x = rng.integers(0, 50, batch)
            params.append(t)
            ids.append(tf.constant(x[:, None]))
            weights.append(None)
            defaults.append(None)
            want.append(m(x))
    return params, ids, weights, defaults, want, filt


@pytest.mark.parametrize("batch", [9, 300], ids=["partitioned", "ordered"])
@pytest.mark.parametrize("wide", [False, True], ids=["few_params", "param_per_unit"])
@pytest.mark.parametrize("concat", [False, True], ids=["dict", "concat"])
def test_single_id_inference_matches_both_paths_separate_and_numpy(matrix_initializer, wide,
                                                                   concat, batch):
    """Inference lookups of one id per row, pooled and deduplicated features
    in one op: outputs equal the deduplicating path's, the separate tables'
    own lookups and NumPy's (the filtered table: admitted keys their rows,
    others no_permission_value); nothing is inserted. With 300 ids (>= 4 per
    shard) the unfiltered pooled tables are read in batch order, with 9 by
    shard."""
    params, ids, weights, defaults, want, filt = _single_id_case(matrix_initializer, wide,
                                                                 batch)
    n = len(params)
    sizes = [p.table_size() for p in params if isinstance(p, EmbeddingVariable)]
    results = _inference_by_path(
        params, ids, ["sum", "mean", "sum", "sqrtn", "sum", "mean", "sum", "sum"]
        + ["sum"] * (n - 8), concat, sp_weights=weights, default_id=defaults)
    np.testing.assert_array_equal(results["pooled"], results["dedupe"])
    separate = filt.table.lookup(tf.reshape(ids[2], [-1])).numpy()
    assert np.any(separate != 0) and np.any(separate == 0)  # admitted rows and filtered keys
    want[2] = separate
    np.testing.assert_allclose(results["pooled"], np.concatenate(want, -1), rtol=1e-5,
                               atol=1e-6)
    assert [p.table_size() for p in params if isinstance(p, EmbeddingVariable)] == sizes


@pytest.mark.parametrize("wide", [False, True], ids=["few_params", "param_per_unit"])
def test_pooled_outputs_every_kept_id_and_training_deduplicates(wide):
    """A pooled feature's unique_ids lists every kept id in order (int64 and
    int32 tables) and inverse counts 0, 1, ...: one id per row, ragged rows
    with a pruned id, and enough ids to be read in batch order; a table
    read by two features and training lookups deduplicate."""
    layers = [EmbeddingVariable(2, key_dtype=k) for k in ("int64", "int32")]
    extra = [EmbeddingVariable(2) for _ in range(_extra_tables() if wide else 0)]
    for t in layers + extra:
        t.build()

    @tf.function
    def lookup(ids, training, shared=False):
        params = layers + extra + (layers if shared else [])
        ids = ids + [ids[0]] * len(extra) + (ids if shared else [])
        out = ops.group_embedding_lookup_sparse(params, ids, "sum", training=training)[0]
        outs = named_outputs(out.op)
        return outs["unique_ids"][:2], outs["inverse"][:2]

    dense = [tf.constant([[4], [4], [7]], tf.int64), tf.constant([[6], [4], [5]], tf.int64)]
    unique, inverse = lookup(dense, False)
    assert [u.numpy().tolist() for u in unique] == [[4, 4, 7], [6, 4, 5]]
    assert [i.numpy().tolist() for i in inverse] == [[0, 1, 2], [0, 1, 2]]
    ragged = [tf.ragged.constant([[4], [4, 7], []], tf.int64),
              tf.ragged.constant([[-1], [4], [4]], tf.int64)]
    unique, inverse = lookup(ragged, False)  # every kept id
    assert [u.numpy().tolist() for u in unique] == [[4, 4, 7], [4, 4]]
    assert [i.numpy().tolist() for i in inverse] == [[0, 1, 2], [0, 1]]
    unique, inverse = lookup(ragged, False, shared=True)
    assert [u.numpy().tolist() for u in unique] == [[4, 7], [4]]
    assert [i.numpy().tolist() for i in inverse] == [[0, 0, 1], [0, 0]]
    many = [tf.constant(np.arange(300)[:, None] % 97, tf.int64)] * 2  # LookupOrdered
    unique, inverse = lookup(many, False)
    assert [u.numpy().tolist() for u in unique] == [(np.arange(300) % 97).tolist()] * 2
    assert [i.numpy().tolist() for i in inverse] == [list(range(300))] * 2
    unique, inverse = lookup(dense, True)
    assert [u.numpy().tolist() for u in unique] == [[4, 7], [6, 4, 5]]
    assert [i.numpy().tolist() for i in inverse] == [[0, 0, 1], [0, 1, 2]]


def test_one_id_per_row_bad_input():
    """Bad one-id-per-row input: a 2-D ids input or splits past the ids to
    the raw op are InvalidArgument, not a crash; a float ids tensor or
    rank-3 dense ids at the API are ValueError/TypeError naming the
    argument."""
    t = EmbeddingVariable(2)
    t.build()
    gen = __import__("keras_rec_emb.backend.tensorflow.ops", fromlist=["gen"]).gen()
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be 1-D"):
        gen.kre_group_lookup([t.table.handle], [], [tf.constant([[1], [2]], tf.int64)],
                             [tf.constant([0, 1, 2], tf.int64)], [tf.zeros([0])],
                             num_params=1,
                             table_key_dtypes=["int64"], param_dims=[2], feature_params=[0],
                             combiners=["sum"], max_norms=[0.0], default_ids=[-1],
                             prune_invalid_ids=[True], is_sequence=[False])
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits"):
        gen.kre_group_lookup([t.table.handle], [], [tf.constant([1, 2], tf.int64)],
                             [tf.constant([0, 1, 3], tf.int64)], [tf.zeros([0])],
                             num_params=1,
                             table_key_dtypes=["int64"], param_dims=[2], feature_params=[0],
                             combiners=["sum"], max_norms=[0.0], default_ids=[-1],
                             prune_invalid_ids=[True], is_sequence=[False])
    with pytest.raises((ValueError, TypeError), match="sp_ids"):
        ops.group_embedding_lookup_sparse([t], [tf.constant([[1.5]])], "sum")
    with pytest.raises(ValueError, match="sp_ids"):
        ops.group_embedding_lookup_sparse([t], [tf.zeros([2, 1, 1, 1], tf.int64)], "sum",
                                          is_sequence=True)


# -- multi-id features -------------------------------------------------------------
def _pooled_case(matrix_initializer, wide, batch):
    """(params, ids, combiners, default_ids, rows per feature after the input's
    own form, the filtered layer): features 0-3 take the pooled path
    (int64 ragged with -1 ids and empty rows; int32 dense [batch, 4] padded
    with -1 and default_id; int64 sqrtn with default_id; a CounterFilter(2)
    table partly admitted), the others cannot (a dense matrix; a table shared
    by two features)."""
    rng = np.random.default_rng(11)
    t0, m0 = make_table(matrix_initializer, 4, 20)
    t1, m1 = make_table(matrix_initializer, 4, 21, key_dtype="int32")
    t2, m2 = make_table(matrix_initializer, 4, 22)
    filt = EmbeddingVariable(4, ev_option=kre.EmbeddingVariableOption(
        filter_option=kre.CounterFilter(filter_freq=2)))
    filt.build()
    filt.table.lookup(tf.constant([1, 1, 2, 3, 3], tf.int64), insert=True)  # 1, 3 admitted
    t5, m5 = make_table(matrix_initializer, 4, 25)
    dense, md = make_dense(13, 4, 26)
    rows = [random_ids(rng, batch, 30) for _ in range(7)]
    rows[4] = [[i for i in r if i >= 0] for r in random_ids(rng, batch, 13)]
    padded = np.full((batch, 4), -1, np.int64)
    for b, r in enumerate(rows[1]):
        padded[b, :len(r)] = r
    rows[1] = [[i for i in r] for r in padded.tolist()]
    params = [t0, t1, t2, filt, dense, t5, t5]
    ids = [tf.ragged.constant(r, dtype=tf.int64, ragged_rank=1) for r in rows]
    ids[1] = tf.constant(padded.astype(np.int32))
    combiners = ["sum", "mean", "sqrtn", "sum", "mean", "sum", "mean"]
    defaults = [None, 3, 5, None, None, None, 2]
    fns = [m0, m1, m2, None, md, m5, m5]
    if wide:
        for e in range(_extra_tables()):
            t, m = make_table(matrix_initializer, 4, 40 + e)
            r = random_ids(rng, batch, 50)
            params.append(t)
            ids.append(tf.ragged.constant(r, dtype=tf.int64, ragged_rank=1))
            combiners.append(("sum", "mean", "sqrtn")[e % 3])
            defaults.append(None if e % 2 else 1)
            fns.append(m)
            rows.append(r)
    return params, ids, combiners, defaults, fns, rows, filt


@pytest.mark.parametrize("batch", [9, 300, 1500], ids=["partitioned", "ordered", "blocks"])
@pytest.mark.parametrize("wide", [False, True], ids=["few_params", "param_per_unit"])
@pytest.mark.parametrize("concat", [False, True], ids=["dict", "concat"])
def test_pooled_matches_dedupe_separate_and_numpy(matrix_initializer, wide, concat, batch):
    """Multi-id inference lookups on the pooled path (a table's only
    feature, no weights, no max_norm) are bit-identical to the deduplicating
    path's (sum, mean, sqrtn; pruned -1 ids, dense padding, empty rows,
    default_id; int32 and int64 tables), equal the separate tables' own
    lookups combined and NumPy's (the filtered table: admitted keys their
    rows, others no_permission_value); nothing is inserted. With 300 rows
    the unfiltered tables are read in batch order, with 9 by shard; with
    1500 rows their ids span several lookup blocks and units of rows."""
    params, ids, combiners, defaults, fns, rows, filt = _pooled_case(matrix_initializer, wide,
                                                                      batch)
    sizes = [p.table_size() for p in params if isinstance(p, EmbeddingVariable)]
    results = _inference_by_path(params, ids, combiners, concat, default_id=defaults)
    np.testing.assert_array_equal(results["pooled"], results["dedupe"])
    ones = [[1.0] * len(r) for r in rows[3]]
    kept, _ = clean(rows[3], ones, None)
    flat = tf.constant(sum(kept, []), tf.int64)
    fil_rows = filt.table.lookup(flat, insert=False).numpy()
    assert np.any(fil_rows != 0) and np.any(fil_rows == 0)  # admitted rows and filtered keys
    lookup = dict(zip(flat.numpy().tolist(), fil_rows))
    fns[3] = lambda x: np.stack([lookup[i] for i in np.asarray(x).tolist()])
    want, separate = [], []
    for f, p in enumerate(params):
        r = rows[f]
        w = [[1.0] * len(x) for x in r]
        want.append(numpy_feature(fns[f], 4, r, w, combiners[f], None, defaults[f], False))
        if isinstance(p, EmbeddingVariable):
            k, _ = clean(r, w, defaults[f])
            rag = tf.ragged.constant(k, dtype=tf.int64, ragged_rank=1)
            x = p.table.lookup(tf.cast(rag.values, p.table.key_dtype), insert=False)
            separate.append(combine_rows(x, rag.value_rowids(), rag.nrows(), combiners[f]).numpy())
        else:
            separate.append(want[-1])
    np.testing.assert_allclose(results["pooled"], np.concatenate(want, -1), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(results["pooled"], np.concatenate(separate, -1), rtol=1e-6,
                               atol=1e-6)
    assert [p.table_size() for p in params if isinstance(p, EmbeddingVariable)] == sizes


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
def test_pooled_lists_every_kept_id(key_dtype):
    """On the pooled path unique_ids lists every kept id in batch order
    (pruned -1 dropped, default_id filled in) and inverse counts 0, 1, ...;
    with per-id weights, a table read by two features or training the ids
    are deduplicated."""
    t = EmbeddingVariable(2, key_dtype=key_dtype)
    t.build()
    ids = tf.ragged.constant([[4, -1, 4], [], [7, 4]], tf.int64)

    @tf.function
    def lookup(training, shared=False, weights=None):
        n = 2 if shared else 1
        out = ops.group_embedding_lookup_sparse([t] * n, [ids] * n, ["mean"] * n,
                                                default_id=[9] * n, sp_weights=[weights] * n,
                                                training=training)[0]
        return _lookup_outputs(out)

    rows, unique, inverse = lookup(False)
    assert unique.numpy().tolist() == [4, 4, 9, 7, 4]
    assert inverse.numpy().tolist() == [0, 1, 2, 3, 4]
    rows_g, unique, inverse = lookup(False, shared=True)
    assert unique.numpy().tolist() == [4, 9, 7]
    assert inverse.numpy().tolist() == [0, 0, 1, 2, 0]
    np.testing.assert_array_equal(rows.numpy(), rows_g.numpy())
    w = tf.ragged.constant([[1.0, 1.0, 1.0], [], [1.0, 1.0]])
    rows_w, unique, _ = lookup(False, weights=w)
    assert unique.numpy().tolist() == [4, 9, 7]
    np.testing.assert_array_equal(rows.numpy(), rows_w.numpy())
    assert t.table_size() == 0
    _, unique, inverse = lookup(True)
    assert unique.numpy().tolist() == [4, 9, 7]
    assert inverse.numpy().tolist() == [0, 0, 1, 2, 0]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pooled_long_rows(matrix_initializer, combiner):
    """Rows longer than the pooled path's lookup block (1024 ids) and empty
    rows between them: bit-identical to the deduplicating path, equal to
    NumPy's reference."""
    rng = np.random.default_rng(7)
    t, m = make_table(matrix_initializer, 3, 30)
    lengths = [0, 1500, 3, 0, 2000, 1, 700, 0]
    rows = [rng.integers(0, 5000, n).tolist() for n in lengths]
    ids = tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1)
    out = _inference_by_path([t], [ids], combiner, False)
    np.testing.assert_array_equal(out["pooled"], out["dedupe"])
    want = numpy_feature(m, 3, rows,
                         [[1.0] * len(r) for r in rows], combiner, None, None, False)
    np.testing.assert_allclose(out["pooled"], want, rtol=1e-5, atol=1e-5)
    assert np.all(out["pooled"][[0, 3, 7]] == 0) and np.all(out["pooled"][[1, 2, 4]] != 0)


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
@pytest.mark.parametrize("kept_share", [0.6, 0.01], ids=["most_kept", "few_kept"])
def test_pooled_in_place_lists_kept_ids(matrix_initializer, key_dtype, kept_share):
    """A pooled feature has its kept ids built in place (no weights, written
    once into unique_ids): unique_ids lists every kept id in batch order (-1
    pruned, default_id for empty rows, int32 keys as the table reads them),
    inverse is 0, 1, ..., the rows are bit-identical to the deduplicating
    path's and equal NumPy's, with most ids kept (read in batch order) or so
    few that the table is read by shard."""
    rng = np.random.default_rng(5)
    t, m = make_table(matrix_initializer, 4, 50, key_dtype=key_dtype)
    batch = 400
    dense = rng.integers(0, 40, (batch, 5))
    dense[rng.random((batch, 5)) > kept_share] = -1
    dense[3] = -1  # an empty row
    ids = tf.constant(dense)
    rows = [[i for i in r if i >= 0] for r in dense.tolist()]
    want_unique = sum([r if r else [6] for r in rows], [])

    @tf.function
    def lookup(shared=False):
        n = 2 if shared else 1
        out = ops.group_embedding_lookup_sparse([t] * n, [ids] * n, ["mean"] * n,
                                                default_id=[6] * n, training=False)[0]
        return _lookup_outputs(out)

    out, unique, inverse = lookup()
    assert unique.dtype == tf.int64 and unique.numpy().tolist() == want_unique
    assert inverse.numpy().tolist() == list(range(len(want_unique)))
    out_general, unique_general, _ = lookup(shared=True)
    assert sorted(set(want_unique)) == sorted(unique_general.numpy().tolist())
    np.testing.assert_array_equal(out.numpy(), out_general.numpy())
    want = numpy_feature(m, 4, rows, [[1.0] * len(r) for r in rows], "mean", None, 6, False)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    assert t.table_size() == 0


@pytest.mark.parametrize("key_dtype", ["int64", "int32"])
@pytest.mark.parametrize("case", ["kept", "negative", "empty_with_default", "empty"])
def test_pooled_reads_kept_ids_where_they_are(matrix_initializer, key_dtype, case):
    """A pooled feature whose ids need no pruning and no filling (as
    `KRE>UnstackKeptIds` gives them) is read from its input where it is: for
    int64 keys, unique_ids is that input tensor itself (same buffer), inverse
    0, 1, ...; rows bit-identical to the deduplicating path's and equal to
    NumPy's.
    A negative id, or an empty row with a default_id, takes the copying
    path; an empty row without one does not."""
    rng = np.random.default_rng(11)
    t, m = make_table(matrix_initializer, 4, 50, key_dtype=key_dtype)
    lengths = rng.integers(1, 6, 500)
    default = None
    if case.startswith("empty"):
        lengths[[3, 77]] = 0
        default = 6 if case == "empty_with_default" else None
    values = rng.integers(0, 40, int(lengths.sum()))
    if case == "negative":
        values[10] = -3
    vals = tf.constant(values, tf.int64)
    ids = tf.RaggedTensor.from_row_lengths(vals, lengths)
    rows = [[i for i in r if i >= 0] for r in ids.to_list()]
    want_unique = sum([r if r or default is None else [default] for r in rows], [])

    @tf.function
    def lookup(shared=False):
        n = 2 if shared else 1
        out = ops.group_embedding_lookup_sparse([t] * n, [ids] * n, ["sqrtn"] * n,
                                                default_id=[default] * n, training=False)[0]
        return _lookup_outputs(out)

    out, unique, inverse = lookup()
    assert unique.numpy().tolist() == want_unique
    assert inverse.numpy().tolist() == list(range(len(want_unique)))
    same_buffer = (np.asarray(unique).__array_interface__["data"][0]
                   == np.asarray(vals).__array_interface__["data"][0])
    assert same_buffer == (key_dtype == "int64" and case in ("kept", "empty"))
    out_general, _, _ = lookup(shared=True)
    np.testing.assert_array_equal(out.numpy(), out_general.numpy())
    want = numpy_feature(m, 4, rows, [[1.0] * len(r) for r in rows], "sqrtn", None, default,
                         False)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    assert t.table_size() == 0


def _float32_combine(rows, combiner):
    """CombineRows' float32 operations in its order: one id gives 1 * x; several
    are summed from +0.0 and scaled by 1 / n (mean) or 1 / sqrt(n) (sqrtn);
    none give +0.0."""
    dim = rows.shape[1]
    if len(rows) == 1:
        return np.float32(1.0) * rows[0]
    acc = np.zeros(dim, np.float32)
    for r in rows:
        acc = acc + r
    if combiner != "sum" and len(rows):
        n = np.float32(len(rows))
        denom = np.sqrt(n, dtype=np.float32) if combiner == "sqrtn" else n
        acc = acc * (np.float32(1.0) / denom)
    return acc


@pytest.mark.parametrize("dims,concat", [([16, 16, 4], True), ([16, 16], True),
                                         ([16, 32, 4], False)],
                         ids=["concat_unaligned", "concat_lines", "dict"])
@pytest.mark.parametrize("long_row", [False, True], ids=["padded", "unpadded"])
def test_pooled_combine_is_bit_exact(matrix_initializer, dims, concat, long_row):
    """The pooled path's combine (rows of at most 8 ids summed to a fixed
    length with -0.0 rows, rows streamed to whole-cache-line outputs) gives
    the deduplicating path's bits and NumPy's float32 sum in CombineRows' order,
    -0.0 included: rows of -0.0 alone give -0.0, several give +0.0."""
    rng = np.random.default_rng(3)
    batch, combiners = 1500, ["sum", "mean", "sqrtn"]
    params, fns, ids, rows_by_f = [], [], [], []
    for f, dim in enumerate(dims):
        matrix = rng.normal(size=(DVD, dim)).astype(np.float32)
        matrix[0] = -0.0
        matrix[1, ::2] = -0.0
        matrix[2, 1::2] = 0.0
        opt = kre.EmbeddingVariableOption(init_option=kre.InitializerOption(default_value_dim=DVD))
        t = EmbeddingVariable(dim, initializer=matrix_initializer(matrix), ev_option=opt)
        t.build()
        t.table.lookup(tf.range(0, 40, 2, dtype=tf.int64), insert=True)  # some keys stored
        rows = [rng.integers(0, 40, int(rng.integers(1, 6))).tolist() for _ in range(batch)]
        for b in rng.choice(batch, 40, replace=False):
            rows[b] = [int(x) for x in rng.choice([0, 11, 22, 33], int(rng.integers(1, 4)))]
        rows[7] = []
        if long_row:
            rows[5] = rng.integers(0, 40, 12).tolist()
        params.append(t)
        fns.append(lambda x, m=matrix: m[np.mod(np.asarray(x, np.int64), DVD)])
        ids.append(tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1))
        rows_by_f.append(rows)
    cs = [combiners[f % 3] for f in range(len(dims))]
    results = _inference_by_path(params, ids, cs, concat)
    bits = {k: v.view(np.uint32) for k, v in results.items()}
    np.testing.assert_array_equal(bits["pooled"], bits["dedupe"])
    want = np.concatenate([
        np.stack([_float32_combine(fns[f](r).reshape(-1, dims[f]), cs[f]) if r else
                  np.zeros(dims[f], np.float32) for r in rows_by_f[f]])
        for f in range(len(dims))], -1)
    np.testing.assert_array_equal(bits["pooled"], want.view(np.uint32))
    neg = np.signbit(results["pooled"]) & (results["pooled"] == 0)
    assert neg.any() and ((results["pooled"] == 0) & ~neg).any()
