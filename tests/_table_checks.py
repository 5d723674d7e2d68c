"""Tables with their meta kept, and a check of a trained table against
NumPy's rows, for the JAX tests that train tables by hand-written NumPy
references (tests/jax_backend/test_step_once.py, test_weights.py,
test_group_embedding.py)."""

import numpy as np

from keras_rec_emb.options import EmbeddingVariableOption, InitializerOption


def with_meta(default_value_dim):
    """An option whose initializer rows repeat every `default_value_dim`
    keys and whose table keeps frequencies and versions: kept only when
    asked for (as under TensorFlow), they show which step updated each key,
    and how often."""
    return EmbeddingVariableOption(
        init_option=InitializerOption(default_value_dim=default_value_dim), track_meta=True)


def check_table(layer, rows, acc, versions, freqs):
    """The layer's table holds exactly the keys of `rows`, with those
    values, Adagrad accumulators `acc`, `versions` and `freqs` ({key: ...})."""
    e = layer.export()
    order = np.argsort(e["keys"])
    keys = e["keys"][order].tolist()
    assert keys == sorted(rows)
    np.testing.assert_allclose(e["values"][order], [rows[k] for k in keys], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e["slots"]["accumulator"][order], [acc[k] for k in keys],
                               rtol=1e-5)
    assert e["versions"][order].tolist() == [versions[k] for k in keys]
    assert e["freqs"][order].tolist() == [freqs[k] for k in keys]
