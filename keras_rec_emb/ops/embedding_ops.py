"""Fused embedding lookups over many tables and variables (DeepRec's Group
Embedding); see docs/semantics.md, 'Lookups: fused, grouped, strings'."""

import keras
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context
from keras_rec_emb.backend.tensorflow import model_fusion as _model_fusion
from keras_rec_emb._checks_core import (COMBINERS, check_bool, check_float, check_int,
                                        positive_int)
from keras_rec_emb.backend.tensorflow.checks import (assert_ids_in_range, checked_sparse_ids,
                                                     integer_ids)
from keras_rec_emb.backend.tensorflow.embed_reduce import combine_rows
from keras_rec_emb.backend.tensorflow.ids import (FlatIds, checked_id_shape, collapse_outer,
                                                  flat_ids_and_splits, int_ids, sparse_row_splits,
                                                  weights_values)
from keras_rec_emb.backend.tensorflow.op_args import named_inputs, named_outputs
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable, TableVariable


# -- parameters --------------------------------------------------------------
class _Param:
    """A normalized parameter: an embedding table or a dense [vocab, dim] one."""

    def __init__(self, table=None, variable=None):
        self.table = table
        self.variable = variable

    @property
    def key(self):
        return id(self.table) if self.table is not None else id(self.variable)

    @property
    def dim(self):
        if self.table is not None:
            return self.table.dim
        return int(self.variable.shape[-1])


def _as_param(p, index):
    if isinstance(p, keras.layers.Layer) and hasattr(p, "_table_for_lookup"):
        return _Param(table=p._table_for_lookup())  # an EmbeddingVariable
    if isinstance(p, EmbeddingTable):
        return _Param(table=p)
    if isinstance(p, TableVariable):
        return _Param(table=p.table)
    if isinstance(p, keras.layers.Embedding):
        if not p.built:
            p.build()
        p = p.embeddings
    if isinstance(p, (keras.Variable, tf.Variable)) or tf.is_tensor(p):
        shape = p.shape
        if shape.rank != 2 if isinstance(shape, tf.TensorShape) else len(shape) != 2:
            raise ValueError(
                f"`params[{index}]` must be a [vocab, dim] variable. Received "
                f"shape {tuple(shape)}"
            )
        if shape[-1] is None:
            raise ValueError(
                f"`params[{index}]` must have a static last dimension. "
                f"Received shape {tuple(shape)}"
            )
        return _Param(variable=p)
    raise TypeError(
        f"`params[{index}]` must be an EmbeddingVariable layer, an "
        "EmbeddingTable (or its `.variable`), a keras.layers.Embedding, or a "
        f"[vocab, dim] keras.Variable / tf.Variable. Received: {p!r}"
    )


def _dense_value(variable):
    if isinstance(variable, keras.Variable):
        value = variable.value
    else:
        value = tf.convert_to_tensor(variable)
    return tf.cast(value, tf.float32) if value.dtype != tf.float32 else value


def _as_list(x, n, what, check, *args, **kwargs):
    """`x` (one value or one per feature) as a list of `n`, each `check`ed."""
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise ValueError(
                f"`{what}` must have one entry per feature ({n}). Received "
                f"{len(x)}: {x!r}"
            )
        out = list(x)
    else:
        out = [x] * n
    for v in out:
        check(what, v, *args, **kwargs)
    return out


# -- the fused op and its gradient --------------------------------------------
def _fused_lookup(params, flat_ids, splits, weights, combiners, max_norms,
                  default_ids, prunes, sequences, training, name, concat=False):
    """One KRE>GroupLookup over features; with `concat`, `[outputs side by side]`."""
    # Stock ops in a stock-serving trace and over sharded tables: the fused
    # op needs every table in this process (docs/semantics.md, 'Lookups: fused, grouped, strings').
    stock_table = _serving_context.stock_reader()
    if stock_table is None or training:
        params = _fused_params(params)
    if stock_table is not None and not training:
        stock = {"stock_table": stock_table}
    elif any(p.table is not None and not p.table.local for p in params):
        outs = _exchanged_lookup(params, flat_ids, splits, weights, combiners, max_norms,
                                 default_ids, prunes, sequences, training, name, concat)
        if outs is not None:
            return outs
        stock = {"insert": bool(training)}
    else:
        stock = None
    if stock is not None:
        outs = stock_group_lookup(params, flat_ids, splits, weights, combiners, max_norms,
                                  default_ids, prunes, sequences, **stock)
        return [tf.concat(outs, -1)] if concat else outs
    _refuse_distribution(params, "A group embedding lookup")
    return _group_lookup_op(params, flat_ids, splits, weights, combiners, max_norms,
                            default_ids, prunes, sequences, training, name, concat)


def _fused_params(params):
    """`params` with each one-worker sharded table replaced by its whole C++ table."""
    out = []
    for p in params:
        if p.table is not None and not p.table.local and p.table.fused_table is not None:
            p = _Param(table=p.table.fused_table)
        out.append(p)
    return out


