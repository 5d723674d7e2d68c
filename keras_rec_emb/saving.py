"""Saving that never destroys the previous file, and says what eviction at
save took."""

import contextlib
import contextvars
import gc
import logging
import os
import tempfile
import traceback
import warnings
import zipfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: see load_model
    import keras

__all__ = ["save_model", "load_model", "storage_root"]

# Temporary files are named .tmp-kre-<target name>-<pid>-<random>.keras.
_TMP_PREFIX = ".tmp-kre-"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _remove_stale_temporaries(directory, prefix):
    """Removes temporaries of saves whose process is gone (`kill -9` runs no
    cleanup); a live process's may be saving right now."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".keras")):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass  # removed by another save meanwhile


def current_umask():
    """The process's umask, read without changing it where Linux allows."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe)
    os.umask(mask)
    return mask


def default_mode(directory=False):
    """The mode `open`/`os.mkdir` gives (temporaries are created 0600/0700)."""
    return (0o777 if directory else 0o666) & ~current_umask()


def save_model(model: "keras.Model", filepath: str | os.PathLike, evict: bool = True,
               **kwargs) -> None:
    """`model.save(filepath)`, atomically: the previous file survives a failure.

    Keras's `model.save` truncates `filepath` before it serializes; this
    writes a temporary beside it and renames it over `filepath` once the save
    succeeded. Saving evicts, as `model.save` does. See docs/semantics.md,
    'Saving, checkpoints and inspection' and 'Admission filters and eviction'.

    Args:
        model: a `keras.Model`.
        filepath: str or path-like ending in `.keras`.
        evict: bool. `False` saves every table as it is, evicting nothing
            (in memory or in the file), whatever its eviction option.
            Defaults to `True`.
        **kwargs: passed to `model.save`.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> keras_rec_emb.save_model(model, "/tmp/kre_doc_model.keras")
    """
    filepath = os.fspath(filepath)
    if not isinstance(evict, bool):
        raise TypeError(f"`evict` must be True or False. Received: evict={evict!r}")
    if not filepath.endswith(".keras"):
        raise ValueError(
            f"`filepath` must end in `.keras`. Received: filepath={filepath!r}"
        )
    directory = os.path.dirname(os.path.abspath(filepath))
    prefix = f"{_TMP_PREFIX}{os.path.basename(filepath)}-"
    _remove_stale_temporaries(directory, prefix)

    def write(tmp):
        with _eviction_at_save(evict):
            model.save(tmp, **kwargs)

    write_atomically(filepath, write, f"{prefix}{os.getpid()}-")


