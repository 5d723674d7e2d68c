"""The file tier's folders, shared by both backends (no TensorFlow, no JAX): a
table's folder and its flock (csrc/kv/file_store.h's StorageLock), the copy
folder beside a live table's, and the storage root a loaded config's
`storage_path` must lie under (docs/file_tier.md).
"""

import contextvars
import fcntl
import os
import re
import shutil
import tempfile
import time
import warnings
import weakref

COPY_PATH_ENV = "KRE_STORAGE_COPY_PATH"
COPY_MARK = ".copy-"

# The folder under which file-tier tables built from a config may work.
_ROOT = contextvars.ContextVar("keras_rec_emb_storage_root", default=None)

_ROOT_FIX = ("Load it inside `with keras_rec_emb.storage_root(FOLDER):` (or with "
             "`keras_rec_emb.load_model(path, storage_root=FOLDER)`), FOLDER a folder "
             "you choose for the tables' files: a relative storage_path is taken under "
             "it, an absolute one must lie inside it.")


def storage_root(root, argument="root"):
    """See keras_rec_emb.storage_root (`argument`: the name `root` has in
    the caller's signature, for the error)."""
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    if not isinstance(root, str) or not root:
        raise TypeError(f"`{argument}` must be a non-empty str or path-like (a folder). "
                        f"Received: {argument}={root!r}")
    return _RootScope(os.path.abspath(root))


class _RootScope:
    def __init__(self, root):
        self._root = root
        self._tokens = []

    def __enter__(self):
        self._tokens.append(_ROOT.set(self._root))
        return self._root

    def __exit__(self, *exc):
        _ROOT.reset(self._tokens.pop())
        return False


def _inside(path, root):
    # Resolved through symbolic links: a link under the root that leads out
    # of it does not count as under it.
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, real_root]) == real_root


def loaded_storage_path(storage_path):
    """`storage_path` of a StorageOption built from a config (a loaded
    `.keras` file's), as an absolute path under the storage root; a
    ValueError names the option, the path and the fix when it lies outside
    the root, or is absolute and no root was given. Without a root a
    relative path is taken under the current folder and must stay in it."""
    root = _ROOT.get()
    if root is None:
        if os.path.isabs(storage_path):
            raise ValueError(
                "A loaded model's file-tier table names an absolute `storage_path`, "
                f"storage_path={storage_path!r}, and no storage root was given: a model "
                "file does not choose where this program creates and clears folders. "
                + _ROOT_FIX)
        where, base = "the current folder", os.getcwd()
    else:
        where, base = f"the storage root {root!r}", root
    path = os.path.abspath(os.path.join(base, storage_path))
    if not _inside(path, base):
        raise ValueError(
            f"A loaded model's file-tier table names `storage_path`={storage_path!r}, "
            f"which is outside {where} ({path}): a model file does not choose where "
            "this program creates and clears folders. " + _ROOT_FIX)
    return path


def table_folder(storage_path, name):
    """The folder of table `name` under `storage_path` (absolute)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "table"
    return os.path.join(os.path.abspath(storage_path), safe)


def storage_held(folder):
    """Whether a live table (of this process or another) holds the file
    tier's lock on `folder` (an exclusive flock on `folder/LOCK`)."""
    try:
        fd = os.open(os.path.join(folder, "LOCK"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the lock if the probe took it
    return False


def remove_stale_copies(root, base):
    """Removes the copy folders of `base` under `root` that no live table
    holds (left by a killed process). A folder changed in the last minute is
    left alone: a copy being made has not taken its lock yet."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(base + COPY_MARK):
            continue
        path = os.path.join(root, name)
        try:
            if time.time() - os.stat(path).st_mtime < 60:
                continue
        except OSError:
            continue
        if not storage_held(path):
            shutil.rmtree(path, ignore_errors=True)


def copy_folder(owner, table_name, folder):
    """A folder of its own for table `table_name`, whose `folder` another live
    table holds: made next to it (or under `$KRE_STORAGE_COPY_PATH`), removed
    when `owner` is freed. Warns; an OSError names the fixes if none can be made."""
    root = os.environ.get(COPY_PATH_ENV) or os.path.dirname(folder)
    base = os.path.basename(folder)
    remove_stale_copies(root, base)
    try:
        os.makedirs(root, exist_ok=True)
        path = tempfile.mkdtemp(prefix=base + COPY_MARK, dir=root)
    except OSError as e:
        raise OSError(
            e.errno,
            f"File-tier table '{table_name}': its folder '{folder}' is "
            "held by another live table (the model it was reloaded beside, or a "
            "trainer in another process), and no folder of its own could be made "
            f"under '{root}' ({e.strerror}). Set the environment variable "
            f"{COPY_PATH_ENV} to a writable folder for such copies, or load it once "
            "no live table holds that folder (the model holding it freed: `del "
            "model`, or its process ended).") from e
    os.chmod(path, 0o755)  # as the folders the file tier makes
    weakref.finalize(owner, shutil.rmtree, path, True)
    warnings.warn(
        f"File-tier table '{table_name}': its folder '{folder}' is held "
        "by another live table (the model it was reloaded beside, or a trainer in "
        f"another process); this one works in a folder of its own, '{path}', "
        "removed when it is freed. It cannot snapshot(): give it a storage_path of "
        "its own for that.", stacklevel=3)
    return path