def _refuse_distribution(params, what):
    """Refuses a strategy as a table's own lookup does, except over its replicas' shards."""
    for p in params:
        if p.table is not None:
            p.table._refuse_strategy(what)  # pylint: disable=protected-access
        else:
            _ops.refuse_distribution(what)


def _distinct_params(params):
    """(tables, dense params, each feature's index among them), tables first (the
    ops' input order); trainable tables are marked as read by the tape."""
    tables = list({p.key: p for p in params if p.table is not None}.values())
    dense = list({p.key: p for p in params if p.table is None}.values())
    index = {p.key: i for i, p in enumerate(tables + dense)}
    for t in tables:
        if t.table.trainable:
            _compat.variable_accessed(t.table.variable)
    return tables, dense, [index[p.key] for p in params]


def _group_lookup_op(params, flat_ids, splits, weights, combiners, max_norms, default_ids,
                     prunes, sequences, training, name, concat):
    """The KRE>GroupLookup op over local tables and dense params, each given once."""
    tables, dense, feature_params = _distinct_params(params)
    attrs = dict(
        table_key_dtypes=[t.table.key_dtype for t in tables],
        param_dims=[p.dim for p in tables + dense],
        feature_params=feature_params,
        combiners=list(combiners),
        max_norms=[float(m or 0.0) for m in max_norms],
        default_ids=[-1 if d is None else int(d) for d in default_ids],
        prune_invalid_ids=[bool(b) for b in prunes],
        is_sequence=[bool(b) for b in sequences],
    )
    _ops.refuse_xla("A group embedding lookup")
    outs, _, _ = _ops.gen().kre_group_lookup(
        [t.table.handle for t in tables], [_dense_value(d.variable) for d in dense],
        list(flat_ids), list(splits), list(weights), insert=bool(training),
        num_params=len(tables) + len(dense), name=name or "GroupLookup",
        concat=bool(concat), **attrs)
    return [outs[0]] if concat else list(outs)


def _exchanged_lookup(params, flat_ids, splits, weights, combiners, max_norms, default_ids,
                      prunes, sequences, training, name, concat):
    """Tables of one `exchange_group`: one exchange of the distinct ids' rows, then
    KRE>GroupLookup pools them as dense params, so the gradient reaching the
    exchange has a row per distinct id. None (the stock path) for other tables,
    a default id, a sequence feature or a max_norm."""
    group = {p.table.exchange_group if p.table is not None else None for p in params}
    if (len(group) != 1 or None in group or any(d is not None for d in default_ids)
            or any(sequences) or any(max_norms)):
        return None
    features_of = {}
    for f, p in enumerate(params):
        features_of.setdefault(p.key, []).append(f)
    order = [params[features[0]] for features in features_of.values()]
    kept, keep = [None] * len(params), [None] * len(params)
    for f, ids in enumerate(flat_ids):
        ids = tf.cast(ids, tf.int64)
        if prunes[f]:  # pruned ids are not looked up: they get place -1
            keep[f] = ids >= 0
            ids = tf.boolean_mask(ids, keep[f])
        kept[f] = tf.cast(ids, params[f].table.key_dtype)
    tables = [p.table for p in order]
    flats = [tf.concat([kept[f] for f in features_of[p.key]], 0) for p in order]
    looked = type(tables[0]).lookup_many(tables, flats, bool(training), distinct=True)
    places = [None] * len(params)
    for p, (_, index) in zip(order, looked):
        _split_rows(places, features_of[p.key], [kept[f] for f in features_of[p.key]], index)
    for f, part in enumerate(places):
        part = tf.cast(part, tf.int64)
        if keep[f] is not None:
            part = tf.tensor_scatter_nd_update(
                tf.fill(tf.shape(keep[f], out_type=tf.int64), tf.constant(-1, tf.int64)),
                tf.where(keep[f]), part)
        places[f] = part
    # Each table's distinct rows stand in as a dense parameter of its features.
    dense = {p.key: _Param(variable=rows) for p, (rows, _) in zip(order, looked)}
    return _group_lookup_op([dense[p.key] for p in params], places, splits, weights, combiners,
                            max_norms, default_ids, prunes, sequences, training, name, concat)


# -- the same lookup with stock TensorFlow ops (export_for_serving) ------------
def _checked_splits(splits, nnz):
    """`splits` checked with stock ops to be the row splits of `nnz` values, so a
    malformed serving request errors instead of reading wrong rows."""
    message = ("row_splits of a ragged input must have at least one entry, start at "
               "0, never decrease and end at the number of values")
    n = tf.size(splits)
    ok = tf.logical_and(n >= 1, tf.reduce_all(splits[1:] >= splits[:-1]))
    ok = tf.logical_and(ok, tf.equal(tf.concat([splits[:1], [0]], 0)[0], 0))
    ok = tf.logical_and(ok, tf.equal(tf.concat([[nnz], splits], 0)[-1], nnz))
    # The raw op: tf.debugging.Assert puts an Assert over int64 data in a
    # tf.cond of its own (a subgraph per feature, per trace).
    check = tf.raw_ops.Assert(condition=ok, data=[message, "row_splits:", splits, "values:", nnz],
                              summarize=16)
    with tf.control_dependencies([check]):
        return tf.identity(splits)


