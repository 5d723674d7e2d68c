"""Optimizers: parity with Keras, lazy updates, stock-optimizer refusal,
serialization.

Two references: `keras.layers.Embedding` trained by the stock Keras optimizer
on batches without repeated ids, and a one-hot matmul embedding (a dense
gradient) on batches with repeated ids. With repeats, Keras's sparse path
squares each occurrence's gradient separately (Adagrad/Adam/Ftrl accumulate
sum(g_i**2)); our kernel, like DeepRec and TF's own sparse optimizers, sums
the occurrences first, which is the true gradient of the row: (sum g_i)**2.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

VOCAB, DIM, LEN, BATCH = 6, 4, 2, 3
# EV ids are far beyond any vocabulary but map to the same initial rows:
# a new key k starts as row k mod default_value_dim (= VOCAB).
OFFSET = VOCAB * 10**13

rng = np.random.default_rng(7)
ROWS = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
KERNEL = rng.normal(size=(LEN * DIM, 1)).astype(np.float32)
# Every batch of BATCH x LEN ids holds every id, once (X_UNIQUE) or with
# repeats (X_REPEAT): with all rows touched each step, lazy sparse updates
# equal Keras's dense ones.
X_UNIQUE = np.stack([rng.permutation(VOCAB).reshape(BATCH, LEN) for _ in range(8)]
                    ).reshape(-1, LEN)
X_REPEAT = np.stack([np.concatenate([rng.permutation(VOCAB), rng.integers(0, VOCAB, 6)]
                                    ).reshape(BATCH, 2 * LEN) for _ in range(8)]
                    ).reshape(-1, 2 * LEN)
Y = rng.normal(size=(len(X_UNIQUE), 1)).astype(np.float32)


class OneHotEmbedding(keras.layers.Layer):
    """Embedding as one_hot(ids) @ table: its gradient is dense."""

    def __init__(self, initializer, **kwargs):
        super().__init__(**kwargs)
        self.initializer = initializer

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(VOCAB, DIM), initializer=self.initializer)

    def call(self, ids):
        return keras.ops.matmul(keras.ops.one_hot(ids, VOCAB), self.embeddings)

CONFIGS = [
    ("SGD", dict(learning_rate=0.1)),
    ("SGD", dict(learning_rate=0.05, momentum=0.9)),
    ("SGD", dict(learning_rate=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(learning_rate=0.1, weight_decay=0.05)),
    ("Adagrad", dict(learning_rate=0.1)),
    ("Adagrad", dict(learning_rate=0.2, initial_accumulator_value=0.5, epsilon=1e-3)),
    ("Adam", dict(learning_rate=0.01)),
    ("Adam", dict(learning_rate=0.02, beta_1=0.8, beta_2=0.99, amsgrad=True)),
    ("Adam", dict(learning_rate=0.01, weight_decay=0.01)),
    ("Adam", dict(learning_rate=0.01, clipnorm=0.5)),
    ("Ftrl", dict(learning_rate=0.1)),
    ("Ftrl", dict(learning_rate=0.2, l1_regularization_strength=0.01,
                  l2_regularization_strength=0.02, l2_shrinkage_regularization_strength=0.01,
                  beta=0.1, learning_rate_power=-0.7)),
    ("Adagrad", dict(learning_rate=0.3, global_clipnorm=0.2)),
    ("SGD", dict(learning_rate=0.1, clipvalue=0.05)),
]


def build(kind, optimizer, matrix_initializer, length=LEN):
    ids = keras.Input((length,), dtype="int64")
    if kind == "ev":
        emb = EmbeddingVariable(DIM, initializer=matrix_initializer(ROWS), ev_option=kre.EmbeddingVariableOption(
            init_option=kre.InitializerOption(default_value_dim=VOCAB), track_meta=True))
    elif kind == "onehot":
        emb = OneHotEmbedding(matrix_initializer(ROWS))
    else:
        emb = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=matrix_initializer(ROWS))
    h = keras.layers.Flatten()(emb(ids))
    out = keras.layers.Dense(1, kernel_initializer=matrix_initializer(KERNEL))(h)
    model = keras.Model(ids, out)
    model.compile(optimizer=optimizer, loss="mse")
    return model, emb


def ev_rows(emb):
    data = emb.export()
    order = np.argsort(data["keys"])
    np.testing.assert_array_equal(data["keys"][order], np.arange(VOCAB) + OFFSET)
    return data["values"][order]


CONFIG_IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)]


def check_parity(ev_model, ev, ref_model, ref, x_ev, x_ref, rtol=2e-5):
    for model, x in ((ev_model, x_ev), (ref_model, x_ref)):
        model.fit(x, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    expect = ref.embeddings.numpy()
    assert not np.allclose(expect, ROWS)  # training moved the rows
    np.testing.assert_allclose(ev_rows(ev), expect, rtol=rtol, atol=rtol / 10)
    np.testing.assert_allclose(ev_model.layers[-1].kernel.numpy(),
                               ref_model.layers[-1].kernel.numpy(), rtol=rtol, atol=rtol / 10)
    np.testing.assert_allclose(ev_model.predict(x_ev, verbose=0),
                               ref_model.predict(x_ref, verbose=0), rtol=rtol, atol=1e-4)
    data = ev.export()
    assert data["versions"].max() == ev_model.optimizer.iterations.numpy() - 1
    counts = np.bincount(np.asarray(x_ref).ravel(), minlength=VOCAB) * 2  # 2 epochs
    np.testing.assert_array_equal(data["freqs"][np.argsort(data["keys"])], counts)


@pytest.mark.parametrize("name, kwargs", CONFIGS, ids=CONFIG_IDS)
def test_parity_with_keras_embedding(name, kwargs, matrix_initializer):
    ev_model, ev = build("ev", getattr(kre.optimizers, name)(**kwargs), matrix_initializer)
    ref_model, ref = build("embedding", getattr(keras.optimizers, name)(**kwargs),
                           matrix_initializer)
    check_parity(ev_model, ev, ref_model, ref, X_UNIQUE + OFFSET, X_UNIQUE)
    # Our optimizer on a plain Embedding is exactly Keras's optimizer.
    mixed_model, mixed = build("embedding", getattr(kre.optimizers, name)(**kwargs),
                               matrix_initializer)
    mixed_model.fit(X_UNIQUE, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_array_equal(mixed.embeddings.numpy(), ref.embeddings.numpy())


@pytest.mark.parametrize("name, kwargs", CONFIGS, ids=CONFIG_IDS)
def test_parity_with_dense_gradient_when_ids_repeat(name, kwargs, matrix_initializer):
    ev_model, ev = build("ev", getattr(kre.optimizers, name)(**kwargs), matrix_initializer,
                         length=2 * LEN)
    ref_model, ref = build("onehot", getattr(keras.optimizers, name)(**kwargs),
                           matrix_initializer, length=2 * LEN)
    check_parity(ev_model, ev, ref_model, ref, X_REPEAT + OFFSET, X_REPEAT)


@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
def test_parity_when_batches_touch_some_rows(name, matrix_initializer):
    # SGD and Adagrad leave rows without gradient unchanged, so lazy and
    # dense updates agree even when batches touch a few rows.
    # Each step (batch of one row) touches two of ids 0..3, never repeated.
    x = np.array([[0, 1], [2, 3], [1, 3], [0, 2], [3, 1], [2, 0]])
    y = np.ones((len(x), 1), np.float32)
    ev_model, ev = build("ev", getattr(kre.optimizers, name)(0.1), matrix_initializer)
    ref_model, ref = build("embedding", getattr(keras.optimizers, name)(0.1), matrix_initializer)
    ev_model.fit(x + OFFSET, y, batch_size=1, shuffle=False, verbose=0)
    ref_model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert ev.table_size() == 4
    data = ev.export()
    order = np.argsort(data["keys"])
    np.testing.assert_allclose(data["values"][order], ref.embeddings.numpy()[:4], rtol=2e-5, atol=2e-6)


def test_adam_updates_are_lazy_on_tables(matrix_initializer):
    model, ev = build("ev", kre.optimizers.Adam(0.1), matrix_initializer)
    model.fit(np.array([[0, 1], [2, 3]]) + OFFSET, np.ones((2, 1)), verbose=0)
    before = ev.export()
    model.fit(np.array([[0, 0]]) + OFFSET, np.ones((1, 1)), verbose=0)
    after = ev.export()
    for k in range(4):
        i = list(before["keys"]).index(k + OFFSET)
        j = list(after["keys"]).index(k + OFFSET)
        changed = not np.array_equal(before["values"][i], after["values"][j])
        assert changed == (k == 0)
        assert (after["versions"][j] == 1) == (k == 0)
        np.testing.assert_array_equal(
            before["slots"]["momentum"][i] == after["slots"]["momentum"][j], k != 0)


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad", "Ftrl", "RMSprop"])
def test_stock_keras_optimizer_is_refused_with_the_fix(name, matrix_initializer):
    model, _ = build("ev", getattr(keras.optimizers, name)(), matrix_initializer)
    with pytest.raises(TypeError, match=r"stock Keras optimizer.*keras_rec_emb\.optimizers"):
        model.fit(X_UNIQUE + OFFSET, Y, batch_size=BATCH, verbose=0)


def test_unsupported_optimizer_features_with_tables(matrix_initializer):
    for kwargs, match in ((dict(use_ema=True), "use_ema"),
                          (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps")):
        model, _ = build("ev", kre.optimizers.Adam(0.1, **kwargs), matrix_initializer)
        with pytest.raises(ValueError, match=match):
            model.fit(X_UNIQUE + OFFSET, Y, batch_size=BATCH, verbose=0)


@pytest.mark.parametrize("name, kwargs", CONFIGS[::3], ids=lambda v: str(v))
def test_optimizer_serialization(name, kwargs):
    opt = getattr(kre.optimizers, name)(**kwargs)
    config = opt.get_config()
    clone = type(opt).from_config(config)
    assert clone.get_config() == config
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is type(opt) and restored.get_config() == config


def test_custom_training_loop_with_gradient_tape(matrix_initializer):
    layer = EmbeddingVariable(DIM, initializer=matrix_initializer(ROWS), ev_option=kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=VOCAB)))
    opt = kre.optimizers.SGD(0.5)
    ids = tf.constant([[1, 1, 2]], tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids, training=True))
    grads = tape.gradient(loss, layer.trainable_variables)
    opt.apply_gradients(zip(grads, layer.trainable_variables))
    data = layer.export()
    i = list(data["keys"]).index(1)
    np.testing.assert_allclose(data["values"][i], ROWS[1] - 0.5 * 2.0, rtol=1e-6)
