"""Package-level behaviour: backend check, public API."""

import inspect
import os
import subprocess
import sys
import textwrap
import warnings
from importlib import metadata

import pytest

import keras_rec_emb as kre


def run(args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env), timeout=300)


def test_non_tensorflow_backend_is_refused_with_the_fix():
    result = run(["-c", "import keras_rec_emb"], KERAS_BACKEND="numpy")
    assert result.returncode != 0
    assert "KERAS_BACKEND=tensorflow" in result.stderr
    assert "'numpy'" in result.stderr


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_backend_comes_from_keras_json_when_the_variable_is_unset(tmp_path, backend):
    # A user whose keras.json names the backend, with KERAS_BACKEND unset,
    # gets that backend's tables (Keras's own rule), not an error.
    (tmp_path / "keras.json").write_text('{"backend": "%s"}' % backend)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env.update(KERAS_HOME=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
    code = textwrap.dedent("""
        import keras_rec_emb as kre, keras, numpy as np
        layer = kre.layers.EmbeddingVariable(4, combiner="sum")
        rows = layer(np.array([[1, 2]], np.int64))
        print(keras.config.backend(), type(layer).__module__, type(layer.table).__module__,
              tuple(rows.shape))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got_backend, module, table_module, shape = result.stdout.split(maxsplit=3)
    assert got_backend == backend
    assert module == "keras_rec_emb.layers.embedding_variable"  # one class for both
    assert table_module.startswith(f"keras_rec_emb.backend.{backend}."), table_module
    assert shape.strip() == "(1, 4)"


def test_keras_json_naming_another_backend_is_refused(tmp_path):
    (tmp_path / "keras.json").write_text('{"backend": "numpy"}')
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env.update(KERAS_HOME=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", "import keras_rec_emb"], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "'numpy'" in result.stderr and "keras.json" in result.stderr


def test_public_api():
    for name in ("EmbeddingVariableOption", "InitializerOption", "CounterFilter", "CBFFilter",
                 "GlobalStepEvict", "L2WeightEvict", "StorageOption", "save_model", "load_model",
                 "storage_root", "export_for_serving"):
        assert hasattr(kre, name), name
    assert set(kre.layers.__all__) == {"EmbeddingVariable", "GroupEmbedding", "FeatureSpec",
                                       "MultiHashEmbedding", "AdaptiveEmbedding",
                                       "FeatureConfig", "TableConfig", "HashStrings"}
    assert callable(kre.callbacks.EvictionCallback)
    assert set(kre.optimizers.__all__) == {"SGD", "Adagrad", "Adam", "Ftrl", "AdamAsync",
                                           "AdagradDecay", "AdamW", "LossScaleOptimizer"}


def test_import_needs_no_confluent_kafka_and_kafka_classes_name_the_extra():
    """confluent-kafka is the `kafka` extra: the package imports without it
    (KafkaPosition, plain state, still works) and building a Kafka dataset
    raises an ImportError that names the extra."""
    script = textwrap.dedent('''
        import sys
        sys.modules["confluent_kafka"] = None  # `import confluent_kafka` now fails
        import tensorflow as tf
        import keras_rec_emb as kre
        from keras_rec_emb.data import KafkaPosition
        position = KafkaPosition({("clicks", 0): 42})
        assert position.offsets() == {("clicks", 0): 42}
        for make in (lambda: kre.data.KafkaDataset(["clicks:0"], servers="127.0.0.1:9"),
                     lambda: kre.data.KafkaGroupIODataset(["clicks"], "g", "127.0.0.1:9")):
            try:
                make()
            except ImportError as e:
                print("ERROR:", e)
            else:
                print("NO ERROR")
    ''')
    result = run(["-c", script])
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO"))]
    assert len(errors) == 2
    for line in errors:
        assert line.startswith("ERROR:") and 'pip install "keras-rec-emb[kafka]"' in line, line
    # One TensorFlow distribution here: the warning of
    # test_import_names_a_second_tensorflow_distribution_and_loads_no_kafka is not given.
    assert "Several TensorFlow distributions" not in result.stderr


def test_missing_tensorflow_names_the_extras():
    """No TensorFlow distribution is a dependency (one would replace the
    other): without TensorFlow the import says how to get one."""
    result = run(["-c", "import sys; sys.modules['tensorflow'] = None; import keras_rec_emb"])
    assert result.returncode != 0
    assert "needs TensorFlow, which is not installed" in result.stderr
    assert 'pip install "keras-rec-emb[cpu]"' in result.stderr
    assert 'pip install "keras-rec-emb[gpu]"' in result.stderr


def test_import_names_a_second_tensorflow_distribution_and_loads_no_kafka(tmp_path):
    """`tensorflow` installed beside `tensorflow-cpu` (as a dependency on the
    other one would do) is named at import, with the fix. The same import
    does not load confluent-kafka (installed here: the `kafka` extra)."""
    info = tmp_path / "tensorflow-2.21.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.21.0\n")
    result = run(["-c", "import sys, keras_rec_emb; print('confluent_kafka' in sys.modules)"],
                 PYTHONPATH=str(tmp_path), KERAS_BACKEND="tensorflow")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
    assert "Several TensorFlow distributions are installed" in result.stderr
    assert "tensorflow==2.21.0" in result.stderr
    installed = [d for d in ("tensorflow-cpu", "tensorflow") if _installed(d)]
    for name in installed:
        assert f"{name}==" in result.stderr
    # Without the second distribution there is no warning: checked by the
    # import of test_import_needs_no_confluent_kafka_and_kafka_classes_name_the_extra.


def _installed(name):
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def test_package_declares_no_tensorflow_distribution():
    """The installed distribution's requirements: TensorFlow only in the
    `cpu`/`gpu` extras, Kafka only in `kafka`, ranges rather than pins."""
    requires = metadata.requires("keras-rec-emb")
    unconditional = [r for r in requires if "extra ==" not in r]
    names = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip()
             for r in unconditional}
    assert names == {"keras", "numpy", "pyarrow"}, unconditional
    assert not any("==" in r for r in unconditional), unconditional
    by_extra = {}
    for r in requires:
        if "extra ==" in r:
            extra = r.split("extra ==")[1].strip().strip('"')
            by_extra.setdefault(extra, []).append(r.split(";")[0].strip())
    assert [r.split("<")[0].split(">")[0] for r in by_extra["cpu"]] == ["tensorflow-cpu"]
    assert [r.split("<")[0].split(">")[0] for r in by_extra["gpu"]] == ["tensorflow"]
    assert any(r.startswith("confluent-kafka") for r in by_extra["kafka"])
    assert any(r.startswith("matplotlib") for r in by_extra["bench"])
    assert {"docs", "cpu", "gpu", "kafka", "bench"} <= set(by_extra)


def test_keras_version_outside_the_checked_ones_warns():
    import keras

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kre._check_keras_version(keras.__version__)  # the pinned one: silent
    with pytest.warns(RuntimeWarning, match=r"Keras 3\.16\.0 is installed.*keras==3\.15\.1"):
        kre._check_keras_version("3.16.0")


def test_ops_library_loads_within_its_tensorflow_minor_release(monkeypatch):
    """The library is refused for another TensorFlow minor release only: a
    patch release keeps TensorFlow's C++ ABI."""
    import tensorflow as tf

    from keras_rec_emb.backend.tensorflow import ops as _ops

    major, minor, _ = tf.__version__.split(".", 2)
    load = _ops.gen.__wrapped__
    monkeypatch.setattr(_ops, "_built_against", lambda: f"{major}.{minor}.99")
    assert hasattr(load(), "kre_table_lookup")
    other = f"{major}.{int(minor) - 1}.0"
    monkeypatch.setattr(_ops, "_built_against", lambda: other)
    with pytest.raises(ImportError, match=rf"built against TensorFlow {other}, .*"
                                          rf"load only in TensorFlow {major}\.{int(minor) - 1}\.x"):
        load()


def test_version_has_one_source():
    from keras_rec_emb import _version

    assert kre.__version__ == _version.__version__ == metadata.version("keras-rec-emb")
    assert kre.__version__ == "0.2.0"


PUBLIC_MODULES = ["keras_rec_emb", "keras_rec_emb.callbacks", "keras_rec_emb.data",
                  "keras_rec_emb.distribute", "keras_rec_emb.layers", "keras_rec_emb.ops",
                  "keras_rec_emb.optimizers"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_modules_declare_their_api(name):
    """Each public namespace declares `__all__`, every name in it exists, and
    dir() (completion) lists exactly those: no `os`, `time`, `keras` or
    implementing modules."""
    import importlib

    module = importlib.import_module(name)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    for public in module.__all__:
        assert hasattr(module, public), f"{name}.{public}"
    assert sorted(dir(module)) == sorted(module.__all__)
    assert "os" not in dir(module) and "time" not in dir(module)


def _unannotated(func):
    sig = inspect.signature(func)
    return [p.name for p in sig.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and p.annotation is p.empty]


def test_optimizers_show_their_real_signature():
    """Not `(*args, **kwargs)`: the Keras namesake's arguments (and ours)."""
    import keras

    for name in ("SGD", "Adagrad", "Adam", "Ftrl"):
        ours = inspect.signature(getattr(kre.optimizers, name))
        theirs = inspect.signature(getattr(keras.optimizers, name))
        assert not any(p.kind is p.VAR_POSITIONAL for p in ours.parameters.values()), ours
        for param in theirs.parameters.values():
            assert ours.parameters[param.name] == param, (name, param)
    assert "table_rule" in inspect.signature(kre.optimizers.Ftrl).parameters
    # The signature is the one that binds: a positional learning rate still works.
    assert float(kre.optimizers.SGD(0.25, momentum=0.5).learning_rate) == 0.25
    assert kre.optimizers.Ftrl(0.1, table_rule="deeprec").get_config()["table_rule"] == "deeprec"


@pytest.mark.parametrize("space", ["keras_rec_emb", "keras_rec_emb.layers",
                                   "keras_rec_emb.optimizers"])
def test_public_signatures_are_annotated(space):
    import importlib

    module = importlib.import_module(space)
    missing = {}
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            func = obj.__init__
        elif inspect.isfunction(obj):
            func = obj
        else:
            continue
        # Arguments passed through to a Keras base class keep its signature,
        # which Keras does not annotate.
        keras_bases = [c for c in getattr(obj, "__mro__", ())
                       if c.__module__.startswith("keras.") and "__init__" in vars(c)]
        passed = set(inspect.signature(keras_bases[0].__init__).parameters) if (
            keras_bases and not _unannotated_own(obj)) else set()
        unannotated = [p for p in _unannotated(func) if p not in passed]
        if unannotated:
            missing[name] = unannotated
    assert not missing, f"parameters without annotations in {space}: {missing}"


def _unannotated_own(cls):
    """Whether `cls` defines its own __init__ in source (not a copied signature)."""
    init = vars(cls).get("__init__")
    return init is not None and getattr(init, "__signature__", None) is None


@pytest.mark.parametrize("name", ["keras_rec_emb.options", "keras_rec_emb.saving",
                                  "keras_rec_emb.serving", "keras_rec_emb.incremental"])
def test_modules_behind_the_top_level_declare_their_api(name):
    """The modules whose names the top level re-exports declare them in
    `__all__` (star-imports and the docs take only those)."""
    import importlib

    module = importlib.import_module(name)
    assert module.__all__
    for public in module.__all__:
        assert getattr(module, public) is getattr(kre, public), f"{name}.{public}"


def test_license_is_an_spdx_string():
    """`project.license` as a table is deprecated by setuptools (builds stop
    after 2027-02-18): it is an SPDX expression, which needs setuptools >= 77,
    and no license classifier says it twice (setuptools refuses both)."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    assert config["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in config["project"]["classifiers"])
    assert "setuptools>=77" in config["build-system"]["requires"]