def stock_group_lookup(params, flat_ids, splits, weights, combiners, max_norms,
                       default_ids, prunes, sequences, stock_table=None, insert=False):
    """KRE>GroupLookup (inference) with stock TensorFlow ops, feature by feature.
    Rows come from `stock_table(table).lookup(keys)`, or from the table itself
    (`insert`: a training lookup, one per table for all its features)."""
    prepared = []
    for ids, s, w, combiner, default_id, prune in zip(
            flat_ids, splits, weights, combiners, default_ids, prunes):
        ids = tf.cast(ids, tf.int64)
        s = tf.cast(s, tf.int64)
        if stock_table is not None:  # a served graph: requests may be malformed
            s = _checked_splits(s, tf.size(ids, out_type=tf.int64))
        batch = tf.shape(s, out_type=tf.int64)[0] - 1
        rows_of = tf.ragged.row_splits_to_segment_ids(s, out_type=tf.int64)
        if w.shape.num_elements() == 0:  # statically unweighted
            weighted = tf.constant(False)
            w = tf.ones(tf.shape(ids), tf.float32)
        else:
            weighted = tf.size(w) > 0
            w = tf.cond(weighted, lambda w=w: tf.reshape(w, [-1]),
                        lambda ids=ids: tf.ones(tf.shape(ids), tf.float32))
        if prune:
            keep = ids >= 0
            ids, w, rows_of = (tf.boolean_mask(x, keep) for x in (ids, w, rows_of))
        if combiner != "sum":  # as TF's safe_embedding_lookup_sparse
            keep = tf.logical_or(w > 0, tf.logical_not(weighted))
            ids, w, rows_of = (tf.boolean_mask(x, keep) for x in (ids, w, rows_of))
        if default_id is not None:
            counts = tf.math.unsorted_segment_sum(tf.ones_like(rows_of), rows_of, batch)
            empty = tf.where(tf.equal(counts, 0))[:, 0]
            ids = tf.concat([ids, tf.fill(tf.shape(empty), tf.constant(default_id, tf.int64))], 0)
            w = tf.concat([w, tf.ones(tf.shape(empty), tf.float32)], 0)
            rows_of = tf.concat([rows_of, empty], 0)
            order = tf.argsort(rows_of, stable=True)
            ids, w, rows_of = (tf.gather(x, order) for x in (ids, w, rows_of))
        prepared.append((ids, w, rows_of, batch))
    rows = _feature_rows(params, [f[0] for f in prepared], stock_table, insert)
    outs = []
    for r, (_, w, rows_of, batch), combiner, max_norm, sequence in zip(
            rows, prepared, combiners, max_norms, sequences):
        if max_norm:
            r = tf.clip_by_norm(r, max_norm, axes=[1])
        if sequence:
            outs.append(tf.RaggedTensor.from_value_rowids(
                r * w[:, None], rows_of, nrows=batch).to_tensor())
        else:
            outs.append(combine_rows(r, rows_of, batch, combiner, w))
    return outs


def _feature_rows(params, ids_list, stock_table, insert):
    """The rows of each feature's ids; without `stock_table`, one lookup per table
    (a sharded table exchanges once per table, not per feature)."""
    rows = [None] * len(params)
    shared = {}
    for i, p in enumerate(params):
        if p.table is None:
            rows[i] = tf.gather(_dense_value(p.variable), ids_list[i])
        elif stock_table is not None:
            rows[i] = stock_table(p.table).lookup(tf.cast(ids_list[i], p.table.key_dtype))
        else:
            shared.setdefault(p.key, []).append(i)
    # Tables that exchange ids and rows between workers (`exchange_group`)
    # are looked up together: one exchange for all of them.
    together = {}
    for features in shared.values():
        table = params[features[0]].table
        ids = [tf.cast(ids_list[i], table.key_dtype) for i in features]
        flat = tf.concat(ids, 0) if len(ids) > 1 else ids[0]
        group = table.exchange_group
        if group is not None:
            together.setdefault(group, []).append((features, table, ids, flat))
            continue
        _split_rows(rows, features, ids, table.lookup(flat, insert=insert))
    for members in together.values():
        tables = [table for _, table, _, _ in members]
        looked = type(tables[0]).lookup_many(tables, [flat for _, _, _, flat in members], insert)
        for (features, _, ids, _), rows_of_table in zip(members, looked):
            _split_rows(rows, features, ids, rows_of_table)
    return rows


def _split_rows(rows, features, ids, looked):
    """`looked` (the features' rows, concatenated) into `rows`."""
    parts = tf.split(looked, [tf.size(x) for x in ids], 0) if len(ids) > 1 else [looked]
    for i, r in zip(features, parts):
        rows[i] = r


