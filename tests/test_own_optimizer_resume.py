"""A table's own optimizer resumes exactly after a `.keras` reload
(tests/jax_backend/test_own_optimizer_resume.py runs the same scenario
under JAX)."""

import pytest

from tests import _resume


@pytest.mark.parametrize("form", _resume.FORMS)
@pytest.mark.parametrize("kind", _resume.KINDS)
def test_one_epoch_saved_loaded_and_one_more_equals_two_epochs(kind, form, tmp_path):
    got, want = _resume.resumed_and_uninterrupted(kind, form, str(tmp_path / "m.keras"))
    _resume.assert_same(got, want)
