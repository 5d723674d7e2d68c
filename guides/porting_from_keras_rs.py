"""
Title: Porting keras-rs's DLRM-DCNv2 to growing tables
Author: keras_rec_emb authors
Description: keras-rs's MLPerf DLRM-DCNv2 example (a subclassed `keras.Model`
with `DistributedEmbedding(feature_configs)`) ported to `keras_rec_emb`:
the same `TableConfig` / `FeatureConfig` shape, hash tables instead of
fixed vocabularies, per-table optimizers, and the model in its subclassed,
functional and `Sequential` forms.
"""

"""
## What changes in a port

keras-rs describes its embeddings with `keras_rs.layers.TableConfig` (a
table: name, vocabulary size, width, initializer, optimizer, combiner) and
`keras_rs.layers.FeatureConfig` (an input feature and the table it reads),
handed to `keras_rs.layers.DistributedEmbedding`. `keras_rec_emb.layers`
has both config classes, with the same arguments where they mean the same
thing, and `GroupEmbedding` takes the same dict of `FeatureConfig`s:

| keras-rs | keras_rec_emb |
|---|---|
| `TableConfig(name, vocabulary_size, embedding_dim, ...)` | `TableConfig(name, embedding_dim)`, the rest by keyword |
| `FeatureConfig(name, table, input_shape, output_shape)` | the same |
| `DistributedEmbedding(feature_configs)` | `GroupEmbedding(feature_configs)` |
| ids must lie in `[0, vocabulary_size)` | any int64 id; the table grows (`vocabulary_size` bounds nothing) |
| `placement`, `max_ids_per_partition`, table stacking | not needed on CPU hash tables: drop them |
| a table's `optimizer`: a Keras optimizer | one of `keras_rec_emb.optimizers` (or its name) |

The model's own optimizer (here Adam for the MLPs and the cross network)
comes from `keras_rec_emb.optimizers` too: it updates the dense weights
exactly as Keras's does, and every table without an optimizer of its own.

When the environment variable `KRE_GUIDE_SMALL=1` is set, this guide runs on
less data (CI runs it that way). `tests/test_dlrm_forms.py` imports the
definitions below and runs fit, evaluate, predict, save/reload,
`model.export` and `export_for_serving` on each model form.
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_rec_emb as kre

SMALL = os.environ.get("KRE_GUIDE_SMALL") == "1"
NUM_DENSE, NUM_SPARSE, IDS_PER_FEATURE = 13, 26, 3

"""
## Tables and features

