"""`keras_rec_emb.callbacks` (keras_rec_emb/callbacks.py)."""

import keras
import numpy as np
import pytest

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable
from tests._callbacks import EachStep

DIM = 4


def ev(name="ev", evict_option=None, **kwargs):
    return EmbeddingVariable(DIM, name=name, ev_option=kre.EmbeddingVariableOption(
        init_option=kre.InitializerOption(default_value_no_permission=-0.5),
        evict_option=evict_option, **kwargs))


def test_eviction_callback_keeps_memory_flat_on_a_stream_of_new_ids():
    # One shard: its live count is exactly the last steps' ids, so memory is
    # exactly flat. (With many shards it is bounded by each shard's largest
    # count so far, which can creep up slightly on small tables.)
    layer = ev(evict_option=kre.GlobalStepEvict(steps_to_live=3), num_shards=1)
    kept = ev(name="kept", num_shards=1)  # the same stream, never evicted
    ids = keras.Input((4,), dtype="int64")
    h = keras.layers.Concatenate()([keras.layers.Flatten()(layer(ids)),
                                    keras.layers.Flatten()(kept(ids))])
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    model.compile(optimizer=kre.optimizers.Adam(0.01), loss="mse")
    callback = kre.callbacks.EvictionCallback(every_n_steps=1, on_epoch_end=False)
    memory = []
    for epoch in range(20):
        x = (np.arange(40 * 4) + epoch * 160).reshape(40, 4)  # only new ids
        model.fit(x, np.ones((40, 1)), batch_size=8, verbose=0, callbacks=[callback])
        memory.append(layer.table.memory_bytes())
        assert layer.table_size() <= 4 * 8 * 4  # at most 4 steps of 32 ids live
    # Rows and slots come back from the free lists, so the arenas stop
    # growing after the first epochs; the index settles once it has doubled
    # to where a step's peak of live keys (its new ids before eviction) is
    # at most half its load limit. From then on new ids add nothing.
    assert len(set(memory[4:])) <= 2
    assert memory[-1] == memory[-8]  # the last 8 epochs: 1280 new ids, no growth
    assert kept.table_size() == 20 * 160
    initializer_bytes = 4096 * DIM * 4  # the EV-initializer matrix both hold
    assert 4 * (memory[-1] - initializer_bytes) < kept.table.memory_bytes() - initializer_bytes
    assert callback.evicted >= 20 * 160 - 4 * 32


def test_eviction_callback_arguments():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        kre.callbacks.EvictionCallback(every_n_steps=0)
    with pytest.raises(TypeError, match="on_epoch_end='yes'"):
        kre.callbacks.EvictionCallback(on_epoch_end="yes")
    cb = kre.callbacks.EvictionCallback(5, False)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(cb))
    assert clone.get_config() == {"every_n_steps": 5, "on_epoch_end": False}




def _one_epoch_of_new_ids(callback, nested):
    """Trains one epoch of 5 steps, 4 new ids per step, in a table with
    GlobalStepEvict(steps_to_live=2) (inside a GroupEmbedding when `nested`);
    returns the table's sizes after each step and after the fit."""
    layer = ev(evict_option=kre.GlobalStepEvict(steps_to_live=2))
    ids = keras.Input((2,), dtype="int64")
    if nested:
        group = kre.layers.GroupEmbedding({"f": kre.layers.FeatureSpec(layer)},
                                          output_mode="concat")
        embedded = group({"f": ids})
    else:
        embedded = keras.layers.Flatten()(layer(ids))
    model = keras.Model(ids, keras.layers.Dense(1)(embedded))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    sizes = EachStep(layer.table_size)
    x = np.arange(20).reshape(10, 2)  # 2 rows of 2 new ids per step
    model.fit(x, np.ones((10, 1)), batch_size=2, shuffle=False, verbose=0,
              callbacks=[callback, sizes])
    return sizes.values, layer.table_size()


@pytest.mark.parametrize("nested", [False, True])
def test_on_epoch_end_evicts_once_at_the_end_of_the_epoch(nested):
    callback = kre.callbacks.EvictionCallback()  # every_n_steps=None, on_epoch_end=True
    sizes, final = _one_epoch_of_new_ids(callback, nested)
    assert sizes == [4, 8, 12, 16, 20]  # nothing evicted during the epoch
    # At the end of step 4, ids last updated at steps 2, 3 and 4 live on.
    assert final == 12 and callback.evicted == 8


def test_every_n_steps_evicts_during_the_epoch():
    callback = kre.callbacks.EvictionCallback(every_n_steps=2, on_epoch_end=False)
    sizes, final = _one_epoch_of_new_ids(callback, nested=False)
    # Steps 0..4 end with optimizer.iterations 1..5: eviction runs after
    # steps 1 and 3 (iterations 2 and 4). After step 1 no id is older than 2
    # steps; after step 3 the ids of step 0 go.
    assert sizes == [4, 8, 12, 12, 16]
    assert final == 16 and callback.evicted == 4


def test_no_eviction_when_neither_is_asked():
    callback = kre.callbacks.EvictionCallback(on_epoch_end=False)
    sizes, final = _one_epoch_of_new_ids(callback, nested=False)
    assert sizes == [4, 8, 12, 16, 20] and final == 20 and callback.evicted == 0


def test_checkpoint_callback_refuses_a_bad_kafka_position_when_given(tmp_path):
    """Not at the first save inside `fit`: where the argument is given."""
    from keras_rec_emb.data import KafkaPosition

    for bad in (3, "clicks:0:0", {("clicks", 0): 5}):
        with pytest.raises(TypeError, match=r"`kafka_position` must be .*kafka_position="):
            kre.callbacks.CheckpointCallback(str(tmp_path), full_every_steps=1,
                                             kafka_position=bad)
    position = KafkaPosition({("clicks", 0): 5})
    cb = kre.callbacks.CheckpointCallback(str(tmp_path), kafka_position=position)
    assert cb.kafka_position is position


@pytest.mark.parametrize("offsets", [
    {"clicks": 5}, {("clicks", -1): 5}, {("clicks", 0): -2}, {("bad topic", 0): 1},
    {("clicks", 0): 1.5}, {("clicks", True): 1}])
def test_kafka_position_refuses_bad_offsets(offsets):
    from keras_rec_emb.data import KafkaPosition

    with pytest.raises(ValueError, match=r"`offsets` must be .*Received the entry"):
        KafkaPosition(offsets)
    with pytest.raises(TypeError, match="offsets="):
        KafkaPosition([("clicks", 0, 1)])
    assert KafkaPosition({("clicks", np.int64(2)): np.int64(7)}).offsets() == {("clicks", 2): 7}
