"""Synchronous tables sharded over MultiWorkerMirroredStrategy workers.

An `EmbeddingVariable` built in the strategy's scope gets a
`CollectiveShardedTable`: shard `i` lives in worker `i` only. A lookup sends
each distinct id to its owner (one all-gather, two all-to-alls; the
gradient is the all-to-all back). Table-wide operations are collective:
every worker calls them, in the same order. See docs/distributed.md, 'Semantics'.
"""

import tensorflow as tf

from keras_rec_emb import tables as _tables
from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context
from keras_rec_emb.distribute import ps_tables, shards

# One traced all-gather per (strategy, dtype, row shape): every worker
# traces the same functions in the same order (their collectives then get
# the same instance keys) and reuses them.
_GATHERS = {}


def _all_gather(strategy, tensor):
    """`tensor` of every worker, concatenated along axis 0 in replica order
    (rows may differ in number); eager or traced."""
    tensor = tf.convert_to_tensor(tensor)
    inner = tuple(tensor.shape[1:])
    key = (id(strategy), tensor.dtype, inner)
    cached = _GATHERS.get(key)
    fn = cached[1] if cached is not None and cached[0] is strategy else None
    if fn is None:
        spec = tf.TensorSpec((None,) + inner, tensor.dtype)

        @tf.function(input_signature=[spec])
        def fn(x):
            def gather():
                # (a tensor made in the replica function, on its device)
                return tf.distribute.get_replica_context().all_gather(tf.identity(x), axis=0)

            return strategy.experimental_local_results(strategy.run(gather))[0]

        _GATHERS[key] = (strategy, fn)  # (holding the strategy: its id stays its own)
    return fn(tensor)


def worker_index(strategy):
    """This process's place among the strategy's workers (chief first,
    then the workers in task order), as the strategy numbers replicas."""
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, resolver.task_id
    if not task_type:
        return 0
    spec = resolver.cluster_spec()
    order = [(job, i) for job in ("chief", "worker") if job in spec.jobs
             for i in range(spec.num_tasks(job))]
    return order.index((task_type, int(task_id)))


def _exchange_rows(strategy, rows):
    """All-to-all of `rows` `[workers, width, dim]` whose gradient is the
    all-to-all back (row r came from rank r, its gradient returns there)."""

    @tf.custom_gradient
    def exchange(x):
        def grad(dy):
            return _compat.strategy_all_to_all(strategy, dy)

        return _compat.strategy_all_to_all(strategy, x), grad

    return exchange(rows)


def _distinct_rows(answered, back, source):
    """`answered[back]`: the row of each distinct id, from where its owner's
    answer put it. Each place of `answered` holds the row of distinct id
    `source[place]` (or none: `len(back)`), so the gradient is one gather
    of the rows' gradient, where that of `tf.gather` would add the rows up
    by place (`UnsortedSegmentSum`, one row at a time)."""

    @tf.custom_gradient
    def rows(x):
        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            return tf.gather(tf.concat([dy, _zero_row(dy)], 0), source)

        return tf.gather(x, back), grad

    return rows(answered)


def _zero_row(x):
    return tf.zeros(tf.stack([1, tf.shape(x)[1]]), x.dtype)


def _placed_rows(rows, at, valid):
    """`rows` put at the places `at` of a zero matrix with one row per entry
    of `valid` (`at`: the places where `valid` is true, in order). A gather
    from the rows and a zero row (`tf.scatter_nd` writes row by row); its
    gradient is the gradient's rows at `at`."""

    @tf.custom_gradient
    def placed(x):
        def grad(dy):
            return tf.gather(tf.convert_to_tensor(dy), at)

        count = tf.shape(x, out_type=tf.int64)[0]
        index = tf.where(valid, tf.cumsum(tf.cast(valid, tf.int64), exclusive=True), count)
        return tf.gather(tf.concat([x, _zero_row(x)], 0), index), grad

    return placed(rows)