def _attrs_of(op, names):
    return {n: op.get_attr(n) for n in names}


_GRAD_ATTRS = ("table_key_dtypes", "param_dims", "feature_params", "combiners",
               "max_norms", "default_ids", "prune_invalid_ids", "is_sequence", "concat")


@tf.RegisterGradient("KRE>GroupLookup")
def _group_lookup_grad(op, *grads):
    """IndexedSlices over distinct keys per table, over distinct rows per dense param."""
    inputs, outputs = named_inputs(op), named_outputs(op)
    nt = len(inputs["tables"])
    nf = len(outputs["outputs"])
    unique_ids = outputs["unique_ids"]
    grads = [tf.zeros_like(out) if g is None else g
             for g, out in zip(grads[:nf], outputs["outputs"])]
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    attrs = _attrs_of(op, _GRAD_ATTRS)
    unique_grads = _ops.gen().kre_group_lookup_grad(
        inputs["tables"], inputs["dense_params"], inputs["ids"], inputs["row_splits"],
        inputs["weights"], unique_ids, outputs["inverse"], grads, **attrs)
    result = []
    for p in range(nt):
        result.append(tf.IndexedSlices(unique_grads[p], unique_ids[p]))
    for d, dense in enumerate(inputs["dense_params"]):
        p = nt + d
        result.append(tf.IndexedSlices(unique_grads[p], unique_ids[p],
                                       dense_shape=tf.shape(dense, out_type=tf.int64)))
    return result + [None] * (3 * nf)


_STACKED_ATTRS = ("table_key_dtypes", "table_dims", "feature_tables", "combiners",
                  "default_ids")


def stacked_pooled_lookup(params, ids, combiners, default_ids, name=None, what="`ids`"):
    """Inference lookup of stacked ids `[batch, F, L]` (ids < 0 pad) in one
    KRE>StackedPooledLookup: `[batch, sum of dims]`, as
    `group_embedding_lookup_sparse(..., concat=True)`. None where the op does not
    serve: non-local or dense params, int64 ids over int32 and int64 tables
    together, or a stock-serving trace. Over int32 tables alone, int64 ids are
    checked once to fit (`what` names them)."""
    if _serving_context.tracing_stock():
        return None
    ps = _fused_params([_as_param(p, i) for i, p in enumerate(params)])
    if any(p.table is None or not p.table.local for p in ps):
        return None
    if ids.dtype == tf.int64:
        key_dtypes = {tf.as_dtype(p.table.key_dtype) for p in ps}
        if key_dtypes == {tf.int32}:
            ids = assert_ids_in_range(ids, tf.int32, what, lower=False)
        elif tf.int32 in key_dtypes:
            return None
    tables, _, feature_tables = _distinct_params(ps)
    _refuse_distribution(tables, "A group embedding lookup")
    _ops.refuse_xla("A group embedding lookup")
    return _ops.gen().kre_stacked_pooled_lookup(
        [t.table.handle for t in tables], ids, num_features=len(ps),
        table_key_dtypes=[t.table.key_dtype for t in tables],
        table_dims=[t.dim for t in tables],
        feature_tables=feature_tables,
        combiners=list(combiners),
        default_ids=[-1 if d is None else int(d) for d in default_ids],
        name=name or "StackedPooledLookup")


@tf.RegisterGradient("KRE>StackedPooledLookup")
def _stacked_pooled_lookup_grad(op, grad):
    """The group lookup's gradient (e.g. a tape with `training=False`), per table an
    IndexedSlices over the keys it looks up again."""
    nt, nf = op.get_attr("num_tables"), op.get_attr("num_features")
    tables, ids = list(op.inputs[:nt]), op.inputs[nt]
    a = _attrs_of(op, _STACKED_ATTRS)
    attrs = dict(table_key_dtypes=a["table_key_dtypes"], param_dims=a["table_dims"],
                 feature_params=a["feature_tables"], combiners=a["combiners"],
                 max_norms=[0.0] * nf, default_ids=a["default_ids"],
                 prune_invalid_ids=[True] * nf, is_sequence=[False] * nf, concat=True)
    values, splits = _ops.unstack_kept_ids(ids)
    weights = [tf.zeros([0], tf.float32)] * nf
    # An inference lookup: a pooled feature's unique_ids list every kept id
    # (repeats too); the gradient's IndexedSlices then repeat them alike.
    _, unique_ids, inverse = _ops.gen().kre_group_lookup(
        tables, [], values, splits, weights, num_params=nt, insert=False, **attrs)
    grads = [tf.convert_to_tensor(grad)] + [tf.zeros([0], tf.float32)] * (nf - 1)
    unique_grads = _ops.gen().kre_group_lookup_grad(
        tables, [], values, splits, weights, unique_ids, inverse, grads, **attrs)
    return [tf.IndexedSlices(unique_grads[p], unique_ids[p]) for p in range(nt)] + [None]


