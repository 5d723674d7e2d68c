"""Option classes: validation, config round trips, serialization."""

import keras
import pytest

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
    (lambda: kre.CBFFilter(1, 100, 0.1, "int8"), ValueError, "counter_type='int8'"),
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
