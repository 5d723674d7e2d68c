"""The file tier's folders, shared by both backends (no TensorFlow, no JAX).

A file-tier table works in `storage_path/<table name>` (the name made a safe
file name) and holds an exclusive flock on its `LOCK` file while it lives
(csrc/kv/file_store.h's StorageLock). A second table made on a folder that a
live table holds (a model reloaded beside the one that saved it, or a trainer
in another process) works in a folder of its own next to it,
`<folder>.copy-XXXXXXXX` (under `$KRE_STORAGE_COPY_PATH` when set), removed
when that table is freed; it warns, and refuses `snapshot()`.
"""

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
    """A folder of its own for table `table_name`, whose `folder` another
    live table holds: made next to it (or under `$KRE_STORAGE_COPY_PATH`),
    removed when `owner` is freed. Warns; an OSError names the fixes when
    none can be made."""
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
