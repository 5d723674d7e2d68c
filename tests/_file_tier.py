"""The file tier's test model and checks, for tests/test_file_tier.py (both
backends) and tests/jax_backend/test_jax_file_tier.py. No TensorFlow at
module level: the JAX worker imports this. test_file_tier.py's TensorFlow
child is written from these functions' source (`inspect.getsource`): they
name only DIM, VOCAB, keras, np, kre and EmbeddingVariable."""

import keras
import numpy as np

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

DIM = 4
VOCAB = 3000


def ev_option(storage=None, filter_option=None, evict_option=None):
    return kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(
            initializer=keras.initializers.RandomUniform(seed=3), default_value_dim=97),
        filter_option=filter_option, evict_option=evict_option,
        storage_option=storage, num_shards=4)


def file_option(path, cache=4096):
    # 4 KiB over 4 shards: each shard caches 1 KiB of rows (32 rows of value
    # and Adagrad accumulator), far fewer than the table holds, so rows go
    # to and come back from files.
    return kre.StorageOption("FILE", storage_path=str(path), storage_size=cache)


def build_model(option, name="ev"):
    # Seeded by its initializers alone: the same model in every process, and
    # keras.utils.set_random_seed would import TensorFlow under JAX.
    ids = keras.Input((3,), dtype="int64", name="ids")
    emb = EmbeddingVariable(DIM, ev_option=option, combiner="sum", name=name)(ids)
    out = keras.layers.Dense(1, name="dense", kernel_initializer="ones")(emb)
    model = keras.Model(ids, out)
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    return model


def data(seed=0, n=512):
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.2, size=(n, 3)) % VOCAB).astype(np.int64)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    return ids, y


def same_export(a, b):
    """Every part of two exports equal, row by row (keys in any order)."""
    assert sorted(a) == sorted(b)
    a, b = ({k: v if k == "slots" else np.asarray(v) for k, v in e.items()} for e in (a, b))
    order_a, order_b = np.argsort(a["keys"]), np.argsort(b["keys"])
    for key in ("keys", "values", "freqs", "versions"):
        np.testing.assert_array_equal(a[key][order_a], b[key][order_b], err_msg=key)
    assert sorted(a["slots"]) == sorted(b["slots"])
    for name in a["slots"]:
        np.testing.assert_array_equal(np.asarray(a["slots"][name])[order_a],
                                      np.asarray(b["slots"][name])[order_b], err_msg=name)
    fa, fb = np.argsort(a["keys_filtered"]), np.argsort(b["keys_filtered"])
    for key in ("keys_filtered", "freqs_filtered", "versions_filtered"):
        np.testing.assert_array_equal(a[key][fa], b[key][fb], err_msg=key)


def spills(stats):
    """More rows than the cache holds: most live only in files."""
    assert stats["storage"] == "FILE"
    assert 0 < stats["cached_rows"] < stats["rows"] == stats["size"]
    assert stats["disk_bytes"] > 0 and stats["file_writes"] > 0 and stats["file_reads"] > 0
    assert 0.0 < stats["cache_hit_rate"] < 1.0


def table_error():
    """What a file-tier table's native failure raises (a corrupt snapshot, a
    storage path it cannot create): the op's InvalidArgumentError under
    TensorFlow, ValueError under JAX."""
    if keras.config.backend() == "jax":
        return ValueError
    import tensorflow as tf

    return tf.errors.InvalidArgumentError