# -- a layer's pooled lookup: a group of one ------------------------------------
class LayerCall:
    """One pooled layer call for `layers_lookup` (`insert`: training, trainable)."""

    __slots__ = ("layer", "table", "inputs", "weights", "insert", "single", "combiner", "prune")

    def __init__(self, layer, table, inputs, weights, insert, single=False):
        self.layer, self.table, self.inputs, self.weights = layer, table, inputs, weights
        self.insert = insert
        # `single`: a layer without a combiner, each id its own row (a "sum"
        # of one id, every id a key), rows `ids.shape + [dim]`.
        self.single = single
        self.combiner = "sum" if single else layer.combiner
        self.prune = False if single else layer.prune_invalid_ids


def _pooled_call(layer, inputs, training, weights=None):
    """The `LayerCall` of `EmbeddingVariable(combiner=...)`, its ids' shape checked."""
    inputs = checked_id_shape(inputs, f"{type(layer).__name__} '{layer.name}'", layer.combiner)
    return LayerCall(layer, layer._table_for_lookup(), inputs, weights,
                     bool(training) and layer.trainable)


def pooled_layer_lookup(layer, inputs, training, weights=None):
    """`EmbeddingVariable(combiner=...)`'s output: a fused group of one feature.
    Every id is a key (-1 too) unless `prune_invalid_ids`; dense `[..., L]` ids
    give `[..., dim]`, ragged or sparse ones `[batch, dim]`. For "mean" and
    "sqrtn", ids of weight <= 0 become padding."""
    return layers_lookup([_pooled_call(layer, inputs, training, weights)])[0]


def _lookup_entries(entries, training):
    """The rows of one model call's planned entries, one KRE>GroupLookup per insert flag."""
    calls = []
    for e in entries:
        layer = e.layer
        if layer.combiner is not None:
            calls.append(_pooled_call(layer, e.inputs, training))
        else:  # dense ids, checked integer when planned
            calls.append(LayerCall(layer, layer._table_for_lookup(),
                                   tf.convert_to_tensor(e.inputs), None,
                                   bool(training) and layer.trainable, single=True))
    rows = [None] * len(calls)
    by_insert = {}
    for i, c in enumerate(calls):
        by_insert.setdefault(c.insert, []).append(i)
    for group in by_insert.values():
        for i, r in zip(group, layers_lookup([calls[i] for i in group])):
            rows[i] = r
    return rows


_model_fusion.lookup_entries = _lookup_entries


def layers_lookup(calls):
    """The rows of `LayerCall`s of one insert flag from one KRE>GroupLookup."""
    n = len(calls)
    insert = calls[0].insert
    name = f"{calls[0].layer.name}_lookup" if n == 1 else "pooled_layers_lookup"
    flat, splits, weights, outers = [], [], [], []
    for c in calls:
        v, s, w, outer = _layer_ids(c)
        flat.append(v)
        splits.append(s)
        weights.append(w)
        outers.append(outer)
    outs = _fused_lookup(
        [_Param(table=c.table) for c in calls], flat, splits, weights,
        [c.combiner for c in calls], [None] * n, [None] * n, [c.prune for c in calls],
        [False] * n, training=insert, name=name)
    rows = []
    for c, out, outer in zip(calls, outs, outers):
        if outer is not None:  # [rows, dim] back to the ids' [..., dim]
            out = tf.ensure_shape(tf.reshape(out, tf.concat([outer[0], [c.table.dim]], 0)),
                                  outer[1].concatenate([c.table.dim]))
        rows.append(out if c.layer.compute_dtype == "float32"
                    else tf.cast(out, c.layer.compute_dtype))
    return rows


def _layer_ids(call):
    """A call's ids as `(values, row_splits, weights, outer)`; `outer` is the dense
    ids' leading (dynamic, static) shape or None."""
    layer, inputs, weights = call.layer, call.inputs, call.weights
    if call.single:  # each id its own row: ids [..., 1]
        inputs = tf.expand_dims(inputs, -1)
    what = f"{type(layer).__name__} '{layer.name}'"
    key_dtype = tf.as_dtype(layer.key_dtype)

    def keys(values):  # int64, as the op takes them, after the fit check
        return tf.cast(integer_ids(values, what, key_dtype), tf.int64)

    outer = None
    if isinstance(inputs, tf.RaggedTensor):
        values, splits = keys(inputs.values), tf.cast(inputs.row_splits, tf.int64)
    elif isinstance(inputs, tf.SparseTensor):
        sp = checked_sparse_ids(inputs, f"{what} ids")
        values, splits = keys(sp.values), sparse_row_splits(sp)
    else:
        ids = keys(inputs)
        shape = tf.shape(ids, out_type=tf.int64)
        length = ids.shape[-1] if ids.shape[-1] is not None else shape[-1]
        rows = tf.reduce_prod(shape[:-1])
        values = tf.reshape(ids, [-1])
        splits = tf.range(rows + 1, dtype=tf.int64) * length
        outer = (shape[:-1], ids.shape[:-1])
    if weights is None:
        flat_weights = tf.zeros([0], tf.float32)
    else:
        flat_weights = (tf.reshape(weights, [-1]) if outer is not None else weights.values)
        if call.combiner != "sum":  # dropped: not inserted, counted or updated
            values = tf.where(flat_weights > 0, values, tf.constant(-1, values.dtype))
    return values, splits, flat_weights, outer


