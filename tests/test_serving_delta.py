"""A live `model.export` SavedModel takes incremental checkpoints in place."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

pytestmark = pytest.mark.tensorflow_only  # `model.export` SavedModels of this package's TF ops


def test_live_saved_model_takes_deltas_and_predicts_like_the_trained_model(tmp_path):
    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int64")
    ev = EmbeddingVariable(4, combiner="mean", name="ev", ev_option=kre.EmbeddingVariableOption(
        evict_option=kre.GlobalStepEvict(steps_to_live=2)))
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(ev(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.2), loss="mse")
    rng = np.random.default_rng(0)
    model.train_on_batch(rng.integers(0, 40, (16, 3)), rng.normal(size=(16, 1)))
    ckpt = kre.IncrementalCheckpointer(model, tmp_path / "chain")
    ckpt.save_full()
    export_path = str(tmp_path / "served")
    model.export(export_path, verbose=False)
    served = tf.saved_model.load(export_path)
    x = rng.integers(0, 80, (32, 3))
    np.testing.assert_allclose(served.serve(tf.constant(x)).numpy(),
                               model.predict(x, verbose=0), rtol=1e-6)
    for step in range(3):
        model.train_on_batch(rng.integers(30 + 10 * step, 60 + 10 * step, (16, 3)),
                             rng.normal(size=(16, 1)))
        assert ev.evict() >= 0
        link = ckpt.save_incremental()
        before = served.serve(tf.constant(x)).numpy()
        stats = kre.apply_to_saved_model(served, link)
        assert stats["dense"] == 2 and sum(stats["tables"].values()) > 0
        after = served.serve(tf.constant(x)).numpy()
        np.testing.assert_allclose(after, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
        assert not np.allclose(before, after)
    with pytest.raises(ValueError, match="not a readable checkpoint link"):
        bad = tmp_path / "bad.npz"
        bad.write_bytes(b"nope")
        kre.apply_to_saved_model(served, str(bad))
