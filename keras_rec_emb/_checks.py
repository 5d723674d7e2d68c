"""Argument and input checks shared by the layers and ops (private)."""

import tensorflow as tf

COMBINERS = ("sum", "mean", "sqrtn")


def integer_ids(ids, what, dtype=tf.int64):
    """`ids` cast to `dtype`, or a TypeError naming `what` if not integers."""
    if not ids.dtype.is_integer:
        raise TypeError(
            f"{what} expects integer ids (int32 or int64). Received ids of dtype "
            f"{ids.dtype.name}. Hash strings or floats to integers first, e.g. "
            "with keras.layers.Hashing or tf.strings.to_hash_bucket_fast."
        )
    return tf.cast(ids, dtype) if ids.dtype != dtype else ids


def check_combiner(combiner, allow_none=True):
    if (combiner is None and allow_none) or combiner in COMBINERS:
        return
    allowed = f"None or one of {COMBINERS}" if allow_none else f"one of {COMBINERS}"
    raise ValueError(f"`combiner` must be {allowed}. Received: combiner={combiner!r}")


def ev_option_or_default(ev_option):
    """`ev_option`, or the default EmbeddingVariableOption when None."""
    from keras_rec_emb import options

    if ev_option is None:
        return options.EmbeddingVariableOption()
    if not isinstance(ev_option, options.EmbeddingVariableOption):
        raise TypeError(
            "`ev_option` must be a keras_rec_emb.EmbeddingVariableOption or "
            f"None. Received: ev_option={ev_option!r}"
        )
    return ev_option


def deserialize_ev_option(config):
    """A layer config with its serialized `ev_option` turned back into an
    EmbeddingVariableOption (for `from_config`)."""
    import keras

    config = dict(config)
    if isinstance(config.get("ev_option"), dict):
        config["ev_option"] = keras.saving.deserialize_keras_object(config["ev_option"])
    return config
