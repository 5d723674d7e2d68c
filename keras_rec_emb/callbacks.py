"""Keras callbacks for embedding tables.

Each works under Keras's TensorFlow and JAX backends alike (a
`CheckpointCallback`'s chain written under one restores under the other).
"""

import os
import time

import keras

from keras_rec_emb import _checks_core as _checks

__all__ = ["EvictionCallback", "CheckpointCallback", "TableStats"]
_JAX = keras.config.backend() == "jax"


def __dir__():
    return list(__all__)  # the public names only (not `os`, `time`, `keras`)


def _table_layers(model):
    """The EmbeddingVariable layers of `model`, nested ones included, each once."""
    if _JAX:
        from keras_rec_emb.backend.jax.optimizers import tables_of

        found = tables_of(model.variables)  # each layer by its table's anchor
    else:
        from keras_rec_emb.backend.tensorflow import compat as _compat
        from keras_rec_emb.layers.embedding_variable import EmbeddingVariable

        found = [layer for layer in _compat.flatten_layers(model)
                 if isinstance(layer, EmbeddingVariable) and layer.table is not None]
    return list({id(layer): layer for layer in found}.values())


def _table_counters(model):
    """(name, `counters()`) of every table of `model`, in variable order."""
    from keras_rec_emb.incremental import _tables

    return [(path, table.counters()) for path, table in _tables(model)]


class _Callback(keras.callbacks.Callback):
    """What the callbacks share: a config of their arguments, the step."""

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def _step(self):
        # `iterations` is a mirrored variable under a tf.distribute strategy.
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class EvictionCallback(_Callback):
    """Runs the tables' configured eviction during `model.fit`.

    Every `EmbeddingVariable` of the model with a `GlobalStepEvict` or
    `L2WeightEvict` option evicts every `every_n_steps` training steps and/or
    at the end of each epoch, with the optimizer's step as "now". (Eviction
    also runs whenever the model or a checkpoint is saved.)

    Args:
        every_n_steps: int > 0 or `None`. Defaults to `None`.
        on_epoch_end: bool. Defaults to `True`.

    Example:

    >>> ids = keras.Input((2,), dtype="int64")
    >>> ev = keras_rec_emb.layers.EmbeddingVariable(
    ...     4, combiner="sum", ev_option=keras_rec_emb.EmbeddingVariableOption(
    ...         evict_option=keras_rec_emb.GlobalStepEvict(steps_to_live=2)))
    >>> model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> callback = keras_rec_emb.callbacks.EvictionCallback(every_n_steps=1)
    >>> x = np.arange(16).reshape(8, 2)  # each batch brings new ids
    >>> history = model.fit(x, np.ones((8, 1)), batch_size=2, verbose=0,
    ...                     callbacks=[callback])
    >>> ev.table_size() < 16
    True
    """

    def __init__(self, every_n_steps=None, on_epoch_end=True):
        super().__init__()
        self.every_n_steps = _check_interval("every_n_steps", every_n_steps)
        self.evict_on_epoch_end = _checks.check_bool("on_epoch_end", on_epoch_end)
        self.evicted = 0  # total ids evicted so far

    def _evict(self):
        step = self._step() - 1  # the last step applied
        for layer in _table_layers(self.model):
            if _JAX:
                # A JAX table's versions are its layer's step counter.
                last = int(keras.ops.convert_to_numpy(layer.iterations.value)) - 1
                self.evicted += layer.evict(last if last >= 0 else None)
            else:
                self.evicted += layer.evict(step)

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps and self._step() % self.every_n_steps == 0:
            self._evict()

    def on_epoch_end(self, epoch, logs=None):
        if self.evict_on_epoch_end:
            self._evict()

    def get_config(self):
        return {"every_n_steps": self.every_n_steps, "on_epoch_end": self.evict_on_epoch_end}


