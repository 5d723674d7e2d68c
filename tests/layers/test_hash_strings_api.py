"""HashStrings' config and registration, and its errors for bad input
(tests/_hash_strings_cases.BAD_INPUTS), the same under both backends. Its
keys, input forms and model forms: tests/layers/test_string_ids.py
(TensorFlow) and tests/jax_backend/test_hash_strings.py (JAX)."""

import keras
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import HashStrings
from tests import _hash_strings_cases as cases

pytestmark = pytest.mark.backends("tensorflow", "jax")


def test_one_class_config_and_registration():
    layer = HashStrings(missing="pad", name="h")
    assert HashStrings.__module__ == "keras_rec_emb.layers.string_ids"
    assert kre.layers.HashStrings is HashStrings and "HashStrings" in kre.layers.__all__
    assert keras.saving.get_registered_name(HashStrings) == "keras_rec_emb>HashStrings"
    config = layer.get_config()
    assert config["missing"] == "pad" and config["name"] == "h"
    assert HashStrings.from_config(config).missing == "pad"
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(again) is HashStrings and again.get_config() == config
    assert HashStrings.from_config(HashStrings().get_config()).missing == "drop"


@pytest.mark.parametrize("make, kind, message", [c[1:] for c in cases.BAD_INPUTS],
                         ids=[c[0] for c in cases.BAD_INPUTS])
def test_bad_input_gives_the_same_error_under_both_backends(make, kind, message):
    with pytest.raises(kind) as caught:
        make(HashStrings)
    assert message in str(caught.value)
