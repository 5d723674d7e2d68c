"""The pooled table calls (keras_rec_emb/backend/jax/ffi.py's pooled_lookup and
apply_pooled): a combiner's lookup and its gradient's sparse update in one
call each, against NumPy and against the row calls (lookup, apply)."""

import contextlib

import jax
import keras
import numpy as np
import pytest

from keras_rec_emb.backend.jax import ffi
from keras_rec_emb.backend.jax.layers import pooled_scale
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from keras_rec_emb.optimizers import SGD

DIM = 4
ADAGRAD = ("learning_rate", "decay", "epsilon")
HYPER = [0.2, 0.0, 1e-7]  # Adagrad's, in ADAGRAD's order


def defaults(rows=5, dim=DIM):
    return (np.arange(rows * dim, dtype=np.float32).reshape(rows, dim) - 7.0) / 9.0


@contextlib.contextmanager
def adagrad_tables(n):
    """`n` tables of `defaults()` with an Adagrad accumulator slot (0.1),
    destroyed on exit."""
    tables = [ffi.create(defaults()) for _ in range(n)]
    try:
        for t in tables:
            ffi.add_slot(t, "accumulator", DIM, 0.1)
        yield tables
    finally:
        for t in tables:
            ffi.destroy(t)


def id_shares(ids, weights, combiner, prune):
    """Each id's weight over its row's denominator (0 for padding), as the
    layers scale a combined row's gradient."""
    return np.asarray(pooled_scale(ids, weights, combiner, prune))


def batch(rng, rows, length, vocab):
    ids = rng.integers(0, vocab, size=(rows, length)).astype(np.int32)
    lengths = rng.integers(0, length + 1, size=rows)  # some rows with no id
    ids[np.arange(length)[None, :] >= lengths[:, None]] = -1
    weights = rng.uniform(-0.5, 2.0, size=(rows, length)).astype(np.float32)
    return ids, weights


def pooled_steps(seed, table, combiner, weighted, positive_only=False):
    """Three steps of 300 rows on `table`, each a pooled lookup and its
    Adagrad update; yields (step, ids, weights, grads, pooled rows) of each
    for the same step on another table. `positive_only` pads the ids of
    weights <= 0."""
    rng = np.random.default_rng(seed)
    for step in range(3):
        ids, weights = batch(rng, 300, 4, 30)
        weights = weights if weighted else None
        if positive_only:
            ids = np.where(weights > 0, ids, -1)
        grads = rng.normal(size=(300, DIM)).astype(np.float32)
        rows = ffi.pooled_lookup(table, ids, DIM, combiner, weights, prune=True)
        ffi.apply_pooled(table, ids, grads, HYPER, step, "adagrad", ADAGRAD, ("accumulator",),
                         combiner, weights, prune=True)
        yield step, ids, weights, grads, rows


# 6 rows take the tables' shard-by-shard path, 300 their batch-order one
# (kv::Table::PrefersOrderedLookup), a counter filter the shard-by-shard one.
@pytest.mark.parametrize("rows, filter_freq", [(6, 0), (300, 0), (300, 2)])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_numpy_and_inserts_as_lookup(rows, filter_freq, combiner,
                                                           weighted):
    rng = np.random.default_rng(rows + filter_freq)
    ids, weights = batch(rng, rows, 5, 40)
    weights = weights if weighted else None
    pooled = ffi.create(defaults(), filter_freq=filter_freq)
    plain = ffi.create(defaults(), filter_freq=filter_freq)
    try:
        for step in range(2):  # a second pass reads what the first inserted
            out = np.asarray(ffi.pooled_lookup(pooled, ids, DIM, combiner, weights,
                                               insert=True, prune=True))
            rows_ = np.asarray(ffi.lookup(plain, ids, DIM, insert=True, prune=True))
            want = (rows_ * id_shares(ids, weights, combiner, True)[..., None]).sum(1)
            np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=str(step))
        a, b = ffi.export(pooled, "int32", DIM), ffi.export(plain, "int32", DIM)
        order_a, order_b = np.argsort(a["keys"]), np.argsort(b["keys"])
        for part in ("keys", "values", "freqs"):
            np.testing.assert_array_equal(a[part][order_a], b[part][order_b])
        # Inference reads the same and inserts nothing.
        size = ffi.size(pooled).tolist()
        again = np.asarray(ffi.pooled_lookup(pooled, ids, DIM, combiner, weights, insert=False,
                                             prune=True))
        np.testing.assert_allclose(again, out, rtol=1e-6, atol=1e-6)
        unseen = np.full((2, 3), 1000, np.int32)
        ffi.pooled_lookup(pooled, unseen, DIM, combiner, insert=False)
        assert ffi.size(pooled).tolist() == size
    finally:
        ffi.destroy(pooled)
        ffi.destroy(plain)


