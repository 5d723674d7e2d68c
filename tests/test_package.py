"""Package-level behaviour: backend check, public API, CLI."""

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
                 "GlobalStepEvict", "L2WeightEvict", "StorageOption", "save_model",
                 "export_for_serving"):
        assert hasattr(kre, name), name
    assert set(kre.layers.__all__) == {"EmbeddingVariable", "GroupEmbedding", "FeatureSpec",
                                       "MultiHashEmbedding", "AdaptiveEmbedding"}
    assert callable(kre.callbacks.EvictionCallback)
    assert set(kre.optimizers.__all__) == {"SGD", "Adagrad", "Adam", "Ftrl", "AdamAsync",
                                           "AdagradDecay", "AdamW"}


def test_cli_demo_small_and_inspect(tmp_path):
    out = tmp_path / "demo"
    result = run(["-m", "keras_rec_emb.cli", "demo", "--rows", "3000", "--epochs", "1",
                  "--output", str(out)])
    assert result.returncode == 0, result.stderr
    assert "predictions identical after reload: yes" in result.stdout
    assert (out / "model.keras").exists() and (out / "serving" / "saved_model.pb").exists()
    inspect = run(["-m", "keras_rec_emb.cli", "inspect", str(out / "model.keras"), "--rows", "2"])
    assert inspect.returncode == 0, inspect.stderr
    assert "C1" in inspect.stdout and "keys" in inspect.stdout
    bad = run(["-m", "keras_rec_emb.cli", "inspect", str(tmp_path / "nope.keras")])
    assert bad.returncode == 2 and "nope.keras" in bad.stderr
    bad_rows = run(["-m", "keras_rec_emb.cli", "demo", "--rows", "0"])
    assert bad_rows.returncode == 2 and "--rows" in bad_rows.stderr
