"""The same training under KERAS_BACKEND=jax (a child process) and
=tensorflow (this process) gives the same tables and Dense weights: one
EmbeddingVariable called on two inputs (one step and one update per training
step), learning rates changed by callbacks and by assignment between fits,
GroupEmbedding features with per-id weights, and GroupEmbedding sequence,
max_norm and default_id features."""

import numpy as np

from tests._cross_backend import LAYER, assert_runs_agree, result_here, result_under_jax

_CODE = """
import numpy as np
import keras
DIM, DVD = 3, 5
def summary(layer, dense, model):
    e = export(layer)
    order = np.argsort(e["keys"])
    return {"keys": e["keys"][order].tolist(), "values": e["values"][order].tolist(),
            "slots": {k: np.asarray(v)[order].tolist() for k, v in e["slots"].items()},
            "freqs": e["freqs"][order].tolist(), "versions": e["versions"][order].tolist(),
            "kernel": dense.get_weights()[0].tolist(), "bias": dense.get_weights()[1].tolist(),
            "learning_rate": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))}
def start(seed, width):
    rng = np.random.default_rng(seed)
    labels = rng.normal(size=(16, 1)).astype(np.float32)
    matrix = rng.normal(size=(DVD, DIM)).astype(np.float32)
    kernel = keras.initializers.Constant(rng.normal(size=(width, 1)).astype(np.float32))
    return rng, labels, keras.initializers.Constant(matrix), keras.layers.Dense(
        1, kernel_initializer=kernel)
def twice(name, lr):
    # One table read by two inputs whose ids overlap.
    rng, labels, init, dense = start(11, 4 * DIM)
    a, b = (rng.integers(0, 7, size=(16, 2)).astype(np.int32) for _ in range(2))
    layer = make_layer(init, None)
    ia, ib = (keras.Input(shape=(2,), dtype="int32") for _ in range(2))
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(layer(ia)),
                                      keras.layers.Flatten()(layer(ib))])
    model = keras.Model([ia, ib], dense(flat))
    model.compile(optimizer=getattr(kre.optimizers, name)(lr), loss="mse")
    model.fit([a, b], labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return summary(layer, dense, model)
def changed_rate(name, how):
    rng, labels, init, dense = start(12, 2 * DIM)
    ids = rng.integers(0, 9, size=(16, 2)).astype(np.int32)
    layer = make_layer(init, None)
    inputs = keras.Input(shape=(2,), dtype="int32")
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=getattr(kre.optimizers, name)(0.05), loss="mse")
    fit = dict(batch_size=4, shuffle=False, verbose=0)
    if how == "scheduler":
        schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.3 ** epoch)
        model.fit(ids, labels, epochs=3, callbacks=[schedule], **fit)
    elif how == "plateau":  # no epoch improves by 1e9: each one after the first halves it
        plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                    min_delta=1e9)
        model.fit(ids, labels, epochs=3, callbacks=[plateau], **fit)
    else:
        model.fit(ids, labels, epochs=1, **fit)
        model.optimizer.learning_rate = 0.01
        model.fit(ids, labels, epochs=1, **fit)
        model.optimizer.learning_rate.assign(0.002)
        model.fit(ids, labels, epochs=1, **fit)
    return summary(layer, dense, model)
def weighted_group(name, lr):
    # a ([batch], sum), b ([batch, 3] padded with -1, mean) and c (sqrtn)
    # share one table, each weighted (some weights <= 0).
    rng, labels, init, dense = start(13, 3 * DIM)
    table = make_layer(init, None)
    group = kre.layers.GroupEmbedding({
        "a": kre.layers.FeatureSpec(table, "sum", weight_feature="wa"),
        "b": kre.layers.FeatureSpec(table, "mean", weight_feature="wb"),
        "c": kre.layers.FeatureSpec(table, "sqrtn", weight_feature="wc")}, output_mode="concat")
    x = {"a": rng.integers(0, 7, size=16), "b": rng.integers(-1, 7, size=(16, 3)),
         "c": rng.integers(-1, 7, size=(16, 3))}
    x = {k: v.astype(np.int32) for k, v in x.items()}
    x["b"][4] = -1  # no id at all
    for f, shape in (("a", (16,)), ("b", (16, 3)), ("c", (16, 3))):
        x["w" + f] = rng.choice([-0.5, 0.0, 0.5, 1.0, 2.5], size=shape).astype(np.float32)
    inputs = {k: keras.Input(shape=v.shape[1:], dtype=v.dtype.name, name=k) for k, v in x.items()}
    model = keras.Model(inputs, dense(group(inputs)))
    model.compile(optimizer=getattr(kre.optimizers, name)(lr), loss="mse")
    model.fit(x, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return summary(table, dense, model)
def option_group(name, lr):
    # One table read by a clipped weighted mean (a), a sum with a default
    # id (b) and a weighted, clipped sequence with a default id (c).
    rng, labels, init, dense = start(15, 4 * DIM)
    table = make_layer(init, None)
    group = kre.layers.GroupEmbedding({
        "a": kre.layers.FeatureSpec(table, "mean", weight_feature="wa", max_norm=0.9),
        "b": kre.layers.FeatureSpec(table, "sum", default_id=11),
        "c": kre.layers.FeatureSpec(table, "sum", weight_feature="wc", sequence=True,
                                    default_id=12, max_norm=1.1)})
    x = {"a": rng.integers(-1, 7, size=(16, 3)), "b": rng.integers(-1, 7, size=(16, 2)),
         "c": rng.integers(-1, 7, size=(16, 3))}
    x = {k: v.astype(np.int32) for k, v in x.items()}
    x["b"][3] = x["c"][5] = x["c"][6] = -1  # no id: the default ids
    for f in "ac":
        x["w" + f] = rng.choice([-0.5, 0.0, 0.5, 1.0, 2.5], size=(16, 3)).astype(np.float32)
    inputs = {k: keras.Input(shape=v.shape[1:], dtype=v.dtype.name, name=k) for k, v in x.items()}
    out = group(inputs)
    flat = keras.layers.Concatenate()([out["a"], out["b"], out["c"][:, 0, :],
                                       keras.ops.sum(out["c"], axis=1)])
    model = keras.Model(inputs, dense(flat))
    model.compile(optimizer=getattr(kre.optimizers, name)(lr), loss="mse")
    model.fit(x, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    out = summary(table, dense, model)
    out["outputs"] = model.predict(x, verbose=0).tolist()
    return out
def weighted_layer(combiner, name, lr):
    # EmbeddingVariable(combiner=...)(ids, weights=w): ids padded with -1,
    # some weights <= 0; the outputs of the trained model too.
    rng, labels, init, dense = start(14, DIM)
    layer = make_layer(init, combiner)
    ids = rng.integers(-1, 7, size=(16, 3)).astype(np.int32)
    w = rng.choice([-0.5, 0.0, 0.5, 1.0, 2.5], size=(16, 3)).astype(np.float32)
    ids_in, w_in = keras.Input(shape=(3,), dtype="int32"), keras.Input(shape=(3,))
    model = keras.Model([ids_in, w_in], dense(layer(ids_in, weights=w_in)))
    model.compile(optimizer=getattr(kre.optimizers, name)(lr), loss="mse")
    model.fit([ids, w], labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    out = summary(layer, dense, model)
    out["outputs"] = model.predict([ids, w], verbose=0).tolist()
    return out
result = {"twice Adam": twice("Adam", 0.01), "twice Adagrad": twice("Adagrad", 0.05),
          "scheduler Adagrad": changed_rate("Adagrad", "scheduler"),
          "plateau Adam": changed_rate("Adam", "plateau"),
          "assigned SGD": changed_rate("SGD", "assign"),
          "weighted group Adagrad": weighted_group("Adagrad", 0.05),
          "weighted group Adam": weighted_group("Adam", 0.01),
          "option group SGD": option_group("SGD", 0.1),
          "option group Adagrad": option_group("Adagrad", 0.05),
          "weighted sum Adagrad": weighted_layer("sum", "Adagrad", 0.05),
          "weighted mean Adagrad": weighted_layer("mean", "Adagrad", 0.05),
          "weighted sqrtn SGD": weighted_layer("sqrtn", "SGD", 0.1)}
"""

