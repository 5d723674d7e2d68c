"""DeepRec's test graph, `emb = lookup(ids); loss = sum(emb * weight)`, one
optimizer step per run, under either Keras backend; for the tests written
once for both (tests/test_deeprec_training.py) and the TensorFlow-only ones
of tests/test_deeprec_parity.py. No TensorFlow at module level: the JAX
worker imports this.

Under TensorFlow the step is a `tf.GradientTape` and the optimizer's
`apply_gradients` (a table's gradient is an `IndexedSlices`). Under JAX a
table is updated in the backward of its training lookup (its `table_rule`,
the optimizer the layer's variables were built with), so the step
differentiates the loss through the layer's `stateless_call`."""

import keras
import numpy as np

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable
from tests._deeprec_cases import FTRL_EVICT_IDS, FTRL_EVICT_ROWS


def jax_backend():
    return keras.config.backend() == "jax"


def ones_ev(dim=3, name="ev", **option):
    return EmbeddingVariable(dim, initializer="ones", name=name,
                             ev_option=kre.EmbeddingVariableOption(**option) if option else None)


def train_step(layer, ids, optimizer, weight=2.0):
    """One training step of `loss = sum(layer(ids) * weight)`; returns the
    loss (before the step's update) and the embeddings it read. Under JAX
    `optimizer` must already be built for the layer's variables."""
    ids = np.asarray(ids)
    if jax_backend():
        return _jax_step(layer, ids, weight)
    import tensorflow as tf

    with tf.GradientTape() as tape:
        emb = layer(tf.constant(ids, tf.int64), training=True)
        loss = tf.reduce_sum(emb * tf.constant(weight, tf.float32))
    variables = layer.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return float(loss), emb.numpy()


def _jax_step(layer, ids, weight):
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def loss_fn(trainable):
        emb, new = layer.stateless_call(trainable, non_trainable,
                                        jnp.asarray(ids, jnp.int32), training=True)
        return jnp.sum(emb * jnp.asarray(weight, jnp.float32)), (emb, new)

    (loss, (emb, new)), _ = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    for variable, value in zip(layer.non_trainable_variables, new):
        variable.assign(value)
    return float(loss), np.asarray(emb)


def train_steps(layer, ids, optimizer, steps):
    """`steps` runs of `train_step` by `optimizer`, built for the layer's
    variables as the one a model is compiled with is; the loss of each run
    (before its step) and the embeddings each run read."""
    layer.build()
    optimizer.build(layer.trainable_variables)
    if jax_backend():
        assert layer.table_rule is not None and layer.table_rule.optimizer is optimizer
    losses, reads = [], []
    for _ in range(steps):
        loss, emb = train_step(layer, ids, optimizer)
        losses.append(loss)
        reads.append(emb)
    return losses, reads


def freqs(layer):
    """The layer's table as {key: frequency}."""
    data = layer.export()
    return dict(zip(data["keys"].tolist(), data["freqs"].tolist()))


def row_gradient(values, rows, num_rows):
    """The gradient `values` on the rows `rows` of a variable of `num_rows`
    rows: an `IndexedSlices` under TensorFlow (as keras.layers.Embedding
    gives), the dense array under JAX (whose gradients are dense: zero on
    the other rows)."""
    values = np.asarray(values, np.float32)
    if jax_backend():
        dense = np.zeros((num_rows,) + values.shape[1:], np.float32)
        dense[list(rows)] = values
        return dense
    import tensorflow as tf

    return tf.IndexedSlices(tf.constant(values), tf.constant(list(rows)),
                            tf.constant([num_rows, *values.shape[1:]]))


# The admission filters of DeepRec's filter tests: a key is admitted at its
# third sighting.
FILTERS = [lambda: kre.CounterFilter(3), lambda: kre.CBFFilter(3, 1000, 0.01)]


def ftrl_evict_trained():
    """embedding_variable_ops_test.py: testEmbeddingVariableForL2FeatureEviction
    (Ftrl(0.1, l1=2.0, l2=1e-5), L2WeightEvict(0.9), ids [0,0,0,1,1,2], one
    step): the trained layer, before its save (or `evict()`) evicts key 2."""
    layer = ones_ev(evict_option=kre.L2WeightEvict(0.9))
    opt = kre.optimizers.Ftrl(0.1, l1_regularization_strength=2.0,
                              l2_regularization_strength=0.00001, table_rule="deeprec")
    train_steps(layer, FTRL_EVICT_IDS, opt, 1)
    return layer


def check_ftrl_evicted(layer):
    """Key 2, evicted, reads the initializer; keys 0 and 1 DeepRec's rows."""
    emb = keras.ops.convert_to_numpy(layer(np.asarray(FTRL_EVICT_IDS, np.int32), training=False))
    np.testing.assert_allclose(emb, FTRL_EVICT_ROWS, rtol=1e-6)
    assert sorted(layer.export()["keys"].tolist()) == [0, 1]