As in keras-rs's example, every categorical feature has a table of its own,
updated by its own Adagrad (keras-rs's `embedding_learning_rate`). Features
`C25` and `C26` share one table here, to show how: two `FeatureConfig`s
naming one `TableConfig`.
"""


def make_feature_configs(embedding_dim=16, embedding_learning_rate=0.05):
    tables = {f"C{i}": kre.layers.TableConfig(
        name=f"table_C{i}", embedding_dim=embedding_dim, vocabulary_size=40_000_000,
        initializer=keras.initializers.TruncatedNormal(stddev=0.05, seed=i),
        optimizer=kre.optimizers.Adagrad(embedding_learning_rate), combiner="sum")
        for i in range(1, NUM_SPARSE)}
    tables[f"C{NUM_SPARSE}"] = tables[f"C{NUM_SPARSE - 1}"]  # shared
    return {name: kre.layers.FeatureConfig(
        name=name, table=table, input_shape=(None, IDS_PER_FEATURE),
        output_shape=(None, embedding_dim)) for name, table in tables.items()}


"""
## The cross network

keras-rs's `FeatureCross` is DCNv2's cross layer with a low-rank projection:
`x_{l+1} = x_0 * (U (V x_l) + b) + x_l`. Written here as a small Keras layer.
"""


@keras.saving.register_keras_serializable(package="kre_guides")
class FeatureCross(keras.layers.Layer):
    def __init__(self, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.projection_dim = projection_dim
        self.down = keras.layers.Dense(projection_dim, use_bias=False)
        self.up = None

    def build(self, input_shape):
        x0_shape, _ = input_shape
        self.up = keras.layers.Dense(x0_shape[-1], bias_initializer="zeros")
        self.down.build(x0_shape)
        self.up.build(tuple(x0_shape[:-1]) + (self.projection_dim,))

    def call(self, inputs):
        x0, xl = inputs
        return x0 * self.up(self.down(xl)) + xl

    def get_config(self):
        return {**super().get_config(), "projection_dim": self.projection_dim}


@keras.saving.register_keras_serializable(package="kre_guides")
class DCNBlock(keras.layers.Layer):
    def __init__(self, num_layers, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_layers, self.projection_dim = num_layers, projection_dim
        self.crosses = [FeatureCross(projection_dim) for _ in range(num_layers)]

    def call(self, x0):
        xl = x0
        for cross in self.crosses:
            xl = cross((x0, xl))
        return xl

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers,
                "projection_dim": self.projection_dim}


def mlp(dims, final_activation, name):
    return keras.Sequential(
        [keras.layers.Dense(d, activation="relu") for d in dims[:-1]]
        + [keras.layers.Dense(dims[-1], activation=final_activation)], name=name)


"""
## The model, subclassed as in keras-rs

The port changes one line of keras-rs's `DLRMDCNV2.__init__`: the embedding
layer is `kre.layers.GroupEmbedding(feature_configs)` instead of
`keras_rs.layers.DistributedEmbedding(feature_configs)`. Its output is the
same dict of per-feature embeddings. `get_config` serializes the feature
configs, so `keras.saving.load_model` rebuilds the model and restores every
table row, optimizer slot and dense weight.
"""


@keras.saving.register_keras_serializable(package="kre_guides")
class DLRMDCNv2(keras.Model):
    def __init__(self, feature_configs, bottom_mlp_dims, top_mlp_dims, num_dcn_layers,
                 dcn_projection_dim, **kwargs):
        super().__init__(**kwargs)
        feature_configs = {n: keras.saving.deserialize_keras_object(c) if isinstance(c, dict)
                           else c for n, c in feature_configs.items()}
        self.feature_configs = feature_configs
        self.bottom_mlp_dims, self.top_mlp_dims = list(bottom_mlp_dims), list(top_mlp_dims)
        self.num_dcn_layers, self.dcn_projection_dim = num_dcn_layers, dcn_projection_dim
        self.bottom_mlp = mlp(self.bottom_mlp_dims, "relu", "bottom_mlp")
        self.embedding_layer = kre.layers.GroupEmbedding(feature_configs, name="embedding_layer")
        self.dcn_block = DCNBlock(num_dcn_layers, dcn_projection_dim, name="dcn_block")
        self.top_mlp = mlp(self.top_mlp_dims, "sigmoid", "top_mlp")

    def call(self, inputs):
        dense_output = self.bottom_mlp(inputs["dense_input"])
        embeddings = self.embedding_layer(inputs["large_emb_inputs"])
        x = keras.ops.concatenate([dense_output, *embeddings.values()], axis=-1)
        return self.top_mlp(self.dcn_block(x))

    def get_config(self):
        return {**super().get_config(),
                "feature_configs": {n: keras.saving.serialize_keras_object(c)
                                    for n, c in self.feature_configs.items()},
                "bottom_mlp_dims": self.bottom_mlp_dims, "top_mlp_dims": self.top_mlp_dims,
                "num_dcn_layers": self.num_dcn_layers,
                "dcn_projection_dim": self.dcn_projection_dim}


"""
## The same model, functional and `Sequential`

The functional form wires the same layers on `keras.Input`s (ids are
int64). A `Sequential` model takes one input, so its form embeds stacked ids
`[batch, features, ids]` (feature j's ids in `ids[:, j, :]`, padded with -1)
with `output_mode="concat"`, without the dense features.
"""


def make_functional(feature_configs, bottom_mlp_dims, top_mlp_dims, num_dcn_layers,
                    dcn_projection_dim):
    dense_input = keras.Input((NUM_DENSE,), name="dense_input")
    ids = {name: keras.Input((IDS_PER_FEATURE,), dtype="int64", name=name)
           for name in feature_configs}
    embeddings = kre.layers.GroupEmbedding(feature_configs, name="embedding_layer")(ids)
    x = keras.layers.Concatenate()(
        [mlp(bottom_mlp_dims, "relu", "bottom_mlp")(dense_input), *embeddings.values()])
    x = DCNBlock(num_dcn_layers, dcn_projection_dim, name="dcn_block")(x)
    out = mlp(top_mlp_dims, "sigmoid", "top_mlp")(x)
    return keras.Model({"dense_input": dense_input, "large_emb_inputs": ids}, out)


def make_sequential(feature_configs, top_mlp_dims, num_dcn_layers, dcn_projection_dim):
    return keras.Sequential([
        kre.layers.GroupEmbedding(feature_configs, output_mode="concat",
                                  name="embedding_layer"),
        DCNBlock(num_dcn_layers, dcn_projection_dim, name="dcn_block"),
        mlp(top_mlp_dims, "sigmoid", "top_mlp"),
    ])


"""
## Data

Synthetic Criteo-like rows: 13 log-normal dense features and 26 categorical
features of 1 to 3 hashed 64-bit ids each (Zipf-distributed, padded with
-1), shaped as keras-rs's example feeds them: `{"dense_input": ...,
"large_emb_inputs": {feature: ids}}`. `stack_ids` gives the `Sequential`
form's `[batch, 26, 3]` ids.
"""


def make_data(rows, seed=0):
    rng = np.random.default_rng(seed)
    dense = np.log1p(rng.lognormal(0, 1, (rows, NUM_DENSE))).astype("float32")
    ids, logit = {}, dense[:, 0] - 1.0
    for f in range(1, NUM_SPARSE + 1):
        ranks = rng.zipf(1.3, (rows, IDS_PER_FEATURE)) % 10_000
        values = (ranks * 2_654_435_761 + f) % 10**12
        lengths = rng.integers(1, IDS_PER_FEATURE + 1, rows)
        values[np.arange(IDS_PER_FEATURE)[None, :] >= lengths[:, None]] = -1
        ids[f"C{f}"] = values
        if f <= 4:
            logit += 1.5 * (ranks[:, 0] % 3 == 0)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype("float32")[:, None]
    return {"dense_input": dense, "large_emb_inputs": ids}, labels


def stack_ids(x):
    ids = x["large_emb_inputs"]
    return np.stack([ids[f"C{f}"] for f in range(1, NUM_SPARSE + 1)], axis=1)


def input_signature(batch_ids=None):
    """The serving signature of the subclassed form (Keras records only
    shapes for subclassed models, so ids would default to float32)."""
    return [{"dense_input": tf.TensorSpec((None, NUM_DENSE), tf.float32, "dense_input"),
             "large_emb_inputs": {f"C{f}": tf.TensorSpec((None, IDS_PER_FEATURE), tf.int64,
                                                         f"C{f}")
                                  for f in range(1, NUM_SPARSE + 1)}}]


MODEL_ARGS = dict(bottom_mlp_dims=[64, 16], top_mlp_dims=[64, 32, 1], num_dcn_layers=2,
                  dcn_projection_dim=16)


"""
## Train, evaluate, save, reload, serve
"""


def main():
    keras.utils.set_random_seed(1337)
    rows = 4_096 if SMALL else 200_000
    x, y = make_data(rows)
    x_val, y_val = make_data(rows // 4, seed=1)
    model = DLRMDCNv2(make_feature_configs(), **MODEL_ARGS)
    model.compile(optimizer=kre.optimizers.Adam(0.001), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    model.fit(x, y, batch_size=512, epochs=2, verbose=2)
    print("validation:", model.evaluate(x_val, y_val, batch_size=1024, verbose=0,
                                        return_dict=True))
    group = model.embedding_layer
    print("tables:", len(group.tables), "ids in table_C1:", group.tables[0].table_size())

    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "dlrm.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(model.predict(x_val, verbose=0),
                                  reloaded.predict(x_val, verbose=0))
    served_path = kre.export_for_serving(model, os.path.join(folder, "served"),
                                         input_signature=input_signature())
    served = tf.saved_model.load(served_path)
    first = {"dense_input": x_val["dense_input"][:8],
             "large_emb_inputs": {k: v[:8] for k, v in x_val["large_emb_inputs"].items()}}
    np.testing.assert_allclose(served.serve(first).numpy(), model.predict(first, verbose=0),
                               rtol=1e-5, atol=1e-6)
    print("reloaded and served predictions match")


if __name__ == "__main__":
    main()