_TOLERANCES = {"twice Adam": 1e-4, "twice Adagrad": 1e-5, "scheduler Adagrad": 1e-5,
               "plateau Adam": 1e-4, "assigned SGD": 1e-5, "weighted group Adagrad": 1e-5,
               "weighted group Adam": 1e-4, "option group SGD": 1e-5,
               "option group Adagrad": 1e-5, "weighted sum Adagrad": 1e-5,
               "weighted mean Adagrad": 1e-5, "weighted sqrtn SGD": 1e-5}


def test_steps_learning_rates_and_weights_give_the_tensorflow_backends_numbers():
    """Ids, frequencies, versions, rows, slots, Dense weights and the final
    learning rate agree (1e-5 for SGD and Adagrad, 1e-4 for Adam)."""
    code = _CODE.replace("def summary", LAYER + "def summary", 1)
    tf_runs, jax_runs = result_here(code), result_under_jax(code, JAX_PLATFORMS="cpu")
    # The rates did change: the runs check that the tables follow them.
    assert tf_runs["scheduler Adagrad"]["learning_rate"] < 0.05 * 0.3
    assert abs(tf_runs["plateau Adam"]["learning_rate"] - 0.05 / 4) < 1e-8
    assert abs(tf_runs["assigned SGD"]["learning_rate"] - 0.002) < 1e-9
    assert all("outputs" in tf_runs[f"weighted {c}"] for c in ("sum Adagrad", "mean Adagrad",
                                                                 "sqrtn SGD"))
    # The default ids were inserted and trained.
    assert {11, 12} <= set(tf_runs["option group SGD"]["keys"])
    for name in _TOLERANCES:
        np.testing.assert_allclose(jax_runs[name]["learning_rate"],
                                   tf_runs[name]["learning_rate"], rtol=1e-6, err_msg=name)
    assert_runs_agree(tf_runs, jax_runs, _TOLERANCES, optional=("outputs",))
