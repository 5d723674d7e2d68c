"""A table's own optimizer (`EmbeddingVariable(optimizer=...)`) is saved at
one path under both backends, `layers/<layer>/optimizer`, so that a rate
assigned to it and its step survive a save under one backend and a load
under the other; a file that holds it at `table_optimizer` (how the
TensorFlow layer of 0.2.0 saved it) loads the same."""

import io
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_rec_emb as kre

pytestmark = pytest.mark.backends("tensorflow", "jax")

WEIGHTS = "model.weights.h5"


def _trained(path):
    layer = kre.layers.EmbeddingVariable(2, combiner="sum", key_dtype="int32", name="ev",
                                         optimizer=kre.optimizers.Adam(0.1))
    ids = keras.Input(shape=(3,), dtype="int32")
    model = keras.Model(ids, keras.ops.sum(layer(ids), axis=-1, keepdims=True))
    model.compile(optimizer=kre.optimizers.SGD(0.1), loss="mse")
    model.fit(np.arange(12, dtype=np.int32).reshape(4, 3), np.ones((4, 1)), batch_size=2,
              verbose=0)
    layer.optimizer.learning_rate.assign(0.02)
    model.save(path)
    return layer


def _groups(path):
    with zipfile.ZipFile(path) as archive, h5py.File(io.BytesIO(archive.read(WEIGHTS))) as f:
        names = []
        f.visit(names.append)
        return names


def _edited(path, out, rate, moved_to=None):
    """A copy of the .keras file at `path` whose own optimizer's saved rate
    is `rate` (its config says what it was), at `moved_to` instead of
    `optimizer` when given."""
    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    buffer = io.BytesIO(files[WEIGHTS])
    with h5py.File(buffer, "a") as f:
        group = "layers/embedding_variable/optimizer"
        f[f"{group}/vars/1"][()] = rate
        if moved_to is not None:
            f.move(group, f"layers/embedding_variable/{moved_to}")
    files[WEIGHTS] = buffer.getvalue()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)


def test_the_own_optimizer_is_saved_at_one_path(tmp_path):
    _trained(tmp_path / "m.keras")
    groups = _groups(tmp_path / "m.keras")
    # The path both backends write and read (the JAX layer of 0.2.0 too).
    assert "layers/embedding_variable/optimizer/vars/1" in groups
    assert not [g for g in groups if "table_optimizer" in g]


@pytest.mark.parametrize("saved_as", ["optimizer", "table_optimizer"])
def test_its_variables_load_from_either_path(tmp_path, saved_as):
    layer = _trained(tmp_path / "m.keras")
    path = tmp_path / "edited.keras"
    _edited(tmp_path / "m.keras", path, 0.03,
            moved_to=None if saved_as == "optimizer" else saved_as)
    assert f"layers/embedding_variable/{saved_as}/vars/1" in _groups(path)
    loaded = keras.saving.load_model(path).get_layer("ev")
    # The file's rate, not the config's (0.02, as it was at the save).
    assert float(loaded.optimizer.learning_rate) == pytest.approx(0.03)
    assert len(loaded.optimizer.variables) == len(layer.optimizer.variables) == 2
    assert int(loaded.optimizer.iterations) == int(layer.optimizer.iterations)
