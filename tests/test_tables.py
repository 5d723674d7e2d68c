"""Every kind of embedding table implements the declared table protocol
(`keras_rec_emb.tables`), names and parameters as the protocol declares."""

import inspect

import numpy as np
import pytest
import tensorflow as tf

from keras_rec_emb import tables
from keras_rec_emb.distribute import CollectiveShardedTable, ShardedEmbeddingTable
from keras_rec_emb.distribute import shards
from keras_rec_emb.tables import StoredTable, Table, TableShard
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

KINDS = [EmbeddingTable, ShardedEmbeddingTable, CollectiveShardedTable]


# The declared protocols (keras_rec_emb.tables); only this test walks them.
PROTOCOLS = (StoredTable, Table, TableShard)


def members(protocol):
    """The names `protocol` declares (its own and inherited), sorted."""
    names = set()
    for cls in protocol.__mro__:
        if cls not in PROTOCOLS:
            continue
        names.update(n for n in vars(cls) if not n.startswith("_"))
        names.update(getattr(cls, "__annotations__", {}))
    return sorted(names)


def missing_members(cls, protocol=Table):
    """The members of `protocol` that `cls` does not define (itself or a non-protocol base)."""

    missing = []
    for name in members(protocol):
        owner = next((base for base in cls.__mro__ if name in vars(base)), None)
        if owner is None or owner in PROTOCOLS:
            missing.append(name)
    return missing


def _defaults():
    return np.ones((2, 3), np.float32)


def test_protocols_declare_what_callers_use():
    declared = set(members(Table))
    for name in ("lookup", "lookup_many", "export", "import_", "size", "stats", "evict",
                 "add_slot", "snapshot", "restore_snapshot", "variables", "local",
                 "exchange_group", "optimizer", "dim", "key_dtype", "name", "trainable"):
        assert name in declared
    shard = set(members(TableShard))
    assert declared < shard
    for name in ("handle", "variable", "mark_changes", "export_changes", "merge_rows"):
        assert name in shard


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_table_kind_defines_every_member(kind):
    assert missing_members(kind, Table) == []


def test_the_core_table_is_a_table_shard():
    assert missing_members(EmbeddingTable, TableShard) == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_methods_take_the_declared_parameters(kind):
    for name in members(Table):
        declared = inspect.getattr_static(Table, name, None)
        defined = inspect.getattr_static(kind, name)
        if isinstance(declared, property):
            assert isinstance(defined, property), (kind.__name__, name)
            if declared.fset is not None:
                assert defined.fset is not None, (kind.__name__, name)
        elif isinstance(declared, staticmethod) or inspect.isfunction(declared):
            want = list(inspect.signature(getattr(Table, name)).parameters)
            got = list(inspect.signature(getattr(kind, name)).parameters)
            assert got == want, (kind.__name__, name, got, want)


def test_a_class_missing_a_member_is_named_and_not_a_table():
    namespace = {name: inspect.getattr_static(EmbeddingTable, name)
                 for name in members(Table) if name != "snapshot"}
    partial = type("Partial", (), namespace)
    assert missing_members(partial, Table) == ["snapshot"]
    assert missing_members(type("Nothing", (), {}), Table) == members(Table)

    whole = type("Whole", (), dict(namespace, snapshot=lambda self: 0))
    assert missing_members(whole, Table) == []


def test_instances_satisfy_the_protocol_and_state_their_capabilities():
    local = EmbeddingTable(3, "int64", _defaults(), name="protocol_local")
    sharded = ShardedEmbeddingTable(["/cpu:0", "/cpu:0"], 3, "int64", _defaults(),
                                    name="protocol_sharded")
    assert isinstance(local, Table) and isinstance(local, TableShard)
    assert isinstance(sharded, Table)
    assert not isinstance(object(), Table)
    assert local.local and not sharded.local
    assert local.exchange_group is None and sharded.exchange_group is None
    assert local.optimizer is None and sharded.optimizer is None
    assert isinstance(CollectiveShardedTable.exchange_group, property)
    # lookup_many of tables that exchange nothing: each its own lookup.
    keys = [tf.constant([1, 5], tf.int64), tf.constant([[2]], tf.int64)]
    rows = type(local).lookup_many([local, sharded], keys, insert=True)
    assert [r.shape.as_list() for r in rows] == [[2, 3], [1, 1, 3]]
    np.testing.assert_array_equal(rows[0].numpy(), np.ones((2, 3)))
    assert local.size() == 2 and sharded.size() == 1
    assert tables.lookup_each([], []) == []
    # distinct: the rows of each table's distinct keys and each key's place.
    keys = [tf.constant([[7, 1], [7, 9]], tf.int64), tf.constant([2, 2, 4], tf.int64)]
    before = local.export()["freqs"].sum()
    (rows_a, place_a), (rows_b, place_b) = type(local).lookup_many(
        [local, sharded], keys, insert=True, distinct=True)
    np.testing.assert_array_equal(place_a.numpy(), [0, 1, 0, 2])
    np.testing.assert_array_equal(place_b.numpy(), [0, 0, 1])
    assert rows_a.shape == (3, 3) and rows_b.shape == (2, 3)
    np.testing.assert_array_equal(
        tf.gather(rows_a, place_a).numpy(),
        local.lookup(tf.reshape(keys[0], [-1])).numpy())
    assert local.export()["freqs"].sum() - before == 4  # every occurrence counted
    assert sharded.size() == 2


