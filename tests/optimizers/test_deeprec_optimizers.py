"""AdamAsync, AdagradDecay and AdamW against independent NumPy references,
step by step, on a dense variable, a keras.layers.Embedding with repeated ids
and an embedding table whose rows first appear at different steps."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable

from tests._deeprec_cases import (CASE_IDS, CASES, DIM, DVD, E0, GRADS,
                                  IDLE_ROW_ACCUMULATOR, T0, VOCAB, W0, idle_row_key, ref_adamw,
                                  rng)


def run_ours(optimizer, matrix_initializer):
    w = keras.Variable(W0, name="w")
    emb = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=matrix_initializer(E0))
    emb.build((None,))
    ev = EmbeddingVariable(DIM, initializer=matrix_initializer(T0), ev_option=kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD)))
    ev.build()
    for gw, e_idx, e_val, t_keys, t_val in GRADS:
        optimizer.apply_gradients([
            (tf.constant(gw), w),
            (tf.IndexedSlices(tf.constant(e_val), tf.constant(e_idx), tf.constant([VOCAB, DIM])),
             emb.embeddings),
            (tf.IndexedSlices(tf.constant(t_val), tf.constant(t_keys, tf.int64)), ev.table.variable),
        ])
    data = ev.export()
    table = {int(k): data["values"][i] for i, k in enumerate(data["keys"])}
    return w.numpy(), emb.embeddings.numpy(), table


@pytest.mark.parametrize("name, kwargs, reference, ref_kwargs", CASES, ids=CASE_IDS)
def test_matches_numpy_reference(name, kwargs, reference, ref_kwargs, matrix_initializer):
    w, e, table = run_ours(getattr(kre.optimizers, name)(**kwargs), matrix_initializer)
    rw, re_, rtable = reference(**ref_kwargs)
    np.testing.assert_allclose(w, rw, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(e, re_, rtol=1e-4, atol=1e-5)
    assert not np.allclose(e, E0)
    assert table.keys() == rtable.keys() and len(table) >= 4
    for k in table:
        np.testing.assert_allclose(table[k], rtable[k], rtol=1e-4, atol=1e-5, err_msg=f"key {k}")


def test_adamw_defaults_to_keras_weight_decay(matrix_initializer):
    """`AdamW()` decays by 0.004 as keras.optimizers.AdamW does (keras-rs's
    examples rely on it); a large learning rate makes the decay visible."""
    default = kre.optimizers.AdamW()
    keras_default = keras.optimizers.AdamW()
    assert default.weight_decay == keras_default.weight_decay == 0.004
    assert float(default.learning_rate) == float(keras_default.learning_rate)
    w, e, table = run_ours(kre.optimizers.AdamW(learning_rate=0.5), matrix_initializer)
    for wd, check in ((0.004, np.testing.assert_allclose), (0.0, None)):
        rw, re_, rtable = ref_adamw(wd=wd, lr=0.5, eps=1e-8)
        if check is None:  # without the decay the numbers differ
            assert not np.allclose(w, rw, rtol=1e-4, atol=1e-5)
            continue
        check(w, rw, rtol=1e-4, atol=1e-5)
        check(e, re_, rtol=1e-4, atol=1e-5)
        assert table.keys() == rtable.keys() and len(table) >= 4
        for k in table:
            check(table[k], rtable[k], rtol=1e-4, atol=1e-5, err_msg=f"key {k}")


def test_adagrad_decay_floor_and_row_catch_up(matrix_initializer):
    # A row idle for several periods decays once when next updated (DeepRec:
    # accum_decay_power += 1 per update), floored at the initial value.
    ev = EmbeddingVariable(DIM, initializer=matrix_initializer(T0), ev_option=kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_dim=DVD)))
    ev.build()
    opt = kre.optimizers.AdagradDecay(0.1, initial_accumulator_value=0.1,
                                      accumulator_decay_step=2, accumulator_decay_rate=0.5)
    g = tf.fill([1, DIM], 3.0)
    for step in range(9):
        keys = tf.constant([idle_row_key(step)], tf.int64)
        opt.apply_gradients([(tf.IndexedSlices(g, keys), ev.table.variable)])
    data = ev.export()
    i = list(data["keys"]).index(5)
    np.testing.assert_allclose(data["slots"]["accumulator"][i], IDLE_ROW_ACCUMULATOR, rtol=1e-6)
    np.testing.assert_array_equal(data["slots"]["decay_period"][i], [1.0])


@pytest.mark.parametrize("name, kwargs", [
    ("adam_async", {}), ("adagrad_decay", {}),
    (kre.optimizers.AdamW, dict(weight_decay=0.01, learning_rate=0.01)),
    (kre.optimizers.AdamAsync, dict(apply_sparse_rmsprop=True, learning_rate=0.01)),
])
def test_fit_save_reload_continues_identically(saving_round_trip, name, kwargs):
    def make():
        ids = keras.Input((3,), dtype="int64")
        h = EmbeddingVariable(8, combiner="mean")(ids)
        h2 = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(ids % 50))
        out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Concatenate()([h, h2]))
        model = keras.Model(ids, out)
        opt = name if isinstance(name, str) else name(**kwargs)
        model.compile(optimizer=opt, loss="binary_crossentropy")
        return model

    x = rng.integers(0, 10**12, size=(64, 3))
    y = rng.integers(0, 2, size=(64, 1)).astype(np.float32)
    model = make()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    loaded = saving_round_trip(model, x)
    assert type(loaded.optimizer) is type(model.optimizer)
    x2 = np.concatenate([x[:32], rng.integers(0, 10**12, size=(32, 3))])
    for m in (model, loaded):
        m.fit(x2, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_array_equal(model.predict(x2, verbose=0), loaded.predict(x2, verbose=0))


@pytest.mark.parametrize("opt", [
    kre.optimizers.AdamAsync(0.01, 0.8, 0.95, 1e-6, use_nesterov=True, apply_sparse_rmsprop=True,
                             clipnorm=1.0),
    kre.optimizers.AdagradDecay(0.2, 0.5, 1000, 0.7, 1e-6, global_clipnorm=2.0),
    kre.optimizers.AdamW(0.02, 0.003, 0.8, 0.9, 1e-6, amsgrad=True),
], ids=lambda o: type(o).__name__)
def test_config_round_trip(opt):
    config = opt.get_config()
    clone = type(opt).from_config(config)
    assert clone.get_config() == config
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is type(opt) and restored.get_config() == config


@pytest.mark.parametrize("make, match", [
    (lambda: kre.optimizers.AdamAsync(-0.1), "learning_rate=-0.1"),
    (lambda: kre.optimizers.AdagradDecay(-1.0), "learning_rate=-1.0"),
    (lambda: kre.optimizers.AdamW(0.01, learning_rate=-0.5), "learning_rate=-0.5"),
    (lambda: kre.optimizers.AdamAsync(beta_1=1.0), r"beta_1.*\[0, 1\).*1.0"),
    (lambda: kre.optimizers.AdagradDecay(accumulator_decay_rate=0.0), r"\(0, 1\].*=0.0"),
    (lambda: kre.optimizers.AdagradDecay(accumulator_decay_rate=1.5), r"\(0, 1\].*=1.5"),
    (lambda: kre.optimizers.AdagradDecay(accumulator_decay_step=0), "accumulator_decay_step=0"),
    (lambda: kre.optimizers.AdagradDecay(accumulator_decay_step=-3), "accumulator_decay_step=-3"),
    (lambda: kre.optimizers.AdagradDecay(accumulator_decay_step=2.5), "accumulator_decay_step=2.5"),
    (lambda: kre.optimizers.AdagradDecay(initial_accumulator_value=0.0),
     "initial_accumulator_value=0.0"),
    (lambda: kre.optimizers.AdamW(-0.01), "weight_decay=-0.01"),
    (lambda: kre.optimizers.AdamW(None), "weight_decay=None"),
])
def test_bad_arguments(make, match):
    # ValueError for a value out of range; TypeError for one of the wrong kind (None).
    with pytest.raises((ValueError, TypeError), match=match):
        make()
