"""Every guide runs top to bottom in small mode (KRE_GUIDE_SMALL=1)."""

import glob
import os
import subprocess
import sys

import pytest

# guides/_*.py are helpers the guides import (e.g. _broker.py), not guides.
GUIDES = sorted(p for p in glob.glob(os.path.join(os.path.dirname(__file__), "..", "guides",
                                                  "*.py"))
                if not os.path.basename(p).startswith("_"))


def test_there_are_guides():
    assert len(GUIDES) >= 1


@pytest.mark.parametrize("path", GUIDES, ids=os.path.basename)
def test_guide_runs(path, tmp_path):
    env = dict(os.environ, KRE_GUIDE_SMALL="1", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, os.path.abspath(path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
