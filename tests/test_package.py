"""Package-level behaviour: backend check, public API."""

import os
import subprocess
import sys

import keras_rec_emb as kre


def run(args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env), timeout=300)


def test_non_tensorflow_backend_is_refused_with_the_fix():
    result = run(["-c", "import keras_rec_emb"], KERAS_BACKEND="numpy")
    assert result.returncode != 0
    assert "KERAS_BACKEND=tensorflow" in result.stderr
    assert "'numpy'" in result.stderr


def test_public_api():
    for name in ("EmbeddingVariableOption", "InitializerOption", "CounterFilter", "CBFFilter",
                 "GlobalStepEvict", "L2WeightEvict", "StorageOption", "save_model", "load_model",
                 "export_for_serving"):
        assert hasattr(kre, name), name
    assert set(kre.layers.__all__) == {"EmbeddingVariable", "GroupEmbedding", "FeatureSpec",
                                       "MultiHashEmbedding", "AdaptiveEmbedding",
                                       "FeatureConfig", "TableConfig", "HashStrings"}
    assert callable(kre.callbacks.EvictionCallback)
    assert set(kre.optimizers.__all__) == {"SGD", "Adagrad", "Adam", "Ftrl", "AdamAsync",
                                           "AdagradDecay", "AdamW", "LossScaleOptimizer"}
