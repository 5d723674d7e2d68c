"""The served stacked-id model of the serving tests: a GroupEmbedding of
three sum-pooled features over ids [batch, 3, 2] (-1 pads), then a Dense,
trained one epoch."""

import keras
import numpy as np

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable, FeatureSpec, GroupEmbedding

# A request every table knows (ids < 23).
QUERY = (np.arange(24).reshape(4, 3, 2) % 23).astype(np.int64)


def trained_model():
    keras.utils.set_random_seed(6)
    group = GroupEmbedding({f"f{j}": FeatureSpec(EmbeddingVariable(3, name=f"t{j}"),
                                                 combiner="sum") for j in range(3)},
                           output_mode="concat")
    ids = keras.Input((3, 2), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(group(ids)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.3), loss="mse")
    model.fit(np.random.default_rng(6).integers(-1, 23, (32, 3, 2)), np.ones((32, 1)),
              verbose=0)
    return model
