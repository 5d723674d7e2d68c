"""Ids that are not integers (floats, NaN, bool) or that do not fit the
table's keys (uint64 ids >= 2**63, int64 ids beyond an int32 table, uint32
ids beyond int32) are refused under JAX with TensorFlow's exception and
message: the cases run here and in a TensorFlow child process, and the
errors are compared."""

import re

import jax
import keras
import numpy as np
import pytest

from tests import _tensorflow_outcomes

# Run under either backend: CASES maps a name to a function that calls a
# layer on bad ids; outcome() gives (exception type, message) or "ok".
_CASES = r'''
import numpy as np
import keras_rec_emb as kre
L = kre.layers

def _ev(key_dtype, **kwargs):
    return L.EmbeddingVariable(2, key_dtype=key_dtype, name="ev", **kwargs)

def _group(key_dtype, stacked):
    table = L.EmbeddingVariable(2, key_dtype=key_dtype, name="t")
    other = L.EmbeddingVariable(2, key_dtype=key_dtype, name="u")
    group = L.GroupEmbedding({"a": L.FeatureSpec(other), "b": L.FeatureSpec(table)}, name="g",
                             output_mode="concat")
    if stacked:
        return lambda ids: group(np.stack([np.zeros_like(ids), ids], 1))
    return lambda ids: group({"a": np.zeros(ids.shape, np.int32), "b": ids})

IDS = {
    "float": np.array([1.5, 2.0], np.float32),
    "nan": np.array([np.nan, 1.0]),
    "bool": np.array([True, False]),
    "uint64_beyond_int64": np.array([2**63, 1], np.uint64),
    "int64_beyond_int32": np.array([2**40, 1], np.int64),
    "int64_below_int32": np.array([-2**40, 1], np.int64),
    "uint32_beyond_int32": np.array([2**32 - 1, 1], np.uint32),
}
LAYERS = {
    "ev_int32": lambda: _ev("int32"),
    "ev_int64": lambda: _ev("int64"),
    "ev_mean_int32": lambda: _ev("int32", combiner="mean"),
    "group_dict_int32": lambda: _group("int32", False),
    "group_dict_int64": lambda: _group("int64", False),
    "group_stacked_int32": lambda: _group("int32", True),
    "group_stacked_int64": lambda: _group("int64", True),
    "multi_hash": lambda: L.MultiHashEmbedding(10, 2, name="mh"),
    "adaptive": lambda: L.AdaptiveEmbedding(2, hash_bucket_size=10, name="ad"),
}

def _core(message):
    # Keras wraps an error of `call` with the backend's view of the
    # arguments; the error's own message is the bold part.
    found = re.search("\x1b\\[1m(.*?)\x1b\\[0m", message, re.S)
    return found.group(1) if found else message

def outcomes():
    out = {}
    for layer_name, make in LAYERS.items():
        for ids_name, ids in IDS.items():
            ids = ids.reshape(2, 1) if layer_name == "ev_mean_int32" else ids
            try:
                make()(ids)
                out[f"{layer_name}/{ids_name}"] = "ok"
            except (TypeError, ValueError) as e:
                out[f"{layer_name}/{ids_name}"] = [type(e).__name__, _core(str(e))]
    return out
'''

# Cases either backend accepts (the ids fit the keys).
_FIT = {"ev_int64/int64_beyond_int32", "ev_int64/int64_below_int32", "ev_int64/uint32_beyond_int32",
        "group_dict_int64/int64_beyond_int32", "group_dict_int64/int64_below_int32",
        "group_dict_int64/uint32_beyond_int32", "group_stacked_int64/int64_beyond_int32",
        "group_stacked_int64/int64_below_int32", "group_stacked_int64/uint32_beyond_int32",
        "group_dict_int32/int64_below_int32", "group_stacked_int32/int64_below_int32",
        "multi_hash/int64_beyond_int32", "multi_hash/int64_below_int32",
        "multi_hash/uint32_beyond_int32", "adaptive/int64_beyond_int32",
        "adaptive/int64_below_int32", "adaptive/uint32_beyond_int32"}


@pytest.fixture(scope="module")
def tensorflow_outcomes(tmp_path_factory):
    return _tensorflow_outcomes.in_tensorflow(_CASES, tmp_path_factory.mktemp("tf"))