# -- public API ----------------------------------------------------------------
@tf.autograph.experimental.do_not_convert
def _group(params, ids_list, combiners, weights_list, sequences, max_norms,
           default_ids, prunes, params_num_per_group, training, name,
           what_ids="sp_ids", what_weights="sp_weights", concat=False):
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"`params` must be a list. Received: params={params!r}")
    if not isinstance(ids_list, (list, tuple)):
        raise TypeError(f"`{what_ids}` must be a list. Received: {what_ids}={ids_list!r}")
    n = len(params)
    if n == 0:
        raise ValueError("`params` must not be empty. Received: params=[]")
    if len(ids_list) != n:
        raise ValueError(
            f"`params` and `{what_ids}` must have the same length. Received "
            f"len(params)={n} and len({what_ids})={len(ids_list)}"
        )
    positive_int("params_num_per_group", params_num_per_group, allow_none=True)
    ps = [_as_param(p, i) for i, p in enumerate(params)]
    flat, splits, weights, outers = [], [], [], []
    no_weights = None  # one empty weights tensor shared by unweighted features
    for i, ids in enumerate(ids_list):
        ids, outer = collapse_outer(ids, f"{what_ids}[{i}]")
        if outer is not None and sequences[i]:
            raise ValueError(
                f"`{what_ids}[{i}]` of a sequence feature (`is_sequence`) must "
                f"be [batch, None]. Received shape {outer[1].concatenate([None])}"
            )
        outers.append(outer)
        v, s = flat_ids_and_splits(ids, f"{what_ids}[{i}]")
        flat.append(v)
        splits.append(s)
        w = None if weights_list is None else weights_list[i]
        if w is not None and outer is not None:  # the ids' [d0 * ... * dn-1, dn]
            w, _ = collapse_outer(w, f"{what_weights}[{i}]")
        if w is None:
            if no_weights is None:
                no_weights = weights_values(None, ids, s, f"{what_weights}[{i}]",
                                            f"{what_ids}[{i}]")
            weights.append(no_weights)
        else:
            weights.append(weights_values(w, ids, s, f"{what_weights}[{i}]",
                                          f"{what_ids}[{i}]"))
        if ps[i].table is not None and not (isinstance(ids, FlatIds) and ids.in_range):
            # int64 ids must fit an int32 table's keys
            flat[i] = assert_ids_in_range(v, ps[i].table.key_dtype, f"`{what_ids}[{i}]`",
                                          lower=not prunes[i])
    # Split into ops of at most params_num_per_group distinct parameters.
    groups, keys = [], []
    for i, p in enumerate(ps):
        for g, k in zip(groups, keys):
            if p.key in k or params_num_per_group is None or len(k) < params_num_per_group:
                g.append(i)
                k.add(p.key)
                break
        else:
            groups.append([i])
            keys.append({p.key})
    if concat and len(groups) == 1 and all(o is None for o in outers):
        # One op writes the outputs side by side: no concatenation copy.
        return _fused_lookup(ps, flat, splits, weights, combiners, max_norms, default_ids,
                             prunes, sequences, training, name, concat=True)[0]
    outputs = [None] * n
    for gi, g in enumerate(groups):
        op_name = name if len(groups) == 1 else (f"{name}_{gi}" if name else None)
        outs = _fused_lookup(
            [ps[i] for i in g], [flat[i] for i in g], [splits[i] for i in g],
            [weights[i] for i in g], [combiners[i] for i in g],
            [max_norms[i] for i in g], [default_ids[i] for i in g],
            [prunes[i] for i in g], [sequences[i] for i in g], training, op_name)
        for i, o in zip(g, outs):
            outputs[i] = o
    for i, outer in enumerate(outers):
        if outer is not None:  # back to [d0, ..., dn-1, dim], as TF does
            dim = outputs[i].shape[-1]
            out = tf.reshape(outputs[i], tf.concat(
                [tf.cast(outer[0], tf.int32), [dim]], 0))
            outputs[i] = tf.ensure_shape(out, outer[1].concatenate([dim]))
    return tf.concat(outputs, -1) if concat else outputs