def test_placement_decides_the_kind_from_the_scope():
    from keras_rec_emb.distribute import parameter_servers, placement

    assert placement.table_kind() == "local"
    table = placement.make_table(3, "int64", _defaults(), "placement_local", num_shards=2)
    assert type(table) is EmbeddingTable and table.name == "placement_local"
    with parameter_servers(["/cpu:0", "/cpu:0"]):
        assert placement.table_kind() == "parameter_servers"
        sharded = placement.make_table(3, "int64", _defaults(), "placement_ps")
    assert type(sharded) is ShardedEmbeddingTable and sharded.num_shards == 2
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        assert placement.table_kind() == "replicas"
        replicas = placement.make_table(3, "int64", _defaults(), "placement_replicas")
    assert type(replicas) is ShardedEmbeddingTable
    assert [s.replica_shard for s in replicas.shards] == [0]


SHARDS = [EmbeddingTable, shards.ParameterServerShard, shards.ReplicaShard,
          shards.ExchangedShard]


@pytest.mark.parametrize("kind", SHARDS, ids=lambda k: k.__name__)
def test_every_shard_kind_is_a_table_shard(kind):
    assert missing_members(kind, TableShard) == []
    want = list(inspect.signature(TableShard.sparse_apply).parameters)
    assert list(inspect.signature(kind.sparse_apply).parameters) == want


def test_distribution_stays_out_of_the_core_table():
    params = inspect.signature(EmbeddingTable.__init__).parameters
    for name in ("shared_name", "device", "replica_shard", "exchanged"):
        assert name not in params
        assert not hasattr(EmbeddingTable, name) or name == "device"
    ps = ShardedEmbeddingTable(["/cpu:0", "/cpu:0"], 3, "int64", _defaults(),
                               name="protocol_ps_shards")
    assert [type(s) for s in ps.shards] == [shards.ParameterServerShard] * 2
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        mirrored = ShardedEmbeddingTable(["/cpu:0"], 3, "int64", _defaults(),
                                         name="protocol_replica_shards", replicas=True)
    shard = mirrored.shards[0]
    assert type(shard) is shards.ReplicaShard
    assert shard.replica_shard == 0


def test_the_core_table_applies_a_step_itself():
    from keras_rec_emb.optimizers import SGD

    table = EmbeddingTable(3, "int64", _defaults(), name="protocol_apply")
    with tf.GradientTape() as tape:
        rows = table.lookup(tf.constant([4, 4, 9], tf.int64), insert=True)
        loss = tf.reduce_sum(rows)
    grad = tape.gradient(loss, table.variable)
    SGD(0.5).apply([grad], [table.variable])
    got = table.export()
    by_key = dict(zip(got["keys"].tolist(), got["values"].tolist()))
    np.testing.assert_allclose(by_key[4], [0.0] * 3)  # 1 - 0.5 * 2
    np.testing.assert_allclose(by_key[9], [0.5] * 3)


@pytest.mark.parametrize("at_save", [True, False])
def test_a_sharded_table_reports_its_save_eviction_over_all_shards(caplog, at_save):
    # The parameter-server table evicts at save over every shard, and says so
    # per table as a local table does (one function for both).
    import logging
    import warnings

    caplog.set_level(logging.INFO, logger="keras_rec_emb")
    sharded = ShardedEmbeddingTable(["/cpu:0", "/cpu:0"], 3, "int64", _defaults(),
                                    name=f"sharded_evict_{at_save}", l2_weight_threshold=1e9,
                                    evict_at_save=at_save)
    sharded.lookup(tf.constant([1, 2, 3, 4, 5, 6], tf.int64), insert=True)
    assert sharded.size() == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evicted = sharded.evict_for_save()
    if at_save:
        assert int(evicted) == 6 and sharded.size() == 0
        assert any(f"Saving evicted 6 of the 6 rows of table 'sharded_evict_{at_save}'"
                   in str(w.message) for w in caught)
        assert any("evicted 6 of 6 rows, kept 0." in r.getMessage() for r in caplog.records)
    else:
        assert evicted == 0 and sharded.size() == 6 and not caught