def test_bad_ids_get_tensorflows_exception_and_message(tensorflow_outcomes):
    assert jax.config.jax_enable_x64  # the package's default: int64 ids stay int64
    got = _tensorflow_outcomes.here(_CASES)
    _tensorflow_outcomes.assert_same(got, tensorflow_outcomes)
    for case, outcome in got.items():
        # Padding (ids < 0) is what a group prunes: below int32 is no error there.
        assert (outcome == "ok") == (case in _FIT), (case, outcome)
    assert got["ev_int32/nan"] == [
        "TypeError", "EmbeddingVariable 'ev' expects integer ids (int32 or int64). Received "
        "ids of dtype float32. Hash strings or floats to integers first, e.g. with "
        "keras.layers.Hashing or tf.strings.to_hash_bucket_fast. (Exporting a subclassed "
        "model? Keras records only its input shapes: pass `input_signature` with integer "
        "tf.TensorSpecs for the ids.)"]
    assert got["ev_int64/uint64_beyond_int64"][1].startswith(
        "EmbeddingVariable 'ev' holds ids outside the int64 key range "
        "[-9223372036854775808, 9223372036854775807], e.g. [9223372036854775808]")


def test_int64_ids_of_numpy_in_32_bit_mode_are_checked_before_keras_narrows_them():
    from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

    from keras_rec_emb.optimizers import SGD

    with jax.enable_x64(False):
        layer = EmbeddingVariable(2, key_dtype="int32", name="ev", optimizer=SGD(0.1))
        layer.build()
        with pytest.raises(ValueError, match=re.escape(
                "EmbeddingVariable 'ev' holds ids outside the int32 key range "
                "[-2147483648, 2147483647], e.g. [4294967297]")):
            layer(np.array([2**32 + 1, 3], np.int64), training=True)
        assert layer.table_size() == 0  # nothing was inserted (2**32 + 1 narrows to 1)
        layer(np.array([3, 1], np.int64), training=True)
        assert sorted(layer.export()["keys"].tolist()) == [1, 3]


@pytest.mark.parametrize("bad, message", [
    (2**40, "holds ids outside the int32 key range"),
    (-2**40, "holds ids outside the int32 key range"),
])
def test_traced_int64_ids_beyond_an_int32_table_fail_the_step_before_the_lookup(bad, message):
    from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
    from keras_rec_emb.optimizers import SGD

    layer = EmbeddingVariable(2, key_dtype="int32", name="ev", optimizer=SGD(0.1))
    inputs = keras.Input(shape=(2,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=SGD(0.1), loss="mse")
    ids = np.array([[1, 2], [3, 4]], np.int64)
    model.fit(ids, np.ones((2, 1)), verbose=0)
    assert layer.table_size() == 4
    ids[1, 1] = bad + 5  # narrowed to int32 it would be id 5
    with pytest.raises(Exception, match=message) as caught:
        model.fit(ids, np.ones((2, 1)), verbose=0)
    assert "JaxRuntimeError" in type(caught.value).__name__ or isinstance(
        caught.value, ValueError)
    assert sorted(layer.export()["keys"].tolist()) == [1, 2, 3, 4]  # 5 never inserted


@pytest.mark.parametrize("layer_name, message", [
    ("group_dict_int32", "`sp_ids[1]` holds ids outside the int32 key range"),
    ("group_stacked_int32", "GroupEmbedding 'g' ids holds ids outside the int32 key range"),
    ("multi_hash", "MultiHashEmbedding 'mh' holds ids outside the int32 key range"),
    ("adaptive", "AdaptiveEmbedding 'ad' holds ids outside the int32 key range"),
])
def test_the_other_id_layers_check_numpy_int64_ids_in_32_bit_mode(layer_name, message):
    namespace = {"re": re}
    exec(_CASES, namespace)  # pylint: disable=exec-used
    with jax.enable_x64(False):
        call = namespace["LAYERS"][layer_name]()
        with pytest.raises(ValueError, match=re.escape(message) + r".*e\.g\. \[4294967297\]"):
            call(np.array([2**32 + 1, 1], np.int64))
        call(np.array([3, 1], np.int64))  # ids that fit pass
