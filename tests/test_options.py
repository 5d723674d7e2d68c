"""Option classes: validation, config round trips, serialization."""

import math
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre

OPTIONS = [
    kre.InitializerOption(),
    kre.InitializerOption(keras.initializers.RandomUniform(-1, 1, seed=3), 64, 0.5),
    kre.CounterFilter(5),
    kre.CBFFilter(2, 10**6, 0.001, "uint16"),
    kre.GlobalStepEvict(100),
    kre.L2WeightEvict(0.25),
    kre.StorageOption("FILE", "/tmp/x", 1 << 20),
    kre.EmbeddingVariableOption(kre.InitializerOption(default_value_dim=8),
                                kre.CounterFilter(1), kre.GlobalStepEvict(3),
                                kre.StorageOption(), num_shards=4),
]


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: type(o).__name__)
def test_round_trip(option):
    with kre.storage_root("/tmp"):  # where the file-tier option may work once loaded
        assert type(option).from_config(option.get_config()) == option
        restored = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(option))
    assert restored == option and type(restored) is type(option)


@pytest.mark.parametrize("make, error, match", [
    (lambda: kre.InitializerOption(default_value_dim=0), ValueError, "default_value_dim=0"),
    (lambda: kre.InitializerOption(default_value_no_permission="x"), TypeError, "default_value_no_permission='x'"),
    (lambda: kre.CounterFilter(-1), ValueError, "filter_freq=-1"),
    (lambda: kre.CBFFilter(1, 100, 1.5), ValueError, r"false_positive_probability.*\(0, 1\).*1.5"),
    (lambda: kre.CBFFilter(1, 100, 0.0), ValueError, "false_positive_probability=0.0"),
    (lambda: kre.CBFFilter(1, 100, 0.1, "float32"), ValueError, "counter_type='float32'"),
    (lambda: kre.CBFFilter(1, 100, 0.1, "int128"), ValueError, r"int8.*counter_type='int128'"),
    (lambda: kre.CBFFilter(300, 100, 0.1, "int8"), ValueError, "filter_freq=300"),
    (lambda: kre.CBFFilter(1, 0, 0.1), ValueError, "max_element_size=0"),
    (lambda: kre.GlobalStepEvict(-5), ValueError, "steps_to_live=-5"),
    (lambda: kre.L2WeightEvict(-0.1), ValueError, "l2_weight_threshold=-0.1"),
    (lambda: kre.StorageOption("SSD"), ValueError, "storage_type='SSD'"),
    (lambda: kre.EmbeddingVariableOption(num_shards=65537), ValueError, "num_shards=65537"),
    (lambda: kre.EmbeddingVariableOption(filter_option=kre.GlobalStepEvict(1)), TypeError, "filter_option"),
    (lambda: kre.EmbeddingVariableOption(init_option=4), TypeError, "init_option=4"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _spellings():
    return [("uint64", 8), ("int64", 8), ("uint8", 1), ("int16", 2), ("uint32", 4),
            (tf.uint64, 8), (tf.int64, 8), (tf.uint8, 1), (tf.uint16, 2), (tf.int32, 4),
            (np.uint64, 8), (np.int64, 8), (np.dtype("uint16"), 2), (np.dtype(np.int8), 1)]


@pytest.mark.parametrize("index", range(14))
def test_cbf_counter_type_takes_deeprec_spellings(index):
    """DeepRec's CBFFilter takes a tf.DType (tf.uint64 by default, tf.int64 in
    its modelzoo scripts): TensorFlow and NumPy dtypes and strings all give
    counters of their width, and the config holds the name."""
    spelling, width = _spellings()[index]
    f = kre.CBFFilter(3, max_element_size=1000, false_positive_probability=0.01,
                      counter_type=spelling)
    name = spelling if isinstance(spelling, str) else getattr(spelling, "name", None)
    name = name if isinstance(name, str) else np.dtype(spelling).name
    assert f.counter_type == name and f.get_config()["counter_type"] == name
    assert f.sizing()[2] == width
    assert kre.CBFFilter.from_config(f.get_config()) == f


@pytest.mark.parametrize("bad", [tf.float32, np.float64, "float32", None, 5, object(), tf.string,
                                 np.bool_], ids=lambda v: repr(v)[:20])
def test_cbf_counter_type_refuses_other_types_naming_them(bad):
    with pytest.raises(ValueError, match=r"`counter_type` must be an integer dtype.*counter_type="):
        kre.CBFFilter(3, 1000, 0.01, counter_type=bad)


def _physical_bytes():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_cbf_larger_than_the_machine_warns_with_its_bytes():
    """DeepRec's modelzoo setting (2**30 keys at p=0.01 in uint64 counters) is
    76.7 GiB of counters: more than most machines hold, which a warning says
    with the bytes of both (a larger setting where the machine holds more)."""
    n = 2**30
    while math.ceil(-n * math.log(0.01) / math.log(2) ** 2) * 8 <= _physical_bytes():
        n *= 4
    with pytest.warns(UserWarning) as record:
        f = kre.CBFFilter(3, max_element_size=n, false_positive_probability=0.01,
                          counter_type="uint64")
    m, k, b = f.sizing()
    message = str(record[0].message)
    assert f"{m * b} bytes" in message and f"({_physical_bytes()} bytes" in message, message
    assert "physical memory" in message and "max_element_size" in message
    if n == 2**30:
        assert m * b == 82_335_024_528 and "76.7 GiB" in message, message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kre.CBFFilter(3, max_element_size=2**20, false_positive_probability=0.01)