def group_embedding_lookup_sparse(params, sp_ids, combiners, sp_weights=None,
                                  is_sequence=False, params_num_per_group=None,
                                  name=None, *, max_norm=None, default_id=None,
                                  prune_invalid_ids=True, training=False, concat=False):
    """Looks up and combines many sparse features in one fused op.

    Feature `i` reads `params[i]` with ids `sp_ids[i]` (`[batch, None]`) and
    combines each row's embeddings with `combiners[i]`. All features (and
    all their parameters) run in one C++ op, and their gradients in one
    more, however many features there are.

    Args:
        params: list of embedding parameters, one per feature: our tables
            (`EmbeddingVariable` layers, `EmbeddingTable`s or their
            `.variable`) and/or dense `[vocab, dim]` `keras.Variable` /
            `tf.Variable` / `keras.layers.Embedding`. Dims may differ; the
            same parameter may serve several features.
        sp_ids: list of `tf.RaggedTensor` / `tf.SparseTensor` `[batch, None]`
            (or dense `[batch, L]` / `[batch]`) integer ids, one per feature.
            Sparse or dense ids `[d0, ..., dn]` of rank > 2 (not of sequence
            features) are combined along the last axis, as TF does.
        combiners: list of `"sum"`, `"mean"` or `"sqrtn"` (or one string for
            all features).
        sp_weights: `None` or a list (entries may be `None`) of per-id
            weights with the same structure as the ids. As in TF's
            `safe_embedding_lookup_sparse` (and DeepRec's fused lookup), a
            `"mean"` or `"sqrtn"` feature drops ids whose weight is `<= 0`;
            `"sum"` keeps them.
        is_sequence: bool or list of bools. A sequence feature is not
            combined: it gives `[batch, T, dim]` (rows times weights, `T` the
            longest row in the batch, zero padded).
        params_num_per_group: `None` or int. At most this many distinct
            parameters per fused op (features sharing a parameter stay in
            one op). Defaults to `None`: one op.
        name: str or `None`. Name of the op.
        max_norm: `None`, float or list. Rows are scaled to L2 norm at most
            `max_norm` before combining.
        default_id: `None`, int or list. A row with no (valid) id reads this
            id with weight 1; `None` gives zeros.
        prune_invalid_ids: bool or list. Drop ids < 0 (padding). Defaults to
            `True`.
        training: bool. Insert (and count) unseen ids into tables, as
            `EmbeddingVariable` does in training. Defaults to `False`
            (inference: unseen ids read their initial row).
        concat: bool. Return one `[batch, sum(dim_i)]` tensor, the features'
            outputs side by side in order (what `tf.concat(outputs, -1)`
            gives); the fused op writes them in place, saving the copy.
            No sequence features. Defaults to `False`.

    Returns:
        A list of float32 tensors, `[batch, dim_i]` (`[d0, ..., dn-1, dim_i]`
        for ids of rank > 2, `[batch, T, dim_i]` for sequence features); with
        `concat`, one tensor.

    Example:

    >>> table = keras_rec_emb.layers.EmbeddingVariable(4)
    >>> matrix = keras.Variable(np.ones((10, 2), "float32"))
    >>> ids = tf.ragged.constant([[1, 5], [], [7]], dtype=tf.int64)
    >>> a, b = keras_rec_emb.ops.group_embedding_lookup_sparse(
    ...     [table, matrix], [ids, ids], ["mean", "sum"])
    >>> a.shape, b.shape
    (TensorShape([3, 4]), TensorShape([3, 2]))
    >>> b.numpy()[:, 0]
    array([2., 0., 1.], dtype=float32)
    """
    n = len(params) if isinstance(params, (list, tuple)) else 0
    if isinstance(combiners, str):
        combiners = [combiners] * n
    if not isinstance(combiners, (list, tuple)):
        raise TypeError(f"`combiners` must be a list of strings. Received: {combiners!r}")
    if isinstance(params, (list, tuple)) and len(combiners) != n:
        raise ValueError(
            "`params` and `combiners` must have the same length. Received "
            f"len(params)={n} and len(combiners)={len(combiners)}"
        )
    for c in combiners:
        if c not in COMBINERS:
            raise ValueError(f"`combiners` entries must be one of {COMBINERS}. Received: "
                             f"combiner={c!r}")
    if sp_weights is not None and (not isinstance(sp_weights, (list, tuple))
                                   or len(sp_weights) != n):
        raise ValueError("`sp_weights` must be None or a list with one entry per "
                         f"feature ({n}). Received: {sp_weights!r}")
    check_bool("concat", concat)
    sequences = _as_list(is_sequence, n, "is_sequence", check_bool)
    if concat and any(sequences):
        raise ValueError("`concat=True` needs no sequence features. Received: "
                         f"is_sequence={is_sequence!r}")
    return _group(
        params, sp_ids, list(combiners), sp_weights, sequences,
        _as_list(max_norm, n, "max_norm", check_float, 0, min_open=True, allow_none=True),
        _as_list(default_id, n, "default_id", check_int, 0, allow_none=True),
        _as_list(prune_invalid_ids, n, "prune_invalid_ids", check_bool),
        params_num_per_group, training, name, concat=concat)


