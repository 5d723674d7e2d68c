"""Bad arguments of EmbeddingVariable and TableConfig (a table optimizer by
name, Keras's namesakes, other optimizers, model-only settings, dims, key
dtypes, combiners, options) are refused under JAX with TensorFlow's
exception and message, and the same identifiers are accepted: the cases
run here and in a TensorFlow child process, and the outcomes are compared."""

import re

import pytest

from tests import _tensorflow_outcomes

# Run under either backend: outcomes() maps a case to ["ok", what was
# built] or [exception type, message] (object addresses removed).
_CASES = r'''
import re
import keras
import keras_rec_emb as kre
L = kre.layers

def _unnamed(config):
    # An optimizer's default name counts the optimizers the process made.
    return dict(config, config={k: v for k, v in config["config"].items() if k != "name"})

def _ev(**kwargs):
    layer = L.EmbeddingVariable(2, name="ev", **kwargs)
    opt = layer.optimizer
    return [type(opt).__module__ + "." + type(opt).__name__, opt.get_config()["learning_rate"],
            _unnamed(layer.get_config()["optimizer"])] if opt is not None else None

def _table(**kwargs):
    table = L.TableConfig("t", 2, **kwargs)
    L.GroupEmbedding({"f": L.FeatureConfig("f", table)})
    opt = table.get_config()["optimizer"]
    return _unnamed(opt) if isinstance(opt, dict) else opt

CASES = {
    "name": lambda: _ev(optimizer="adagrad"),
    "name_mixed_case": lambda: _ev(optimizer="AdamAsync"),
    "name_unknown": lambda: _ev(optimizer="rmsprop"),
    "keras_namesake": lambda: _ev(optimizer=keras.optimizers.Adagrad(0.25)),
    "keras_other": lambda: _ev(optimizer=keras.optimizers.RMSprop(0.1)),
    "keras_adamw": lambda: _ev(optimizer=keras.optimizers.AdamW(0.1)),
    "ours": lambda: _ev(optimizer=kre.optimizers.Ftrl(0.5)),
    "config": lambda: _ev(optimizer=keras.saving.serialize_keras_object(kre.optimizers.Adam(0.3))),
    "config_other": lambda: _ev(optimizer={"class_name": "RMSprop", "config": {}}),
    "not_an_optimizer": lambda: _ev(optimizer=3),
    "loss_scale": lambda: _ev(optimizer=kre.optimizers.LossScaleOptimizer(kre.optimizers.SGD(0.1))),
    "clipnorm": lambda: _ev(optimizer=kre.optimizers.SGD(0.1, clipnorm=1.0)),
    "keras_clipvalue": lambda: _ev(optimizer=keras.optimizers.SGD(0.1, clipvalue=1.0)),
    "ema": lambda: _ev(optimizer=kre.optimizers.Adam(0.1, use_ema=True)),
    "accumulation": lambda: _ev(optimizer=kre.optimizers.SGD(0.1, gradient_accumulation_steps=2)),
    "dim_zero": lambda: L.EmbeddingVariable(0),
    "key_dtype": lambda: L.EmbeddingVariable(2, key_dtype="float32"),
    "combiner": lambda: L.EmbeddingVariable(2, combiner="max"),
    "restore_mode": lambda: L.EmbeddingVariable(2, restore_dim_mismatch="pad"),
    "ev_option_type": lambda: L.EmbeddingVariable(2, ev_option=3),
    "default_value_dim_conflict": lambda: L.EmbeddingVariable(
        2, default_value_dim=5, ev_option=kre.EmbeddingVariableOption(
            init_option=kre.InitializerOption(default_value_dim=4))),
    "default_value_dim_zero": lambda: L.EmbeddingVariable(2, default_value_dim=0),
    "table_config_name": lambda: _table(optimizer="adagrad"),
    "table_config_keras_namesake": lambda: _table(optimizer=keras.optimizers.SGD(0.5)),
    "table_config_name_unknown": lambda: _table(optimizer="rmsprop"),
}

def outcomes():
    out = {}
    for name, make in CASES.items():
        try:
            out[name] = ["ok", make()]
        except (TypeError, ValueError) as e:
            out[name] = [type(e).__name__, re.sub(r" at 0x[0-9a-fA-F]+", "", str(e))]
    return json.loads(json.dumps(out, default=repr))
'''

@pytest.fixture(scope="module")
def tensorflow_outcomes(tmp_path_factory):
    return _tensorflow_outcomes.in_tensorflow(_CASES, tmp_path_factory.mktemp("tf"))


def test_bad_arguments_get_tensorflows_exception_and_message(tensorflow_outcomes):
    got = _tensorflow_outcomes.here(_CASES)
    _tensorflow_outcomes.assert_same(got, tensorflow_outcomes)
    accepted = {case for case, outcome in got.items() if outcome[0] == "ok"}
    assert accepted == {"name", "name_mixed_case", "keras_namesake", "ours", "config",
                        "table_config_name", "table_config_keras_namesake"}
    module = "keras_rec_emb.optimizers.keras_optimizers"
    assert got["name"][1][0] == f"{module}.Adagrad"
    assert got["name"][1][1] == pytest.approx(0.001)  # Keras's default rate
    assert got["name_mixed_case"][1][0] == "keras_rec_emb.optimizers.deeprec_optimizers.AdamAsync"
    assert got["keras_namesake"][1][:2] == [f"{module}.Adagrad", 0.25]  # its config kept
    assert got["keras_namesake"][1][2]["registered_name"] == "keras_rec_emb>Adagrad"
    assert got["name_unknown"][0] == "ValueError" and "rmsprop" in got["name_unknown"][1]
    assert got["keras_other"] == ["TypeError", re.sub(
        " at 0x[0-9a-f]+", "", got["keras_other"][1])]
    assert got["keras_other"][1].startswith("`optimizer` of a table must be None")
    assert got["clipnorm"] == ["ValueError", (
        "A table's optimizer cannot set ['clipnorm'] (the model's optimizer clips, "
        "accumulates, averages and unscales every gradient, tables' included): set them on "
        "the model's optimizer. Received: optimizer=" + got["clipnorm"][1].split("optimizer=")[-1])]
