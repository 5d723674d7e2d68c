"""Options of an EmbeddingVariable, after DeepRec's `tf.EmbeddingVariableOption`.

Initialization (`InitializerOption`), admission filters (`CounterFilter`,
`CBFFilter`) and eviction (`GlobalStepEvict`, `L2WeightEvict`) are in effect.
Storage: DRAM, or a file tier (`StorageOption("FILE", storage_path, storage_size)`)
whose rows live in files with a bounded DRAM cache. The options import
without TensorFlow and apply under both Keras backends.
"""

import math
import os
import typing
import warnings

import keras
import numpy as np

from keras_rec_emb import _file_tier
from keras_rec_emb._checks_core import check_bool, check_float, check_int

__all__ = [
    "InitializerOption",
    "CounterFilter",
    "CBFFilter",
    "GlobalStepEvict",
    "L2WeightEvict",
    "StorageOption",
    "EmbeddingVariableOption",
]

_PACKAGE = "keras_rec_emb"
_INT64_MAX = 2**63 - 1


def _check_int(name, value, minimum, maximum=_INT64_MAX):
    # Bounded by int64: the C++ table stores counts and steps as int64, and a
    # larger value would be accepted here and fail (or wrap) later.
    return check_int(name, value, minimum, maximum)


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

    def __init__(self, initializer: str | dict | keras.initializers.Initializer | None = None,
                 default_value_dim: int = 4096, default_value_no_permission: float = 0.0):
        self.initializer = (None if initializer is None
                            else keras.initializers.get(initializer))
        _check_int("default_value_dim", default_value_dim, 1)
        self.default_value_dim = default_value_dim
        self.default_value_no_permission = check_float(
            "default_value_no_permission", default_value_no_permission)

    def get_config(self):
        return {
            "initializer": (None if self.initializer is None else
                            keras.saving.serialize_keras_object(self.initializer)),
            "default_value_dim": self.default_value_dim,
            "default_value_no_permission": self.default_value_no_permission,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CounterFilter(_Option):
    """Admit a key once training lookups have seen it `filter_freq` times.

    Until then the key reads `InitializerOption.default_value_no_permission`,
    its gradients are dropped and it has no embedding row or optimizer slots,
    only its count (exported as `keys_filtered` / `freqs_filtered`). The
    lookup that brings the count to `filter_freq` gives it its initializer
    row, and it trains normally from then on. See docs/semantics.md,
    'Admission filters and eviction'.

    Args:
        filter_freq: int >= 0. `0` (or `1`) admits every key.

    Example:

    >>> f = keras_rec_emb.CounterFilter(filter_freq=3)
    >>> layer = keras_rec_emb.layers.EmbeddingVariable(
    ...     8, ev_option=keras_rec_emb.EmbeddingVariableOption(filter_option=f))
    """

    def __init__(self, filter_freq: int):
        _check_int("filter_freq", filter_freq, 0)
        self.filter_freq = filter_freq

    def get_config(self):
        return {"filter_freq": self.filter_freq}


# Counter types by name: bytes per counter and the highest count (a
# threshold above it would never admit a key). DeepRec's CBFFilter takes a
# `tf.DType` (`tf.uint64` by default; its modelzoo scripts pass `tf.int64`):
# signed types count in counters of the same width.
_COUNTER_TYPES = {
    "uint8": (1, 2**8 - 1), "uint16": (2, 2**16 - 1), "uint32": (4, 2**32 - 1),
    "uint64": (8, 2**64 - 1), "int8": (1, 2**7 - 1), "int16": (2, 2**15 - 1),
    "int32": (4, 2**31 - 1), "int64": (8, 2**63 - 1),
}


def _counter_type_name(value):
    """The dtype's name ("uint64") or None; a TensorFlow `DType` is told
    apart by attributes, so that checking one imports no framework."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)) or value is None:
        return None  # np.dtype(None) is float64, np.dtype(int) int64
    if type(value).__name__ == "DType" and hasattr(value, "as_numpy_dtype"):
        name = getattr(value, "name", None)  # tf.DType (tf.uint64.name == "uint64")
        return name if isinstance(name, str) else None
    try:
        return np.dtype(value).name
    except (TypeError, ValueError):
        return None


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CBFFilter(_Option):
    """Admit a key once a counting Bloom filter has seen it `filter_freq` times.

    Keys are counted in `m` counters of `counter_type` with `k` hash
    functions, sized for `max_element_size` keys at
    `false_positive_probability` (m = ceil(-n ln p / ln(2)^2),
    k = round(m / n ln 2)); a key enters the table only when admitted, so
    memory holds the counters plus admitted keys. A false positive admits a
    key early. Counters saturate at the type's maximum.

    Args:
        filter_freq: int >= 0, at most the counter type's maximum (255 for
            `"uint8"`), which saturated counters could never exceed.
        max_element_size: int >= 1. Expected number of distinct keys.
        false_positive_probability: float in (0, 1).
        counter_type: the counters' integer type, 8 to 64 bits: `"uint8"`,
            `"uint16"`, `"uint32"`, `"uint64"` (or signed `"int8"` ...
            `"int64"`, counted in counters of that width), as a string, a
            NumPy dtype or a TensorFlow or JAX dtype (DeepRec's `tf.uint64`,
            `tf.int64`). Defaults to `"uint64"`. The filter takes
            m * bytes of address space; memory is committed as counters are
            written (a warning says when m * bytes exceeds the machine's
            memory).

    Example:

    >>> f = keras_rec_emb.CBFFilter(3, max_element_size=2**20,
    ...                             false_positive_probability=0.01)
    """

    def __init__(self, filter_freq: int, max_element_size: int,
                 false_positive_probability: float, counter_type: typing.Any = "uint64"):
        name = _counter_type_name(counter_type)
        if name not in _COUNTER_TYPES:
            raise ValueError(
                "`counter_type` must be an integer dtype of 8, 16, 32 or 64 bits, "
                f"one of {tuple(_COUNTER_TYPES)}, as a string, a NumPy dtype or a "
                f"TensorFlow or JAX dtype (e.g. tf.uint64). Received: "
                f"counter_type={counter_type!r}"
            )
        # Counters saturate at the type's maximum: a higher threshold would
        # never admit a key.
        _check_int("filter_freq", filter_freq, 0, min(_COUNTER_TYPES[name][1], _INT64_MAX))
        _check_int("max_element_size", max_element_size, 1)
        p = check_float("false_positive_probability", false_positive_probability, 0, 1,
                        min_open=True, max_open=True)
        self.filter_freq = filter_freq
        self.max_element_size = max_element_size
        self.false_positive_probability = float(p)
        self.counter_type = name
        counters, _, counter_bytes = self.sizing()
        if counters * counter_bytes >= 2**62:
            raise ValueError(
                "`max_element_size` and `false_positive_probability` size a "
                f"counting Bloom filter of {counters} counters of {counter_bytes} "
                "bytes, more than any machine holds; lower `max_element_size` or "
                f"raise `false_positive_probability`. Received: "
                f"max_element_size={max_element_size}, false_positive_probability={p}")
        total = counters * counter_bytes
        physical = _machine_memory()
        if physical and total > physical:
            # Memory is committed page by page as counters are written, but
            # each distinct key counted writes up to k pages spread over the
            # whole filter: with many keys it approaches the full size.
            warnings.warn(
                f"CBFFilter(max_element_size={max_element_size}, "
                f"false_positive_probability={p}, counter_type={name!r}) sizes a counting "
                f"Bloom filter of {total} bytes ({total / 2**30:.1f} GiB) per table, more "
                f"than this machine's physical memory ({physical} bytes, "
                f"{physical / 2**30:.1f} GiB). Its memory grows as keys are counted (up to "
                f"{self.sizing()[1]} pages of 4 KiB per distinct key) and can exhaust it, "
                "and exporting or saving the table (its `bloom` part) needs all of it; "
                "lower `max_element_size`, raise `false_positive_probability` or use a "
                "narrower `counter_type`.",
                stacklevel=2)

    def sizing(self):
        """(counters, hashes, bytes per counter) of the filter."""
        n, p = self.max_element_size, self.false_positive_probability
        m = max(1, math.ceil(-n * math.log(p) / math.log(2) ** 2))
        k = max(1, round(m / n * math.log(2)))
        return m, k, _COUNTER_TYPES[self.counter_type][0]

    def get_config(self):
        return {
            "filter_freq": self.filter_freq,
            "max_element_size": self.max_element_size,
            "false_positive_probability": self.false_positive_probability,
            "counter_type": self.counter_type,
        }


class _Evict(_Option):
    """`at_save` is in the config only when off: the default's config is the
    one older releases write and read."""

    _RULE = None

    def __init__(self, value, at_save):
        setattr(self, self._RULE, value)
        self.at_save = check_bool("at_save", at_save)

    def get_config(self):
        config = {self._RULE: getattr(self, self._RULE)}
        if not self.at_save:
            config["at_save"] = False
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GlobalStepEvict(_Evict):
    """Evict keys not updated for more than `steps_to_live` optimizer steps.

    Eviction runs when the model or a checkpoint is saved (unless
    `at_save=False`), on `EmbeddingVariable.evict()`, and from
    `keras_rec_emb.callbacks.EvictionCallback`. Evicted rows and their slots
    return to the table's free lists. Keys counted by a filter but not
    admitted are evicted when not looked up for `steps_to_live` steps. See
    docs/semantics.md, 'Admission filters and eviction'.

    Args:
        steps_to_live: int >= 0.
        at_save: bool. Evict when the model (`model.save`,
            `keras_rec_emb.save_model`) or a `tf.train.Checkpoint` is saved.
            `False` evicts only on `evict()` and `EvictionCallback`.
            Defaults to `True` (DeepRec); a config without it (an older
            file) reads as `True`.

    Example:

    >>> e = keras_rec_emb.GlobalStepEvict(steps_to_live=10000)
    >>> keras_rec_emb.GlobalStepEvict(steps_to_live=10000, at_save=False).at_save
    False
    """

    _RULE = "steps_to_live"

    def __init__(self, steps_to_live: int, at_save: bool = True):
        _check_int("steps_to_live", steps_to_live, 0)
        super().__init__(steps_to_live, at_save)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class L2WeightEvict(_Evict):
    """Evict keys whose row is small: `0.5 * sum(row**2) < l2_weight_threshold`.

    DeepRec's rule (`tf.nn.l2_loss` of the row), so DeepRec's thresholds
    carry over. Runs when `GlobalStepEvict` would. See docs/semantics.md,
    'Admission filters and eviction'.

    Args:
        l2_weight_threshold: finite float >= 0.
        at_save: bool. Evict when the model or a checkpoint is saved (see
            `GlobalStepEvict`). Defaults to `True` (DeepRec); a config
            without it (an older file) reads as `True`.

    Example:

    >>> e = keras_rec_emb.L2WeightEvict(l2_weight_threshold=1e-4)
    """

    _RULE = "l2_weight_threshold"

    def __init__(self, l2_weight_threshold: float, at_save: bool = True):
        # NaN would disable eviction and inf evict every row: both refused.
        super().__init__(check_float("l2_weight_threshold", l2_weight_threshold, 0), at_save)


_STORAGE_TYPES = ("DRAM", "FILE")
_DEFAULT_CACHE_BYTES = 64 << 20


def _machine_memory():  # bytes, or None when unknown
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


@keras.saving.register_keras_serializable(package=_PACKAGE)
class StorageOption(_Option):
    """Where an EmbeddingVariable keeps its rows.

    `"DRAM"` keeps every row in memory. `"FILE"` is a tier for tables larger
    than memory (DeepRec's DRAM+SSDHASH): rows live in segment files under
    `storage_path/<table name>/` with a DRAM cache of about `storage_size`
    bytes, giving the same results as DRAM. See docs/file_tier.md.

    Args:
        storage_type: `"DRAM"` (the default) or `"FILE"`.
        storage_path: str. Folder of the file tier (created if missing);
            required for `"FILE"`, must be `None` for `"DRAM"`.
        storage_size: int or `None`. Bytes of DRAM cache for the file tier's
            rows, split over the table's shards (each keeps at least 16
            rows); at most this machine's memory. Defaults to 64 MiB.

    Example:

    >>> s = keras_rec_emb.StorageOption("DRAM")
    >>> f = keras_rec_emb.StorageOption("FILE", storage_path="/tmp/kre_doc",
    ...                                 storage_size=1 << 20)
    >>> f.get_config()["storage_size"]
    1048576
    """

    def __init__(self, storage_type: str = "DRAM", storage_path: str | None = None,
                 storage_size: int | None = None):
        if storage_type not in _STORAGE_TYPES:
            raise ValueError(
                f"`storage_type` must be one of {_STORAGE_TYPES}. Received: "
                f"storage_type={storage_type!r}"
            )
        if storage_size is not None:
            _check_int("storage_size", storage_size, 1)
            # A larger cache cannot be held: reserving it fails at the first
            # lookup, or the OOM killer ends the process as it fills.
            memory = _machine_memory()
            if memory is not None and storage_size > memory:
                raise ValueError(
                    "`storage_size` (bytes of the file tier's DRAM cache) must be at most "
                    f"this machine's memory, {memory} bytes. Received: "
                    f"storage_size={storage_size}")
        if storage_path is not None and (not isinstance(storage_path, str) or not storage_path):
            raise TypeError(
                "`storage_path` must be a non-empty str or None. Received: "
                f"storage_path={storage_path!r}")
        if storage_type == "FILE" and storage_path is None:
            raise ValueError(
                "`storage_path` is required for storage_type='FILE' (a folder for "
                "the table's files). Received: storage_path=None")
        self.storage_type = storage_type
        self.storage_path = storage_path
        self.storage_size = storage_size

    @classmethod
    def from_config(cls, config):
        # A config is a file's (a loaded `.keras`, `model_from_json`, a
        # clone): its folder is checked against the caller's storage root.
        config = dict(config)
        path = config.get("storage_path")
        if config.get("storage_type") == "FILE" and isinstance(path, str) and path:
            config["storage_path"] = _file_tier.loaded_storage_path(path)
        return cls(**config)

    @property
    def cache_bytes(self):
        """DRAM cache bytes of the file tier."""
        return self.storage_size or _DEFAULT_CACHE_BYTES

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
        num_shards: int in [1, 65536] (any value; DeepRec's
            `ht_partition_num` counts map directly). Index shards of the hash
            table, each with its own lock. Defaults to `32`.
        track_meta: bool or `None`. Keep each key's frequency and version
            (last optimizer step that updated it; 16 bytes per key). `None`
            keeps them when a filter or eviction is configured. `False`
            with a `CounterFilter` or `GlobalStepEvict` (which need them) is
            an error. Defaults to `None`.
        save_filtered: bool. Save the keys a `CounterFilter` has counted but
            not admitted (and the Bloom counters of a `CBFFilter`), so that
            training resumes with their counts. The environment variable
            `KRE_EV_SAVE_FILTERED_FEATURES=false` also turns it off.
            Defaults to `True`.
        record_freq: bool. With a `CounterFilter` or `CBFFilter`, keep
            counting a key's training-lookup occurrences after it is
            admitted (DeepRec's `TF_RECORD_FREQ=1`); `False` (DeepRec's
            default) stops at `filter_freq`. Defaults to `False`.

    Example:

    >>> opt = keras_rec_emb.EmbeddingVariableOption(
    ...     init_option=keras_rec_emb.InitializerOption(default_value_dim=512))
    >>> layer = keras_rec_emb.layers.EmbeddingVariable(16, ev_option=opt)
    """

    def __init__(self, init_option: InitializerOption | None = None,
                 filter_option: CounterFilter | CBFFilter | None = None,
                 evict_option: GlobalStepEvict | L2WeightEvict | None = None,
                 storage_option: StorageOption | None = None, num_shards: int = 32,
                 track_meta: bool | None = None, save_filtered: bool = True,
                 record_freq: bool = False):
        _check_instance("init_option", init_option, InitializerOption)
        _check_instance("filter_option", filter_option, (CounterFilter, CBFFilter))
        _check_instance("evict_option", evict_option, (GlobalStepEvict, L2WeightEvict))
        _check_instance("storage_option", storage_option, StorageOption)
        _check_int("num_shards", num_shards, 1)
        if num_shards > 65536:
            raise ValueError(
                "`num_shards` must be an integer in [1, 65536] (one lock and one "
                f"index per shard). Received: num_shards={num_shards}"
            )
        needs_meta = (isinstance(filter_option, CounterFilter) and filter_option.filter_freq > 1
                      or isinstance(evict_option, GlobalStepEvict))
        if track_meta not in (None, True, False):
            raise TypeError(f"`track_meta` must be None, True or False. Received: "
                            f"track_meta={track_meta!r}")
        if track_meta is False and needs_meta:
            raise ValueError(
                "`track_meta=False` conflicts with the counter filter or "
                "global-step eviction, which count in the metadata. Received: "
                f"filter_option={filter_option!r}, evict_option={evict_option!r}")
        self.track_meta = track_meta
        self.save_filtered = check_bool("save_filtered", save_filtered)
        self.record_freq = check_bool("record_freq", record_freq)
        self.init_option = init_option or InitializerOption()
        self.filter_option = filter_option
        self.evict_option = evict_option
        self.storage_option = storage_option or StorageOption()
        self.num_shards = num_shards

    def tracks_meta(self):
        """Whether keys keep frequency and version (see `track_meta`)."""
        if self.track_meta is not None:
            return self.track_meta
        return self.filter_option is not None or self.evict_option is not None

    def table_kwargs(self):
        """The EmbeddingTable arguments these options give."""
        kwargs = {
            "num_shards": self.num_shards,
            "track_meta": self.tracks_meta(),
            "no_permission_value": self.init_option.default_value_no_permission,
            "save_filtered": self.save_filtered,
            "record_freq": self.record_freq,
        }
        f = self.filter_option
        if f is not None:
            kwargs["filter_freq"] = f.filter_freq
            if isinstance(f, CBFFilter):
                kwargs["bloom"] = f.sizing()
        storage = self.storage_option
        if storage.storage_type == "FILE":
            kwargs["storage_path"] = storage.storage_path
            kwargs["cache_bytes"] = storage.cache_bytes
        e = self.evict_option
        if isinstance(e, GlobalStepEvict):
            kwargs["steps_to_live"] = e.steps_to_live
        elif isinstance(e, L2WeightEvict):
            kwargs["l2_weight_threshold"] = e.l2_weight_threshold
        if e is not None:
            kwargs["evict_at_save"] = e.at_save
        return kwargs

    def get_config(self):
        ser = keras.saving.serialize_keras_object
        return {
            "init_option": ser(self.init_option),
            "filter_option": None if self.filter_option is None else ser(self.filter_option),
            "evict_option": None if self.evict_option is None else ser(self.evict_option),
            "storage_option": ser(self.storage_option),
            "num_shards": self.num_shards,
            "track_meta": self.track_meta,
            "save_filtered": self.save_filtered,
            "record_freq": self.record_freq,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key in ("init_option", "filter_option", "evict_option", "storage_option"):
            if config.get(key) is not None:
                config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)


