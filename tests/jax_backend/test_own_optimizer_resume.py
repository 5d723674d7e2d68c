"""Under JAX a table's own optimizer resumes exactly after a `.keras`
reload (its step: Adam's bias correction, a schedule), as under TensorFlow
(tests/test_own_optimizer_resume.py runs the same scenario there)."""

import keras
import pytest

from tests import _resume


@pytest.mark.parametrize("form", _resume.FORMS)
@pytest.mark.parametrize("kind", _resume.KINDS)
def test_one_epoch_saved_loaded_and_one_more_equals_two_epochs(kind, form, tmp_path):
    got, want = _resume.resumed_and_uninterrupted(kind, form, str(tmp_path / "m.keras"))
    _resume.assert_same(got, want)


def test_the_step_is_saved_with_the_table(tmp_path):
    ids, labels = _resume._data()  # pylint: disable=protected-access
    model = _resume._model("adam", "embedding_variable")  # pylint: disable=protected-access
    model.fit(ids, labels, batch_size=_resume.BATCH, shuffle=False, verbose=0)
    layer = model.get_layer("ev")
    # The last batch's ids are not admitted: no version says the step.
    assert int(layer.export()["versions"].max()) + 1 < int(layer.iterations.value) == 4
    model.save(str(tmp_path / "m.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "m.keras")).get_layer("ev")
    assert int(loaded.iterations.value) == 4
