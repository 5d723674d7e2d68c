"""A table read several times in one training step (one EmbeddingVariable
called on two inputs) counts the step once and gets one update with the
summed gradient of all its lookups, as under TensorFlow, whether the layer
is called with training=True (functional) or training=None (a subclassed
model that does not pass it on), jitted or run eagerly (where each step
reads the very array the last one left in `iterations`)."""

import keras
import numpy as np
import pytest

from keras_rec_emb import optimizers
from keras_rec_emb.layers.embedding_variable import EmbeddingVariable
from tests._table_checks import check_table, with_meta

DIM, DVD = 2, 5
A = np.array([[1, 2], [2, 3], [4, 1]], np.int32)
B = np.array([[2, 4], [1, 1], [3, 3]], np.int32)


class TwoReads(keras.Model):
    def __init__(self, layer, dense, **kwargs):
        super().__init__(**kwargs)
        self.table, self.dense = layer, dense

    def call(self, inputs):  # no `training`: the layers get None
        a, b = inputs
        return self.dense(keras.ops.concatenate(
            [keras.ops.reshape(self.table(a), (-1, 2 * DIM)),
             keras.ops.reshape(self.table(b), (-1, 2 * DIM))], axis=1))


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["jit", "eager"])
@pytest.mark.parametrize("form", ["functional", "subclassed"])
def test_a_table_read_twice_in_a_step_is_updated_once_with_the_summed_gradient(form,
                                                                               run_eagerly):
    lr, acc0, eps, steps = 0.1, 0.1, 1e-7, 2
    layer = EmbeddingVariable(DIM, ev_option=with_meta(DVD),
                              initializer=keras.initializers.RandomUniform(seed=3))
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomNormal(seed=5),
                               trainable=False)
    if form == "functional":
        ia, ib = (keras.Input(shape=(2,), dtype="int32") for _ in range(2))
        flat = keras.layers.Concatenate()([keras.layers.Flatten()(layer(ia)),
                                          keras.layers.Flatten()(layer(ib))])
        model = keras.Model([ia, ib], dense(flat))
    else:
        model = TwoReads(layer, dense)
        model([A, B])
    model.compile(optimizer=optimizers.Adagrad(lr, initial_accumulator_value=acc0,
                                               epsilon=eps), loss="mse",
                  run_eagerly=run_eagerly)
    labels = np.arange(len(A), dtype=np.float32)[:, None]
    model.fit([np.tile(A, (steps, 1)), np.tile(B, (steps, 1))], np.tile(labels, (steps, 1)),
              batch_size=len(A), shuffle=False, verbose=0)

    kernel, bias = (w.astype(np.float64) for w in dense.get_weights())
    rows = {int(k): layer.default_values[k % DVD].astype(np.float64)
            for k in np.unique(np.concatenate([A, B]))}
    acc = {k: np.full(DIM, acc0) for k in rows}
    for _ in range(steps):
        x = np.concatenate([np.stack([rows[int(k)] for k in r]).reshape(-1) for r in A]
                           ).reshape(len(A), -1)
        y = np.concatenate([np.stack([rows[int(k)] for k in r]).reshape(-1) for r in B]
                           ).reshape(len(B), -1)
        d = 2.0 * (np.concatenate([x, y], 1) @ kernel + bias - labels) / len(A)
        d_in = (d @ kernel.T).reshape(len(A), 4, DIM)  # rows of A then of B
        ids = np.concatenate([A, B], 1)
        for key in rows:  # one update per distinct id: both reads summed
            g = d_in[ids == key].sum(0)
            acc[key] = acc[key] + g * g
            rows[key] = rows[key] - lr * g / np.sqrt(acc[key] + eps)

    counts = np.concatenate([A, B])
    check_table(layer, rows, acc, dict.fromkeys(rows, steps - 1),
                {k: steps * int((counts == k).sum()) for k in rows})
    assert int(layer.iterations.value) == steps  # one per step, not per read
