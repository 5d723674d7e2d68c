"""Options of an EmbeddingVariable, after DeepRec's `tf.EmbeddingVariableOption`.

`InitializerOption` is in effect today. Admission filters (`CounterFilter`,
`CBFFilter`), eviction (`GlobalStepEvict`, `L2WeightEvict`) and storage tiers
other than DRAM (`StorageOption`) are validated and serializable, but a layer
given one raises `NotImplementedError` until the feature lands (issue 4,
"Feature admission filters, feature eviction"; storage tiers later).
"""

import keras

_PACKAGE = "keras_rec_emb"


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
        )


class _Option:
    """Config plumbing shared by the option classes."""

    def get_config(self):
        raise NotImplementedError

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class InitializerOption(_Option):
    """How new rows of an EmbeddingVariable are initialized (EV Initializer).

    A `[default_value_dim, dim]` matrix is drawn once from `initializer` when
    the layer is built; a new key `k` starts as a copy of row
    `k mod default_value_dim` (non-negative remainder). Rows are thus drawn
    from the initializer's distribution, deterministic under a seed, and
    cost no lock.

    Args:
        initializer: Keras initializer (name, instance or config), or `None`
            to use the layer's `initializer`. Defaults to `None`.
        default_value_dim: int >= 1. Number of distinct initial rows.
            Defaults to `4096`.
        default_value_no_permission: float. Value read by keys that an
            admission filter has not admitted yet. Defaults to `0.0`.

    Example:

    >>> opt = keras_rec_emb.InitializerOption(
    ...     initializer=keras.initializers.RandomNormal(stddev=0.01, seed=1),
    ...     default_value_dim=1024)
    >>> layer = keras_rec_emb.layers.EmbeddingVariable(
    ...     8, ev_option=keras_rec_emb.EmbeddingVariableOption(init_option=opt))
    """

    def __init__(self, initializer=None, default_value_dim=4096,
                 default_value_no_permission=0.0):
        self.initializer = (None if initializer is None
                            else keras.initializers.get(initializer))
        _check_int("default_value_dim", default_value_dim, 1)
        self.default_value_dim = default_value_dim
        if isinstance(default_value_no_permission, bool) or not isinstance(
                default_value_no_permission, (int, float)):
            raise TypeError(
                "`default_value_no_permission` must be a float. Received: "
                f"default_value_no_permission={default_value_no_permission!r}"
            )
        self.default_value_no_permission = float(default_value_no_permission)

    def get_config(self):
        return {
            "initializer": (None if self.initializer is None else
                            keras.saving.serialize_keras_object(self.initializer)),
            "default_value_dim": self.default_value_dim,
            "default_value_no_permission": self.default_value_no_permission,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CounterFilter(_Option):
    """Admit a key once it has been seen `filter_freq` times (issue 4).

    Args:
        filter_freq: int >= 0. `0` disables the filter.

    Example:

    >>> f = keras_rec_emb.CounterFilter(filter_freq=3)
    """

    feature = "the counter admission filter"

    def __init__(self, filter_freq):
        _check_int("filter_freq", filter_freq, 0)
        self.filter_freq = filter_freq

    def get_config(self):
        return {"filter_freq": self.filter_freq}


_COUNTER_TYPES = ("uint8", "uint16", "uint32", "uint64")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CBFFilter(_Option):
    """Admit a key once a counting Bloom filter has seen it `filter_freq`
    times (issue 4).

    Args:
        filter_freq: int >= 0.
        max_element_size: int >= 1. Expected number of distinct keys.
        false_positive_probability: float in (0, 1).
        counter_type: one of `"uint8"`, `"uint16"`, `"uint32"`, `"uint64"`.
            Defaults to `"uint64"`.

    Example:

    >>> f = keras_rec_emb.CBFFilter(3, max_element_size=2**20,
    ...                             false_positive_probability=0.01)
    """

    feature = "the counting Bloom admission filter"

    def __init__(self, filter_freq, max_element_size, false_positive_probability,
                 counter_type="uint64"):
        _check_int("filter_freq", filter_freq, 0)
        _check_int("max_element_size", max_element_size, 1)
        p = false_positive_probability
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
            raise ValueError(
                "`false_positive_probability` must be a float in (0, 1). "
                f"Received: false_positive_probability={p!r}"
            )
        if counter_type not in _COUNTER_TYPES:
            raise ValueError(
                f"`counter_type` must be one of {_COUNTER_TYPES}. Received: "
                f"counter_type={counter_type!r}"
            )
        self.filter_freq = filter_freq
        self.max_element_size = max_element_size
        self.false_positive_probability = float(p)
        self.counter_type = counter_type

    def get_config(self):
        return {
            "filter_freq": self.filter_freq,
            "max_element_size": self.max_element_size,
            "false_positive_probability": self.false_positive_probability,
            "counter_type": self.counter_type,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GlobalStepEvict(_Option):
    """Evict keys not updated for more than `steps_to_live` steps (issue 4).

    Args:
        steps_to_live: int >= 0.

    Example:

    >>> e = keras_rec_emb.GlobalStepEvict(steps_to_live=10000)
    """

    feature = "global-step eviction"

    def __init__(self, steps_to_live):
        _check_int("steps_to_live", steps_to_live, 0)
        self.steps_to_live = steps_to_live

    def get_config(self):
        return {"steps_to_live": self.steps_to_live}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class L2WeightEvict(_Option):
    """Evict keys whose row L2 norm is below a threshold (issue 4).

    Args:
        l2_weight_threshold: float >= 0.

    Example:

    >>> e = keras_rec_emb.L2WeightEvict(l2_weight_threshold=1e-4)
    """

    feature = "L2-weight eviction"

    def __init__(self, l2_weight_threshold):
        t = l2_weight_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
            raise ValueError(
                "`l2_weight_threshold` must be a float >= 0. Received: "
                f"l2_weight_threshold={t!r}"
            )
        self.l2_weight_threshold = float(t)

    def get_config(self):
        return {"l2_weight_threshold": self.l2_weight_threshold}


_STORAGE_TYPES = ("DRAM", "FILE")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class StorageOption(_Option):
    """Where an EmbeddingVariable keeps its rows.

    Args:
        storage_type: `"DRAM"` (in memory, the default and the only tier
            implemented today) or `"FILE"` (memory-mapped file tier, not yet
            implemented).
        storage_path: str or `None`. Directory of the file tier.
        storage_size: int or `None`. Bytes of the in-memory cache of the file
            tier.

    Example:

    >>> s = keras_rec_emb.StorageOption("DRAM")
    """

    feature = "file-backed storage tiers"

    def __init__(self, storage_type="DRAM", storage_path=None, storage_size=None):
        if storage_type not in _STORAGE_TYPES:
            raise ValueError(
                f"`storage_type` must be one of {_STORAGE_TYPES}. Received: "
                f"storage_type={storage_type!r}"
            )
        if storage_size is not None:
            _check_int("storage_size", storage_size, 1)
        self.storage_type = storage_type
        self.storage_path = storage_path
        self.storage_size = storage_size

    def get_config(self):
        return {
            "storage_type": self.storage_type,
            "storage_path": self.storage_path,
            "storage_size": self.storage_size,
        }


def _check_instance(name, value, cls):
    if value is not None and not isinstance(value, cls):
        allowed = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(
            f"`{name}` must be a {allowed} or None. Received: {name}={value!r}"
        )


@keras.saving.register_keras_serializable(package=_PACKAGE)
class EmbeddingVariableOption(_Option):
    """All options of an EmbeddingVariable (DeepRec's EmbeddingVariableOption).

    Args:
        init_option: `InitializerOption` or `None` (defaults).
        filter_option: `CounterFilter`, `CBFFilter` or `None`.
        evict_option: `GlobalStepEvict`, `L2WeightEvict` or `None`.
        storage_option: `StorageOption` or `None` (DRAM).
        num_shards: int, a power of two in [1, 65536]. Index shards of the
            hash table, each with its own lock. Defaults to `32`.

    Example:

    >>> opt = keras_rec_emb.EmbeddingVariableOption(
    ...     init_option=keras_rec_emb.InitializerOption(default_value_dim=512))
    >>> layer = keras_rec_emb.layers.EmbeddingVariable(16, ev_option=opt)
    """

    def __init__(self, init_option=None, filter_option=None, evict_option=None,
                 storage_option=None, num_shards=32):
        _check_instance("init_option", init_option, InitializerOption)
        _check_instance("filter_option", filter_option, (CounterFilter, CBFFilter))
        _check_instance("evict_option", evict_option, (GlobalStepEvict, L2WeightEvict))
        _check_instance("storage_option", storage_option, StorageOption)
        _check_int("num_shards", num_shards, 1)
        if num_shards & (num_shards - 1) or num_shards > 65536:
            raise ValueError(
                "`num_shards` must be a power of two in [1, 65536]. Received: "
                f"num_shards={num_shards}"
            )
        self.init_option = init_option or InitializerOption()
        self.filter_option = filter_option
        self.evict_option = evict_option
        self.storage_option = storage_option or StorageOption()
        self.num_shards = num_shards

    def unimplemented_feature(self):
        """The name of a requested feature that is not implemented, or None."""
        for option in (self.filter_option, self.evict_option):
            if option is not None:
                return option.feature
        if self.storage_option.storage_type != "DRAM":
            return self.storage_option.feature
        return None

    def get_config(self):
        ser = keras.saving.serialize_keras_object
        return {
            "init_option": ser(self.init_option),
            "filter_option": None if self.filter_option is None else ser(self.filter_option),
            "evict_option": None if self.evict_option is None else ser(self.evict_option),
            "storage_option": ser(self.storage_option),
            "num_shards": self.num_shards,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key in ("init_option", "filter_option", "evict_option", "storage_option"):
            if config.get(key) is not None:
                config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)