def write_atomically(filepath, write, prefix):
    """`write(tmp)` on a temporary beside `filepath`, renamed over it with the
    mode `open` gives; on failure `filepath` is as it was. Returns `write`'s result."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=os.path.splitext(filepath)[1],
                               dir=os.path.dirname(os.path.abspath(filepath)))
    os.close(fd)
    try:
        result = write(tmp)
        os.chmod(tmp, default_mode())
        os.replace(tmp, filepath)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return result


# -- eviction at save ------------------------------------------------------------
# DeepRec evicts when a model or checkpoint is saved (in memory and in the
# file); `save_model(..., evict=False)` turns it off for one save, an
# option's `at_save=False` for one table always.

_LOGGER = logging.getLogger("keras_rec_emb")
_EVICT_AT_SAVE = contextvars.ContextVar("keras_rec_emb_evict_at_save", default=True)


def evicts_at_save():  # False inside `save_model(..., evict=False)`
    return _EVICT_AT_SAVE.get()


@contextlib.contextmanager
def _eviction_at_save(enabled):
    token = _EVICT_AT_SAVE.set(bool(enabled))
    try:
        yield
    finally:
        _EVICT_AT_SAVE.reset(token)


def report_save_eviction(table, rule, before, after, evicted=None):
    """Logs what a save's eviction took (`evicted`: rows plus filtered keys;
    None: the rows); warns past half of the rows."""
    rows = before - after
    others = 0 if evicted is None else max(0, evicted - rows)
    extra = f" and {others} ids counted but not admitted" if others else ""
    _LOGGER.info("Eviction at save (%r) on table '%s': evicted %d of %d rows%s, kept %d.",
                 rule, table, rows, before, extra, after)
    if 2 * rows > before:
        warnings.warn(
            f"Saving evicted {rows} of the {before} rows of table '{table}' ({after} "
            f"kept){extra}: more than half, in memory and in the file, by its eviction "
            f"option {rule!r} (DeepRec evicts when a model is saved). To save without "
            "evicting, call keras_rec_emb.save_model(model, path, evict=False), or give "
            f"the table {type(rule).__name__}(..., at_save=False) "
            "(and evict with layer.evict() or keras_rec_emb.callbacks.EvictionCallback).",
            UserWarning, stacklevel=2)


_KERAS_MEMBERS = ("config.json", "model.weights.h5")


def check_keras_file(filepath):
    """Raises an error naming the fix unless `filepath` is a readable `.keras`
    archive, every member CRC-checked (Keras says "File not found")."""
    filepath = os.fspath(filepath)
    if not os.path.isfile(filepath):
        raise FileNotFoundError(f"No such model file: {filepath}")
    fix = "Restore it from a copy or save the model again."
    if not zipfile.is_zipfile(filepath):
        raise ValueError(
            f"{filepath} exists but is not a valid .keras file: it is not a zip "
            f"archive (corrupt, or truncated by an interrupted write or copy). {fix}")
    try:
        with zipfile.ZipFile(filepath) as archive:
            bad = archive.testzip()
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"{filepath} is a corrupt .keras file: {e}. {fix}") from None
    if bad is not None:
        raise ValueError(
            f"{filepath} is a corrupt .keras file: member {bad!r} fails its CRC "
            f"check. {fix}")
    missing = [n for n in _KERAS_MEMBERS if n not in names]
    if missing and "__meta__.npy" in names:
        raise ValueError(
            f"{filepath} is not a .keras model but a checkpoint link of "
            "keras_rec_emb.IncrementalCheckpointer (a ckpt-*.npz file). Restore its chain "
            "into a model with IncrementalCheckpointer(model, directory).restore(), apply "
            "it to a served SavedModel with apply_to_saved_model(loaded, path), or look "
            "into it with `keras-rec-emb inspect`.")
    if missing:
        raise ValueError(
            f"{filepath} is not a complete .keras file: it lacks {missing} "
            f"(members: {names}). {fix}")


def storage_root(root: str | os.PathLike):
    """A context in which models are loaded with their file-tier tables under `root`.

    A `.keras` file's config names each file-tier table's `storage_path`, so
    tables built from a config work only under a folder the caller chose:
    inside this context a relative `storage_path` is taken under `root` and an
    absolute one must lie inside it. Tables made in code are not affected.
    See docs/file_tier.md, 'File tier, loading a `.keras` file'.

    Args:
        root: str or path-like, a folder (need not exist yet).

    Returns:
        A context manager; `with` gives the absolute path of `root`.

    Raises:
        TypeError: `root` is not a non-empty str or path-like.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> keras_rec_emb.save_model(model, "/tmp/kre_doc_root.keras")
    >>> with keras_rec_emb.storage_root("/tmp/kre_doc_tables") as root:
    ...     model = keras.saving.load_model("/tmp/kre_doc_root.keras")
    >>> root
    '/tmp/kre_doc_tables'
    """
    from keras_rec_emb import _file_tier

    return _file_tier.storage_root(root)


def load_model(filepath: str | os.PathLike, storage_root: str | os.PathLike | None = None,
               **kwargs) -> "keras.Model":
    """`keras.saving.load_model(filepath)` with errors that say what is wrong.

    Keras reports a missing, non-zip, truncated or corrupt file alike as "File
    not found"; this checks the file first and names what is wrong.

    Args:
        filepath: str or path-like, a `.keras` file.
        storage_root: str, path-like or None. The folder under which the
            model's file-tier tables may work (see `storage_root`); None
            keeps the enclosing `storage_root` context, if any.
        **kwargs: passed to `keras.saving.load_model` (`custom_objects`,
            `compile`, `safe_mode`).

    Returns:
        The `keras.Model`.

    Raises:
        FileNotFoundError: `filepath` does not exist.
        ValueError: `filepath` is not a complete, readable `.keras` file, or a
            file-tier table's `storage_path` lies outside the storage root.
        TypeError: `storage_root` is not a str, path-like or None.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> keras_rec_emb.save_model(model, "/tmp/kre_doc_load.keras")
    >>> keras_rec_emb.load_model("/tmp/kre_doc_load.keras").output_shape
    (None, 1)
    """
    import keras

    from keras_rec_emb import _file_tier

    scope = (contextlib.nullcontext() if storage_root is None
             else _file_tier.storage_root(storage_root, "storage_root"))
    check_keras_file(filepath)
    try:
        with scope:
            return keras.saving.load_model(os.fspath(filepath), **kwargs)
    except Exception as error:
        _free_partial_model(error)
        error.add_note(f"(Loading {filepath} failed: no model was returned, and the "
                       "tables it had begun to load were freed.)")
        raise


def _free_partial_model(error):
    """Frees the model a failed load began: the traceback's frames hold its
    tables, and a file-tier table would keep its folder locked against a retry."""

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()
