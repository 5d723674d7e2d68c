"""Run with the python of a fresh virtualenv into which `make check-wheel`
installed the GPU `tensorflow` build, then our wheel without extras.

Checks that the wheel kept that TensorFlow (no tensorflow-cpu beside it,
still built with CUDA), that the package is the installed wheel (not a
source checkout), then runs the README's quickstart in a temporary folder.
"""

import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme_example():
    text = open(README, encoding="utf-8").read()
    section = text.split("\n## Quickstart\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def main():
    installed = {d.metadata["Name"].lower().replace("_", "-") for d in metadata.distributions()}
    assert "tensorflow" in installed, "the GPU tensorflow build is not installed"
    assert "tensorflow-cpu" not in installed, "installing the wheel added tensorflow-cpu"
    assert "confluent-kafka" not in installed, "confluent-kafka is an extra, not a dependency"
    import tensorflow as tf

    assert tf.test.is_built_with_cuda(), "TensorFlow lost its CUDA build"
    import keras_rec_emb

    assert "site-packages" in keras_rec_emb.__file__, keras_rec_emb.__file__
    print(f"wheel check: keras_rec_emb {keras_rec_emb.__version__} from "
          f"{os.path.dirname(keras_rec_emb.__file__)}, tensorflow {tf.__version__} "
          f"(built with CUDA), no tensorflow-cpu")
    with tempfile.TemporaryDirectory() as work:
        result = subprocess.run([sys.executable, "-c", readme_example()], cwd=work,
                                timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        assert result.returncode == 0, "the README example failed"
        for path in ("ctr.keras", "plain"):
            assert os.path.exists(os.path.join(work, path)), path
    print("wheel check: the README example ran against the installed wheel")


if __name__ == "__main__":
    main()