def _check_interval(name, value, kind=int):
    if value is None:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
          and value > 0)
    if not ok:
        raise ValueError(f"`{name}` must be a positive {'number' if kind is float else 'integer'}"
                         f" or None. Received: {name}={value!r}")
    return value


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class CheckpointCallback(_Callback):
    """Full and incremental checkpoints during `model.fit` (online training).

    Every `full_every_steps` steps or `full_every_secs` seconds a full
    checkpoint, in between every `incremental_every_steps` steps or
    `incremental_every_secs` seconds an incremental one (the first save is
    full), by `self.checkpointer`, an `IncrementalCheckpointer`.
    `restore(model)` resumes from the directory.

    Args:
        directory: str. The checkpoint folder.
        full_every_steps: int > 0 or `None`. Defaults to `None`.
        full_every_secs: number > 0 or `None`. Defaults to `None`.
        incremental_every_steps: int > 0 or `None`. Defaults to `None`.
        incremental_every_secs: number > 0 or `None`. Defaults to `None`.
        keep: int >= 1. Full checkpoints kept, each with its chain.
            Defaults to `2`.
        save_on_train_end: bool. An incremental save when `fit` ends.
            Defaults to `True`.
        kafka_position: a `KafkaPosition`, a Kafka dataset or `None`, saved
            and restored with every link. Defaults to `None`.

    Example:

    >>> ids = keras.Input((2,), dtype="int64")
    >>> ev = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")
    >>> model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> import os, tempfile
    >>> directory = tempfile.mkdtemp()
    >>> cb = keras_rec_emb.callbacks.CheckpointCallback(
    ...     directory, full_every_steps=4, incremental_every_steps=1, keep=1)
    >>> _ = model.fit(np.arange(16).reshape(8, 2), np.ones((8, 1)), batch_size=2,
    ...               verbose=0, callbacks=[cb])
    >>> [os.path.basename(p).split("-")[-1] for p in cb.saves]
    ['full.npz', 'incremental.npz', 'incremental.npz', 'incremental.npz', 'incremental.npz']
    """

    def __init__(self, directory, full_every_steps=None, full_every_secs=None,
                 incremental_every_steps=None, incremental_every_secs=None, keep=2,
                 save_on_train_end=True, kafka_position=None):
        super().__init__()
        from keras_rec_emb.incremental import checked_arguments

        # A bad Kafka position fails here, not at the first save in `fit`.
        self.directory, self.keep, _ = checked_arguments(directory, keep, kafka_position)
        self.full_every_steps = _check_interval("full_every_steps", full_every_steps)
        self.full_every_secs = _check_interval("full_every_secs", full_every_secs, float)
        self.incremental_every_steps = _check_interval(
            "incremental_every_steps", incremental_every_steps)
        self.incremental_every_secs = _check_interval(
            "incremental_every_secs", incremental_every_secs, float)
        self.save_on_train_end = _checks.check_bool("save_on_train_end", save_on_train_end)
        self.kafka_position = kafka_position
        self.checkpointer = None
        self.saves = []  # paths written, in order
        self._last_full = self._last_any = None  # (step, time)

    def _checkpointer(self, model):
        if self.checkpointer is None or self.checkpointer.model is not model:
            from keras_rec_emb.incremental import IncrementalCheckpointer

            self.checkpointer = IncrementalCheckpointer(
                model, self.directory, keep=self.keep, kafka_position=self.kafka_position)
        return self.checkpointer

    def restore(self, model):
        """`IncrementalCheckpointer.restore`; later saves continue its chain."""

        return self._checkpointer(model).restore()

    @staticmethod
    def _due(last, every_steps, every_secs, step, now):
        if last is None:
            return False
        return bool((every_steps and step - last[0] >= every_steps)
                    or (every_secs and now - last[1] >= every_secs))

    def on_train_begin(self, logs=None):
        now = (self._step(), time.monotonic())
        self._last_full = self._last_full or now
        self._last_any = self._last_any or now

    def on_train_batch_end(self, batch, logs=None):
        step, now = self._step(), time.monotonic()
        ckpt = self._checkpointer(self.model)
        if ckpt._marks is None or self._due(
                self._last_full, self.full_every_steps, self.full_every_secs, step, now):
            if (self.full_every_steps or self.full_every_secs or self.incremental_every_steps
                    or self.incremental_every_secs):
                self.saves.append(ckpt.save_full())
                self._last_full = self._last_any = (step, now)
        elif self._due(self._last_any, self.incremental_every_steps,
                       self.incremental_every_secs, step, now):
            self.saves.append(ckpt.save_incremental())
            self._last_any = (step, now)

    def on_train_end(self, logs=None):
        # (Also when no step ran since the last save: callbacks after this one,
        # e.g. eviction, may have changed the tables since.)
        if self.save_on_train_end and self._last_any is not None:
            self.saves.append(self._checkpointer(self.model).save_incremental())
            self._last_any = (self._step(), time.monotonic())

    def get_config(self):
        return {"directory": self.directory, "full_every_steps": self.full_every_steps,
                "full_every_secs": self.full_every_secs,
                "incremental_every_steps": self.incremental_every_steps,
                "incremental_every_secs": self.incremental_every_secs, "keep": self.keep,
                "save_on_train_end": self.save_on_train_end}