def group_embedding_lookup(params, ids, name=None, *, training=False):
    """Gathers the rows of many id tensors in one fused op.

    Args:
        params: list of embedding parameters, as in
            `group_embedding_lookup_sparse`.
        ids: list of integer tensors of any shape, one per parameter.
        name: str or `None`. Name of the op.
        training: bool. Insert (and count) unseen ids into tables. Defaults
            to `False`.

    Returns:
        A list of float32 tensors, `ids[i].shape + (dim_i,)`.

    Example:

    >>> matrix = keras.Variable(np.arange(20, dtype="float32").reshape(10, 2))
    >>> table = keras_rec_emb.layers.EmbeddingVariable(3)
    >>> x, y = keras_rec_emb.ops.group_embedding_lookup(
    ...     [matrix, table], [np.array([[1, 2]]), np.array([4, 5, 6])])
    >>> x.numpy().tolist(), y.shape
    ([[[2.0, 3.0], [4.0, 5.0]]], TensorShape([3, 3]))
    """
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"`ids` must be a list. Received: ids={ids!r}")
    tensors = []
    for i, t in enumerate(ids):
        if isinstance(t, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError(
                f"`ids[{i}]` must be a dense tensor; use "
                "group_embedding_lookup_sparse for ragged or sparse ids"
            )
        t = tf.convert_to_tensor(t)
        int_ids(t, f"ids[{i}]")
        tensors.append(t)
    flat = [tf.reshape(t, [-1, 1]) for t in tensors]
    n = len(tensors)
    outs = _group(params, flat, ["sum"] * n, None, [False] * n, [None] * n,
                  [None] * n, [False] * n, None, training, name, what_ids="ids")
    result = []
    for t, o in zip(tensors, outs):
        dim = o.shape[-1]
        shape = tf.concat([tf.shape(t), [dim]], 0)
        result.append(tf.ensure_shape(tf.reshape(o, shape), t.shape.concatenate([dim])))
    return result


def embedding_lookup(params, ids, *, training=False):
    """Gathers the rows of `ids` (any shape) from one parameter (fused op).

    Args:
        params: an embedding parameter, as in `group_embedding_lookup`.
        ids: integer tensor of any shape.
        training: bool. Insert unseen ids into a table. Defaults to `False`.

    Returns:
        float32 tensor `ids.shape + (dim,)`.

    Example:

    >>> matrix = keras.Variable(np.eye(3, dtype="float32"))
    >>> keras_rec_emb.ops.embedding_lookup(matrix, [2, 0]).numpy()
    array([[0., 0., 1.],
           [1., 0., 0.]], dtype=float32)
    """
    return group_embedding_lookup([params], [ids], training=training)[0]


def embedding_lookup_sparse(params, sp_ids, sp_weights=None, combiner="mean",
                            default_id=None, prune_invalid_ids=True, max_norm=None,
                            *, training=False, name=None):
    """Fused single-feature sparse lookup (DeepRec's Embedding Subgraph Fusion).

    In one kernel: drop ids < 0 (`prune_invalid_ids`) and, with weights and
    a `"mean"` or `"sqrtn"` combiner, ids whose weight is <= 0 (TF's
    `safe_embedding_lookup_sparse` contract, which DeepRec's fused lookup
    keeps); fill rows left empty with `default_id` (or zeros), clip rows to
    `max_norm`, weight and combine. Ids of rank > 2 (`[d0, ..., dn]`) give
    `[d0, ..., dn-1, dim]`.

    Args:
        params: an embedding parameter, as in `group_embedding_lookup_sparse`.
        sp_ids: `tf.RaggedTensor` / `tf.SparseTensor` `[batch, None]` (or
            dense `[batch, L]`, or sparse/dense of rank > 2) integer ids.
        sp_weights: `None` or per-id weights of the same structure.
        combiner: `"sum"`, `"mean"` or `"sqrtn"`. Defaults to `"mean"`.
        default_id: `None` or int. Id read (weight 1) by rows with no valid
            id. Defaults to `None` (zeros).
        prune_invalid_ids: bool. Defaults to `True`.
        max_norm: `None` or float. Defaults to `None`.
        training: bool. Insert unseen ids into a table. Defaults to `False`.
        name: str or `None`.

    Returns:
        float32 tensor `[batch, dim]` (`ids.shape[:-1] + (dim,)` for ids of
        rank > 2).

    Example:

    >>> matrix = keras.Variable(np.eye(4, dtype="float32"))
    >>> ids = tf.ragged.constant([[0, 1], [-1], []], dtype=tf.int64)
    >>> keras_rec_emb.ops.embedding_lookup_sparse(
    ...     matrix, ids, combiner="sum", default_id=3).numpy()
    array([[1., 1., 0., 0.],
           [0., 0., 0., 1.],
           [0., 0., 0., 1.]], dtype=float32)
    """
    return group_embedding_lookup_sparse(
        [params], [sp_ids], [combiner],
        None if sp_weights is None else [sp_weights], name=name,
        max_norm=max_norm, default_id=default_id,
        prune_invalid_ids=prune_invalid_ids, training=training)[0]