class CollectiveShardedTable(ps_tables.ShardedEmbeddingTable):
    """One embedding table split by key hash over MultiWorkerMirroredStrategy
    workers; lookups exchange ids and rows with collectives.

    `EmbeddingVariable` builds one inside a MultiWorkerMirroredStrategy's
    scope; this process holds shard `index` of `num_shards` (`shards` lists
    only it). Lookups and table-wide operations run as the module docstring
    says; `local_stats()` is this process's shard alone.

    Args:
        strategy: the `tf.distribute.MultiWorkerMirroredStrategy`, one
            replica per worker.
        dim, key_dtype, default_values, name, **kwargs: As
            `ShardedEmbeddingTable`.

    Example (one worker, so the only shard holds every key):

    >>> from keras_rec_emb.distribute import CollectiveShardedTable
    >>> issubclass(CollectiveShardedTable, keras_rec_emb.distribute.ShardedEmbeddingTable)
    True
    >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     layer = keras_rec_emb.layers.EmbeddingVariable(4, name="mwms_doc")
    ...     layer.build()
    >>> type(layer.table).__name__, layer.table.num_shards  # doctest: +SKIP
    ('CollectiveShardedTable', 1)

    (Skipped in the doctests: creating a MultiWorkerMirroredStrategy
    configures the process's collectives once for good;
    tests/distribute/test_multi_worker.py runs 2 and 3 workers.)
    """

    def __init__(self, strategy, dim, key_dtype, default_values, name="embedding_table",
                 **kwargs):
        _compat.Trackable.__init__(self)
        local = list(strategy.extended.worker_devices)
        if len(local) != 1:
            raise ValueError(
                f"Embedding table '{name}': a MultiWorkerMirroredStrategy table is "
                "sharded over worker processes with one replica each; this worker has "
                f"{len(local)} local replicas {local}. Run one replica per worker.")
        self._strategy = strategy
        self._num = int(strategy.num_replicas_in_sync)
        self._index = worker_index(strategy)
        self._name = name
        self._devices = local
        shard_name = f"{name}/shard_{self._index}_of_{self._num}"
        self._shards = [shards.ExchangedShard(local[0], self._index, dim, key_dtype,
                                              default_values, name=shard_name, **kwargs)]

    num_shards = _tables.attribute("_num")
    index = _tables.attribute("_index", "The shard this process holds.")
    strategy = _tables.attribute("_strategy")

    def _held(self):
        return [(self._index, self._shards[0])]

    def __repr__(self):
        return (f"<CollectiveShardedTable '{self._name}' dim={self.dim} "
                f"shard {self._index} of {self._num}>")

    # -- lookups -------------------------------------------------------------
    def _replica_context(self):
        ctx = tf.distribute.get_replica_context()
        if (ctx is None or ctx.strategy is not self._strategy
                or ctx.num_replicas_in_sync != self._num):
            raise ValueError(
                f"Embedding table '{self._name}' is sharded over the "
                f"{self._num} workers of a MultiWorkerMirroredStrategy: look ids up "
                "inside its replica function, where every worker takes part: call "
                "model.fit / evaluate / predict on every worker, or strategy.run inside "
                "a tf.function. Read rows with table.export() (every worker calls it).")
        return ctx

    def _shape_only_lookup(self, keys):
        """Traced in the strategy's cross-replica context: Keras's symbolic
        build (`compute_output_spec`), which only reads shapes. Running it
        fails: outside the replica function the workers cannot exchange."""
        shard = self._shards[0]
        refuse = tf.debugging.Assert(tf.constant(False), [
            f"Embedding table '{self._name}' is sharded over {self._num} workers: look "
            "ids up inside the strategy's replica function (strategy.run), where every "
            "worker takes part."])
        with tf.control_dependencies([refuse]), tf.device(shard.device):
            return tf.identity(shard.lookup(keys, insert=False))

    @_serving_context.served
    def lookup(self, keys, insert=False):
        """Rows of `keys` (any shape) as `keys.shape + (dim,)`: this replica's
        distinct ids go to their owners, which answer with their rows."""
        return self.lookup_many([self], [keys], insert)[0]

    @property
    def fused_table(self):
        """With one worker, its shard, which holds every row: the fused
        kernels read it as they read a table of one process, with nothing
        to exchange (`tables.Table.fused_table`). None with several."""
        return self._shards[0] if self._num == 1 else None

    @property
    def exchange_group(self):
        """Tables with the same `exchange_group` can be looked up in one
        exchange (`lookup_many`): those of one strategy."""
        return ("collective", id(self._strategy))

    @staticmethod
    def lookup_many(tables, keys_list, insert=False, distinct=False):
        """`tables.Table.lookup_many` of tables of one strategy: all tables'
        ids and rows in one exchange, so the collectives of a step do not
        grow with the number of tables."""
        first = tables[0]
        keys_list = [tf.convert_to_tensor(k) for k in keys_list]
        if tf.distribute.get_replica_context() is None and not tf.executing_eagerly():
            looked = [t._shape_only_lookup(k) for t, k in zip(tables, keys_list)]
            if distinct:
                return [(tf.reshape(r, [-1, t.dim]), tf.range(tf.size(k)))
                        for t, r, k in zip(tables, looked, keys_list)]
            return looked
        first._replica_context()  # (refuses a lookup outside the replica function)
        n, index = first._num, first._index
        if n == 1:  # the only shard holds every key: nothing to exchange
            if not distinct:
                return [t._owner_rows(k, None, insert) for t, k in zip(tables, keys_list)]
            out = []
            for t, k in zip(tables, keys_list):
                unique, idx, occ = tf.unique_with_counts(tf.reshape(k, [-1]))
                out.append((t._owner_rows(unique, occ if insert else None, insert), idx))
            return out
        width_rows = max(t.dim for t in tables)
        uniques, idxs, occs, tags = [], [], [], []
        for j, keys in enumerate(keys_list):
            # Occurrences travel with each distinct id: the owner counts
            # them (frequencies, admission filters) as one process counts.
            unique, idx, occ = tf.unique_with_counts(tf.cast(tf.reshape(keys, [-1]), tf.int64))
            uniques.append(unique)
            idxs.append(idx)
            occs.append(tf.cast(occ, tf.int64))
            tags.append(tf.fill(tf.shape(unique), tf.constant(j, tf.int64)))
        sizes = [tf.size(u) for u in uniques]
        unique = tf.concat(uniques, 0)
        m = tf.size(unique, out_type=tf.int64)
        owner = ps_tables.shard_of(unique, n)
        # The distinct ids grouped by owner, each group in its own order (a
        # stable counting sort: owners are 0..n-1).
        order = tf.concat(tf.dynamic_partition(tf.range(m), owner, n), 0)
        owner_sorted = tf.gather(owner, order)
        counts = tf.math.bincount(owner, minlength=n, maxlength=n, dtype=tf.int64)
        starts = tf.cumsum(counts, exclusive=True)
        # One small all-gather: each rank's shard and its id count for every
        # shard. Then the ids, padded to the largest count, go to their
        # owners in one all-to-all; the rows come back in the same layout.
        meta = _compat.strategy_all_gather(
            first.strategy, tf.concat([[tf.constant(index, tf.int64)], counts], 0)[tf.newaxis])
        rank_shard = tf.cast(meta[:, 0], tf.int32)
        width = tf.maximum(tf.reduce_max(meta[:, 1:]), 1)
        slot = tf.range(width, dtype=tf.int64)
        send_valid = slot[tf.newaxis] < tf.gather(counts, rank_shard)[:, tf.newaxis]
        src = tf.where(send_valid, tf.gather(starts, rank_shard)[:, tf.newaxis] + slot, m)
        payload = tf.stack([unique, tf.concat(occs, 0), tf.concat(tags, 0)], axis=1)
        payload = tf.concat([tf.gather(payload, order), tf.zeros([1, 3], tf.int64)], 0)
        received = _compat.strategy_all_to_all(first.strategy, tf.gather(payload, src))
        recv_valid = tf.reshape(slot[tf.newaxis] < meta[:, 1 + index][:, tf.newaxis], [-1])
        at = tf.where(recv_valid)[:, 0]  # the places of `received` that hold an id
        asked = tf.gather(tf.reshape(received, [-1, 3]), at)
        # Each table looks up its part of the asked ids; the rows go back to
        # the asked ids' places (one partition and one stitch for all).
        tag = tf.cast(asked[:, 2], tf.int32)
        places = tf.dynamic_partition(tf.range(tf.shape(asked)[0]), tag, len(tables))
        ids = tf.dynamic_partition(asked[:, 0], tag, len(tables))
        occurrences = tf.dynamic_partition(asked[:, 1], tag, len(tables))
        got = []
        for table, ids_j, occ_j in zip(tables, ids, occurrences):
            rows_j = table._owner_rows(ids_j, occ_j, insert)
            if table.dim < width_rows:
                rows_j = tf.pad(rows_j, [[0, 0], [0, width_rows - table.dim]])
            got.append(rows_j)
        rows = tf.dynamic_stitch(places, got)
        reply = tf.reshape(_placed_rows(rows, at, recv_valid), [n, -1, width_rows])
        answered = tf.reshape(_exchange_rows(first.strategy, reply), [-1, width_rows])
        # Where each distinct id's row came back: (rank of its owner) x width
        # + its place in what that owner received from this replica.
        shard_rank = tf.cast(tf.math.invert_permutation(rank_shard), tf.int64)
        place = tf.range(m) - tf.gather(starts, owner_sorted)
        back_sorted = tf.gather(shard_rank, owner_sorted) * width + place
        back = tf.gather(back_sorted, tf.math.invert_permutation(order))
        outs = []
        # Each place of `answered` holds the row of the id sent from sorted
        # place `src` (m: none).
        source = tf.gather(tf.concat([order, [m]], 0), tf.reshape(src, [-1]))
        rows_of = tf.split(_distinct_rows(answered, back, source), sizes, 0)
        for table, keys, idx, rows_j in zip(tables, keys_list, idxs, rows_of):
            if distinct:
                outs.append((rows_j[:, :table.dim] if table.dim < width_rows else rows_j, idx))
                continue
            out = tf.gather(rows_j, idx)
            if table.dim < width_rows:
                out = out[:, :table.dim]
            out = tf.reshape(out, tf.concat([tf.shape(keys, out_type=tf.int32), [table.dim]], 0))
            out.set_shape(keys.shape.concatenate([table.dim]))
            outs.append(out)
        return outs

    def _owner_rows(self, ids, occurrences, insert):
        """This shard's rows of the ids asked for (any shape); a training
        lookup sees each id as often as it occurs in the asking replicas'
        batches (`occurrences`; None: each once)."""
        shard = self._shards[0]
        ids = tf.cast(ids, shard.key_dtype)
        with tf.device(shard.device):
            if not insert or occurrences is None:
                return shard.lookup(ids, insert=insert)
            return shard.lookup_counted(ids, occurrences, insert=True)

    # -- table-wide operations (collective: every worker calls them) -------
    def _gather(self, tensor):
        return _all_gather(self._strategy, tensor)

    def _gather_rows(self, x, counts):
        """Row part `x` of every worker (`counts`: their row counts), each with
        one extra zero row dropped here (TensorFlow 2.21's CPU all-gather
        crashes on empty tensors); a part with no columns is not sent."""
        inner = x.shape[1:]
        total = tf.reduce_sum(counts)
        if inner.num_elements() == 0:
            return tf.zeros(tf.concat([[total], tf.constant(inner.as_list(), tf.int64)], 0),
                            x.dtype)
        padded = tf.concat([x, tf.zeros([1] + inner.as_list(), x.dtype)], 0)
        gathered = self._gather(padded)
        dummies = tf.cumsum(counts + 1) - 1
        keep = tf.tensor_scatter_nd_update(
            tf.ones([total + tf.size(counts, out_type=tf.int64)], tf.bool),
            dummies[:, tf.newaxis], tf.zeros(tf.shape(dummies), tf.bool))
        return tf.boolean_mask(gathered, keep)

    def _gathered_parts(self, include_filtered, evict=False):
        """Every worker's shard's parts in one table's (collective)."""
        parts = self._shard_parts(self._shards[0], include_filtered, evict)
        local = tf.stack([tf.size(parts["keys"], out_type=tf.int64),
                          tf.size(parts["keys_filtered"], out_type=tf.int64)])
        counts = self._gather(local[tf.newaxis])
        return self._joined(parts, lambda k: self._gather_rows(parts[k], counts[:, 0]),
                            lambda k: self._gather_rows(parts[k], counts[:, 1]))

    def local_stats(self):
        """This process's shard's statistics (`EmbeddingTable.stats`)."""
        return self._shards[0].stats()

    def _over_shards(self, value):
        """`value(shard)` of every worker's shard, one row each (collective)."""
        return self._gather(tf.constant([value(self._shards[0])], tf.int64)).numpy()

    def size(self):
        """Admitted keys over every shard (collective)."""
        return int(self._over_shards(lambda s: [s.size()]).sum())