@keras.saving.register_keras_serializable(package="keras_rec_emb")
class TableStats(_Callback):
    """Logs statistics of every embedding table while training.

    Every `every_n_steps` steps and at each epoch's end it adds, per table
    (named by its variable path with `/` as `_`, less `_embeddings`: an
    `EmbeddingVariable` named `ids` gives `ids`), to Keras's `logs` (so the
    progress bar, `History` and `CSVLogger` show them) and, with `log_dir`,
    as TensorBoard scalars (tags `tables/<name>`, step = the optimizer's
    iteration; written without TensorFlow, by `keras_rec_emb._event_file`,
    the same files under either backend):

    * `<table>_size`: admitted keys; `<table>_filtered`: keys counted but not
      admitted by an admission filter;
    * `<table>_new`, `<table>_evicted`: keys admitted / erased since the
      previous report (the first one counts from the start of `fit`);
    * `<table>_bytes`: memory held by the table;
    * `<table>_hit_rate`: share of the key occurrences looked up since the
      previous report that found an admitted row (1.0 when none).

    Args:
        every_n_steps: int > 0 or `None` (epoch ends only). Defaults to `1`.
        log_dir: str or `None`. A TensorBoard log folder. Defaults to `None`.
        in_logs: bool. Whether to add the numbers to `logs`. Defaults to
            `True`.

    Example:

    >>> ids = keras.Input((2,), dtype="int64")
    >>> ev = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum", name="ids")
    >>> model = keras.Model(ids, keras.layers.Dense(1)(ev(ids)))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.Adagrad(0.1), loss="mse")
    >>> h = model.fit(np.array([[1, 2], [1, 3]]), np.ones((2, 1)), epochs=2, verbose=0,
    ...               callbacks=[keras_rec_emb.callbacks.TableStats()])
    >>> [h.history[k] for k in ("ids_size", "ids_new", "ids_hit_rate")]
    [[3, 3], [3, 0], [0.25, 1.0]]

    (Epoch 1 looks up 1, 2, 1, 3 in an empty table: only the second 1 finds
    a row.)
    """

    def __init__(self, every_n_steps=1, log_dir=None, in_logs=True):
        super().__init__()
        self.every_n_steps = _check_interval("every_n_steps", every_n_steps)
        if log_dir is not None and (not isinstance(log_dir, (str, os.PathLike))
                                    or not os.fspath(log_dir)):
            raise TypeError(f"`log_dir` must be a path or None. Received: log_dir={log_dir!r}")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.in_logs = _checks.check_bool("in_logs", in_logs)
        self.latest = {}   # the last numbers reported
        self._previous = {}
        self._writer = None

    def stats(self, model=None):
        """The numbers now, as {name: value}, advancing the interval."""
        out = {}
        for path, c in _table_counters(model or self.model):
            name = path.replace("/", "_")
            if name.endswith("_embeddings"):
                name = name[:-len("_embeddings")]
            prev = self._previous.get(name, {"lookups": 0, "hits": 0, "admitted_total": 0,
                                             "erased_total": 0})
            lookups = c["lookups"] - prev["lookups"]
            out[f"{name}_size"] = c["size"]
            out[f"{name}_filtered"] = c["filtered"]
            out[f"{name}_new"] = c["admitted_total"] - prev["admitted_total"]
            out[f"{name}_evicted"] = c["erased_total"] - prev["erased_total"]
            out[f"{name}_bytes"] = c["memory_bytes"]
            out[f"{name}_hit_rate"] = ((c["hits"] - prev["hits"]) / lookups if lookups
                                       else 1.0)
            self._previous[name] = c
        self.latest = out
        return out

    def _report(self, logs):
        values = self.stats()
        if self.in_logs and logs is not None:
            logs.update(values)
        if self.log_dir is not None:
            if self._writer is None:
                from keras_rec_emb._event_file import EventFileWriter

                self._writer = EventFileWriter(self.log_dir)
            self._writer.scalars(self._step(), {f"tables/{k}": v for k, v in values.items()})
            self._writer.flush()

    def on_train_begin(self, logs=None):
        # The first interval starts here: what happened to the tables before
        # `fit` (a restore replaying a checkpoint chain, earlier fits with
        # another callback) is not counted as new or evicted.
        if not self._previous:
            self.stats()
            self.latest = {}

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps and (batch + 1) % self.every_n_steps == 0:
            self._report(logs)

    def on_epoch_end(self, epoch, logs=None):
        # The epoch's last step report stands for its end, unless reports come
        # at epoch ends only (`every_n_steps=None`).
        if logs is not None and self.in_logs and self.latest and self.every_n_steps is not None:
            logs.update(self.latest)
        else:
            self._report(logs)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def get_config(self):
        return {"every_n_steps": self.every_n_steps, "log_dir": self.log_dir,
                "in_logs": self.in_logs}

