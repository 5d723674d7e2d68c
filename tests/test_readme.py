"""The README is a user's page: short, its first commands `make demo` and
`make test`, its quickstart runs unchanged under both Keras backends, and
its links (and the docs pages') point at files that exist."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")


def _readme():
    with open(README, encoding="utf-8") as f:
        return f.read()


def quickstart():
    """The first Python block of the README's Quickstart section (the block
    .ci/wheel_check.py runs against the installed wheel too)."""
    section = _readme().split("\n## Quickstart\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_is_a_short_page_whose_first_commands_are_make_demo_and_make_test():
    text = _readme()
    assert len(text.splitlines()) <= 300
    first_block = re.search(r"```(\w*)\n(.*?)```", text, re.S)
    commands = [line.split("#")[0].strip() for line in first_block.group(2).splitlines()]
    assert commands[:2] == ["make demo", "make test"]


def test_quickstart_uses_no_tensorflow_only_api():
    code = quickstart()
    assert "model.export(" not in code and "tf." not in code


# The README says that under JAX training does not import TensorFlow: checked
# just before the first save (Keras's `.keras` serialization imports it
# whenever it is installed, which is Keras's doing, not this package's).
_CHECK_JAX = ('import sys; assert "tensorflow" not in sys.modules, '
              '"the quickstart imported TensorFlow under JAX before saving"\n')


def _with_jax_check(code):
    lines = code.splitlines(keepends=True)
    first_save = next(i for i, line in enumerate(lines) if line.startswith("kre.save_model("))
    return "".join(lines[:first_save] + [_CHECK_JAX] + lines[first_save:])


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_quickstart_runs_under_both_backends(backend, tmp_path):
    code = _with_jax_check(quickstart()) if backend == "jax" else quickstart()
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The ids the quickstart draws, drawn again here: the table holds exactly
    # their distinct values.
    rng = np.random.default_rng(0)
    distinct = len(np.unique(rng.integers(0, 10**15, size=(1024, 3))))
    assert f"distinct ids: {distinct}\n" in result.stdout, result.stdout
    assert "reloaded predicts alike: True\n" in result.stdout, result.stdout
    assert (tmp_path / "ctr.keras").is_file()
    assert (tmp_path / "plain" / "saved_model.pb").is_file()


def _markdown_files():
    yield README
    for folder, _, names in os.walk(DOCS):
        for name in names:
            if name.endswith(".md"):
                yield os.path.join(folder, name)


# Pages `make docs` generates (docs/hooks.py): guides/<name>.md from
# guides/<name>.py, and the API reference's backend availability table.
_GENERATED = {os.path.join(DOCS, "api", "backends.md")} | {
    os.path.join(DOCS, "guides", name[:-3] + ".md")
    for name in os.listdir(os.path.join(ROOT, "guides")) if name.endswith(".py")}


@pytest.mark.parametrize("path", list(_markdown_files()), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_point_at_files(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
        if not os.path.exists(file) and file not in _GENERATED:
            broken.append(target)
    assert not broken, f"{os.path.relpath(path, ROOT)} links to missing files: {broken}"