def test_without_prune_every_id_is_a_key():
    t = ffi.create(defaults())
    try:
        ids = np.array([[-1, 3], [2, 2]], np.int32)
        out = np.asarray(ffi.pooled_lookup(t, ids, DIM, "mean", prune=False))
        d = defaults()
        np.testing.assert_allclose(out, [(d[-1 % 5] + d[3]) / 2, d[2]], rtol=1e-6)
        assert sorted(ffi.export(t, "int32", DIM)["keys"].tolist()) == [-1, 2, 3]
    finally:
        ffi.destroy(t)


# 6 rows read every table shard by shard, 300 (1500 ids, over a block of
# 1024) in batch order but the filtered table's; dims 4, 8 and 6 (no
# fixed-width combine); 6 rows of 11 ids (KeepRows' any-length path), 300
# of 5.
@pytest.mark.parametrize("rows", [6, 300])
@pytest.mark.parametrize("key_dtype", ["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("prune", [True, False])
def test_group_pooled_lookup_is_each_features_pooled_lookup(rows, key_dtype, weighted, prune):
    rng = np.random.default_rng(rows + 1)
    specs = [(4, 0, "mean"), (8, 0, "sum"), (6, 2, "sqrtn"), (4, 0, "sqrtn"), (4, 2, "sum")]
    tables = [ffi.create(defaults(7, dim), key_dtype, filter_freq=freq)
              for dim, freq, _ in specs]
    try:
        parts = [batch(rng, rows, 11 if rows < 10 else 5, 60) for _ in specs]
        ids = np.stack([i for i, _ in parts], 1).astype(key_dtype)
        ids[-1, 0] = -1  # a row with no id
        weights = np.stack([w for _, w in parts], 1) if weighted else None
        for f, (t, (dim, _, comb)) in enumerate(zip(tables, specs)):  # half the ids admitted
            for _ in range(2):
                ffi.pooled_lookup(t, ids[:rows // 2, f], dim, comb, insert=True, prune=True)
        sizes = [ffi.size(t).tolist() for t in tables]
        got = np.asarray(ffi.group_pooled_lookup(tables, ids, [d for d, _, _ in specs],
                                                 [c for _, _, c in specs], weights, prune))
        want = np.concatenate([np.asarray(ffi.pooled_lookup(
            t, ids[:, f], dim, comb, None if weights is None else weights[:, f], insert=False,
            prune=prune)) for f, (t, (dim, _, comb)) in enumerate(zip(tables, specs))], 1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        # Rows with no id are zeros; every feature reads rows.
        if prune:
            empty = (ids[:, 0] < 0).all(1)
            assert empty.any()
            np.testing.assert_array_equal(got[empty, :4], 0.0)
        starts = np.cumsum([0] + [d for d, _, _ in specs])
        assert all(np.abs(got[:, a:b]).sum() > 0 for a, b in zip(starts[:-1], starts[1:]))
        assert [ffi.size(t).tolist() for t in tables] == sizes  # it inserts nothing
    finally:
        for t in tables:
            ffi.destroy(t)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_apply_pooled_is_apply_of_each_ids_share(combiner, weighted):
    with adagrad_tables(2) as tables:
        for step, ids, weights, grads, _ in pooled_steps(7, tables[0], combiner, weighted):
            shares = id_shares(ids, weights, combiner, True)
            ffi.lookup(tables[1], ids, DIM, prune=True)
            ffi.apply(tables[1], ids, grads[:, None, :] * shares[..., None], HYPER, step,
                      "adagrad", ADAGRAD, ("accumulator",), prune=True)
        a, b = (ffi.export(t, "int32", DIM) for t in tables)
        order_a, order_b = np.argsort(a["keys"]), np.argsort(b["keys"])
        np.testing.assert_array_equal(a["keys"][order_a], b["keys"][order_b])
        np.testing.assert_array_equal(a["versions"][order_a], b["versions"][order_b])
        np.testing.assert_allclose(a["values"][order_a], b["values"][order_b], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(a["slots"][order_a],
                                   b["slots"][order_b], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, message", [
    (lambda t: ffi.pooled_lookup(t, np.array([1, 2], np.int32), DIM, "sum"),
     r"`keys` must be \[rows, L\], got \[2\]"),
    (lambda t: ffi.pooled_lookup(t, np.ones((2, 3), np.int32), DIM, "max"),
     "`combiner` must be sum, mean or sqrtn, got 'max'"),
    (lambda t: ffi.pooled_lookup(t, np.ones((2, 3), np.int32), DIM, "sum", np.ones((2, 2))),
     r"`weights` must be empty or have the keys' shape \[2, 3\], got \[2, 2\]"),
    (lambda t: ffi.pooled_lookup(t, np.ones((2, 3), np.int32), DIM + 1, "sum"),
     r"`out` must be \[2, 4\], got \[2, 5\]"),
    (lambda t: ffi.apply_pooled(t, np.ones((2, 3), np.int32), np.zeros((3, DIM)), [0.1, 0.0], 1,
                                "sgd", ("learning_rate", "decay"), (), "sum"),
     r"`grads` must be \[2, 4\], got \[3, 4\]"),
    (lambda t: ffi.apply_pooled(t, np.ones((2, 3), np.int32), np.zeros((2, DIM)), [0.1, 0.0], 1,
                                "rmsprop", ("learning_rate", "decay"), (), "sum"),
     "unknown rule 'rmsprop'"),
    (lambda t: ffi.group_pooled_lookup([t], np.ones((2, 3), np.int32), [DIM], ["sum"]),
     r"`keys` must be \[rows, features, L\], got \[2, 3\]"),
    (lambda t: ffi.group_pooled_lookup([t], np.ones((2, 2, 3), np.int32), [DIM, DIM],
                                       ["sum", "sum"]),
     r"`tables` and `combiners` must name one table and one combiner per feature \(2\), "
     "got 1 and 2"),
    (lambda t: ffi.group_pooled_lookup([t, t], np.ones((2, 2, 3), np.int32), [DIM, DIM],
                                       ["sum", "max"]),
     "`combiner` must be sum, mean or sqrtn, got 'max'"),
    (lambda t: ffi.group_pooled_lookup([t, t], np.ones((2, 2, 3), np.int32), [DIM, DIM + 1],
                                       ["sum", "sum"]),
     r"`out` must be \[2, 8\] \(the features' dims summed\), got \[2, 9\]"),
    (lambda t: ffi.group_pooled_lookup([t, t], np.ones((2, 2, 3), np.int32), [DIM, DIM],
                                       ["sum", "sum"], np.ones((2, 2, 2))),
     r"`weights` must be empty or have the keys' shape \[2, 2, 3\], got \[2, 2, 2\]"),
    (lambda t: ffi.group_pooled_lookup([t, t + 10**6], np.ones((2, 2, 3), np.int32),
                                       [DIM, DIM], ["sum", "sum"]),
     "no embedding table has handle"),
    (lambda t: ffi.group_pooled_lookup([t], np.ones((2, 1, 3), np.int64), [DIM], ["sum"]),
     "the embedding table has int32 keys but `keys` is int64"),
])
def test_bad_input_is_an_error_naming_the_argument(call, message):
    t = ffi.create(defaults())
    try:
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(call(t))
        assert np.asarray(ffi.pooled_lookup(t, np.ones((1, 2), np.int32), DIM, "sum")).shape == (
            1, DIM)
    finally:
        ffi.destroy(t)


def test_a_table_combined_over_two_lengths_in_one_step_gets_one_update():
    """One layer on ids [B, 2] and [B, 3] in a step: the two combined
    lookups' shares go to one SGD update (vs NumPy)."""
    init = defaults(7)
    layer = EmbeddingVariable(DIM, combiner="mean", prune_invalid_ids=True,
                              initializer=keras.initializers.Constant(init),
                              default_value_dim=7)
    a_in = keras.Input(shape=(2,), dtype="int32")
    b_in = keras.Input(shape=(3,), dtype="int32")
    model = keras.Model([a_in, b_in], keras.layers.Concatenate()([layer(a_in), layer(b_in)]))
    model.compile(optimizer=SGD(0.5), loss="mse")
    a = np.array([[1, 2], [2, -1], [3, 3]], np.int32)
    b = np.array([[2, -1, -1], [4, 1, 2], [-1, -1, -1]], np.int32)
    model.fit([a, b], np.zeros((3, 2 * DIM), np.float32), batch_size=3, epochs=1, verbose=0)
    grads = {}
    for ids in (a, b):
        shares = id_shares(ids, None, "mean", True)
        out = (init[np.where(ids >= 0, ids, 0) % 7] * shares[..., None]).sum(1)
        g_out = 2 * out / out.size / 2  # mse over [3, 2 * DIM]: each half's share
        for r in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                if ids[r, k] >= 0:
                    grads[int(ids[r, k])] = grads.get(int(ids[r, k]), 0) + shares[r, k] * g_out[r]
    exported = layer.export()
    got = dict(zip(exported["keys"].tolist(), exported["values"]))
    assert sorted(got) == sorted(grads)
    for key, g in grads.items():
        np.testing.assert_allclose(got[key], init[key % 7] - 0.5 * g, rtol=1e-5, atol=1e-6)
    assert int(layer.iterations.value) == 1


@pytest.mark.parametrize("distinct", [False, True])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("rows", [6, 300])
def test_repeated_ids_count_each_occurrence_and_update_once_with_a_filter(combiner, rows,
                                                                          distinct):
    """Ids repeated within a row and across rows, weighted, with a counter
    filter (admission at 2 occurrences): every occurrence counts towards
    admission and frequency, a key not admitted before the lookup reads
    the no-permission row, and each admitted key gets one SGD update with
    its occurrences' shares summed (vs NumPy); through pooled_lookup and
    apply_pooled, or pooled_lookup_distinct (its distinct ids and inverse
    also vs NumPy) and apply_distinct."""
    rng = np.random.default_rng(rows)
    init = defaults(5)
    table = ffi.create(init, filter_freq=2, no_permission_value=-0.5)
    counts, values, versions = {}, {}, {}
    lr = 0.3
    try:
        for step in range(4):
            ids = rng.integers(0, 9, size=(rows, 4)).astype(np.int32)
            ids[:, 1] = ids[:, 0]  # a repeat within every row
            ids[rng.uniform(size=ids.shape) < 0.2] = -1
            weights = rng.uniform(-0.5, 2.0, size=ids.shape).astype(np.float32)
            grads = rng.normal(size=(rows, DIM)).astype(np.float32)
            # With "mean" the layers make ids of weight <= 0 padding.
            kept = (ids >= 0) & ((weights > 0) | (combiner == "sum"))
            ids_in = np.where(kept, ids, -1)
            if distinct:
                out, inverse, uniq, count = (np.asarray(x) for x in ffi.pooled_lookup_distinct(
                    table, ids_in, DIM, combiner, weights, prune=True))
                first_seen = list(dict.fromkeys(ids_in[kept].tolist()))
                assert uniq[:int(count)].tolist() == first_seen
                assert inverse[~kept].tolist() == [-1] * int((~kept).sum())
                np.testing.assert_array_equal(uniq[inverse[kept]], ids_in[kept])
            else:
                out = np.asarray(ffi.pooled_lookup(table, ids_in, DIM, combiner, weights,
                                                   prune=True))
            # What each occurrence reads: admitted before this lookup -> its
            # row, else the no-permission row.
            read = np.full(ids.shape + (DIM,), -0.5, np.float32)
            for (r, k), key in np.ndenumerate(ids):
                if kept[r, k] and key in values:
                    read[r, k] = values[key]
            shares = id_shares(np.where(kept, ids, -1), weights, combiner, True)
            np.testing.assert_allclose(out, (read * shares[..., None]).sum(1), rtol=1e-5,
                                       atol=1e-5, err_msg=f"step {step}")
            for key in ids[kept].tolist():
                counts[key] = counts.get(key, 0) + 1
                if counts[key] >= 2 and key not in values:
                    values[key] = init[key % 5].copy()
            if distinct:
                ffi.apply_distinct(table, uniq, count, inverse, grads, [lr, 0.0], step, "sgd",
                                   ("learning_rate", "decay"), (), combiner, weights)
            else:
                ffi.apply_pooled(table, ids_in, grads, [lr, 0.0], step, "sgd",
                                 ("learning_rate", "decay"), (), combiner, weights, prune=True)
            summed = {}
            for (r, k), key in np.ndenumerate(ids):
                if kept[r, k]:
                    summed[key] = summed.get(key, 0) + shares[r, k] * grads[r]
            for key, g in summed.items():
                if key in values:
                    values[key] = values[key] - lr * g
                    versions[key] = step
        got = ffi.export(table, "int32", DIM)
        order = np.argsort(got["keys"])
        assert got["keys"][order].tolist() == sorted(values)
        np.testing.assert_allclose(got["values"][order], [values[k] for k in sorted(values)],
                                   rtol=1e-5, atol=1e-5)
        assert got["freqs"][order].tolist() == [counts[k] for k in sorted(values)]
        assert got["versions"][order].tolist() == [versions[k] for k in sorted(values)]
    finally:
        ffi.destroy(table)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_distinct_lookup_and_update_are_the_pooled_ones_bit_for_bit(combiner, weighted):
    with adagrad_tables(2) as tables:
        steps = pooled_steps(11, tables[0], combiner, weighted,
                             positive_only=combiner != "sum" and weighted)
        for step, ids, weights, grads, a in steps:
            b, inverse, uniq, count = ffi.pooled_lookup_distinct(tables[1], ids, DIM, combiner,
                                                                 weights, prune=True)
            ffi.apply_distinct(tables[1], uniq, count, inverse, grads, HYPER, step, "adagrad",
                               ADAGRAD, ("accumulator",), combiner, weights)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        a, b = (ffi.export(t, "int32", DIM) for t in tables)
        order_a, order_b = np.argsort(a["keys"]), np.argsort(b["keys"])
        for part in ("keys", "values", "freqs", "versions", "slots"):
            np.testing.assert_array_equal(a[part][order_a], b[part][order_b], err_msg=part)


@pytest.mark.parametrize("key_dtype", ["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("prune", [True, False])
def test_the_group_training_lookup_is_each_tables_distinct_lookup_bit_for_bit(key_dtype, weighted,
                                                                            prune):
    # Five features of dims 4, 8 and 6 (filtered tables among them), each
    # from a table of its own, looked up side by side on XLA's pool (this
    # machine's threads): rows, inverse, distinct ids and counts, and the
    # tables after three steps with their updates, are those of one
    # pooled_lookup_distinct a table.
    if key_dtype == "int64" and ffi.int_dtype() != np.int64:
        pytest.skip("int64 keys need JAX's 64-bit mode")
    rng = np.random.default_rng(7)
    specs = [(4, 0, "mean"), (8, 0, "sum"), (6, 2, "sqrtn"), (4, 0, "sqrtn"), (4, 2, "sum")]
    dims, combiners = [d for d, _, _ in specs], [c for _, _, c in specs]
    made = [[ffi.create(defaults(7, dim), key_dtype, filter_freq=freq) for dim, freq, _ in specs]
            for _ in range(2)]
    try:
        for group, single in zip(*made):
            width = ffi.size(group)[2]
            assert width == ffi.size(single)[2] == 0
        for step in range(3):
            parts = [batch(rng, 300, 5, 60) for _ in specs]
            ids = np.stack([i for i, _ in parts]).astype(key_dtype)
            if not prune:
                ids = np.abs(ids)
            weights = np.stack([w for _, w in parts]) if weighted else None
            rows, inverse, distinct, count = ffi.group_pooled_lookup_distinct(
                made[0], ids, dims, combiners, weights, prune)
            assert inverse.shape == ids.shape and distinct.shape == (5, 1500)
            start = 0
            for f, (t, dim, comb) in enumerate(zip(made[1], dims, combiners)):
                w = None if weights is None else weights[f]
                want = ffi.pooled_lookup_distinct(t, ids[f], dim, comb, w, prune=prune)
                for got, one in zip((rows[:, start:start + dim], inverse[f], distinct[f],
                                     count[f]), want):
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(one))
                grads = rng.normal(size=(300, dim)).astype(np.float32)
                for table, (inv, uniq, n) in ((made[0][f], (inverse[f], distinct[f], count[f])),
                                              (t, want[1:])):
                    ffi.apply_distinct(table, uniq, n, inv, grads, [0.1, 0.0], step, "sgd",
                                       ("learning_rate", "decay"), (), comb, w)
                start += dim
            assert np.abs(np.asarray(rows)).sum() > 0
        for a, b, dim in zip(*made, dims):
            a, b = ffi.export(a, key_dtype, dim), ffi.export(b, key_dtype, dim)
            assert a["keys"].size > 0
            order_a, order_b = np.argsort(a["keys"]), np.argsort(b["keys"])
            for part in ("keys", "values", "freqs", "versions"):
                np.testing.assert_array_equal(a[part][order_a], b[part][order_b], err_msg=part)
    finally:
        for t in made[0] + made[1]:
            ffi.destroy(t)


@pytest.mark.parametrize("handles, ids, message", [
    ([0, 0], np.ones((2, 3, 2), np.int32),
     r"table \d+ serves features 0 and 1; a group's training lookup takes one table per "
     "feature"),
    ([0], np.ones((2, 3), np.int32), r"`keys` must be \[features, rows, L\], got \[2, 3\]"),
    ([0, 1], np.ones((2, 3, 2), np.int64), "has int32 keys but `keys` is int64"),
])
def test_the_group_training_lookup_refuses_bad_input(handles, ids, message):
    tables = [ffi.create(defaults()), ffi.create(defaults())]
    try:
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(ffi.group_pooled_lookup_distinct(
                [tables[h] for h in handles], ids, [DIM] * len(handles), ["sum"] * len(handles)))
        assert [ffi.size(t)[0] for t in tables] == [0, 0]  # nothing inserted
    finally:
        for t in tables:
            ffi.destroy(t)


@pytest.mark.parametrize("count, inverse, message", [
    (3, [[0, 1, 2], [3, -1, -1]], r"`inverse` must be in \[-1, count = 3\), got 3"),
    (7, [[0, 1, 2], [0, -1, -1]], r"`count` must be in \[0, 6\], got 7"),
    (3, [[0, 1, -2], [0, -1, -1]], r"`inverse` must be in \[-1, count = 3\), got -2"),
])
def test_apply_distinct_refuses_an_inverse_or_count_out_of_range(count, inverse, message):
    t = ffi.create(defaults())
    try:
        with pytest.raises(Exception, match=message):
            ffi.apply_distinct(t, np.arange(6, dtype=np.int32), count,
                               np.array(inverse, np.int32), np.zeros((2, DIM)), [0.1, 0.0], 1,
                               "sgd", ("learning_rate", "decay"), (), "sum")
    finally:
        ffi.destroy(t)