_SAVE_FILTERED_ENV = "KRE_EV_SAVE_FILTERED_FEATURES"


def save_filtered_from_env(default=True):
    """`KRE_EV_SAVE_FILTERED_FEATURES=false` (or 0/no/off) turns off `save_filtered`."""
    value = os.environ.get(_SAVE_FILTERED_ENV)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def ev_option_or_default(ev_option):
    if ev_option is None:
        return EmbeddingVariableOption()
    if not isinstance(ev_option, EmbeddingVariableOption):
        raise TypeError(
            "`ev_option` must be a keras_rec_emb.EmbeddingVariableOption or "
            f"None. Received: ev_option={ev_option!r}"
        )
    return ev_option


def _inner(value, class_name, argument):
    if value is None:
        return None
    if isinstance(value, dict) and value.get("class_name") == class_name:
        return value.get("config") or {}
    raise ValueError(f"`{argument}` must be a serialized {class_name} or None. "
                     f"Received: {argument}={value!r}")


def _option(value, class_names, argument):
    classes = tuple(globals()[name] for name in class_names)
    if value is None or isinstance(value, classes):
        return value
    name = value.get("class_name") if isinstance(value, dict) else None
    if name not in class_names:
        raise ValueError(f"`{argument}` must be a serialized {' or '.join(class_names)} or "
                         f"None. Received: {argument}={value!r}")
    # from_config: a StorageOption's folder is checked as on creation.
    return globals()[name].from_config(_inner(value, name, argument))


def ev_option_from_config(value):
    """Read part by part, not by Keras's registry, so that a malformed part is named."""
    if value is not None and not isinstance(value, EmbeddingVariableOption):
        config = dict(_inner(value, "EmbeddingVariableOption", "ev_option"))
        fields = {"init_option": ("InitializerOption",),
                  "filter_option": ("CounterFilter", "CBFFilter"),
                  "evict_option": ("GlobalStepEvict", "L2WeightEvict"),
                  "storage_option": ("StorageOption",)}
        for field, class_names in fields.items():
            config[field] = _option(config.get(field), class_names, f"ev_option.{field}")
        value = EmbeddingVariableOption(**config)
    return value


def deserialize_ev_option(config):
    config = dict(config)
    if isinstance(config.get("ev_option"), dict):
        config["ev_option"] = keras.saving.deserialize_keras_object(config["ev_option"])
    return config
