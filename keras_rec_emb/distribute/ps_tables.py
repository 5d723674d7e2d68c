"""Asynchronous parameter-server training over TensorFlow's own runtime.

Layers built inside `parameter_servers(connect(...))` shard each table over
the PS tasks by key hash (`ShardedEmbeddingTable`); a lookup partitions the
ids by shard and runs each shard's lookup on its task. See
docs/distributed.md, 'Semantics'.
"""

import contextlib
import os
import re
import socket
import time

import numpy as np
import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb.backend.tensorflow import serving_context as _serving_context
from keras_rec_emb import tables as _tables
from keras_rec_emb.backend.tensorflow import variables as _variables
from keras_rec_emb.distribute import ps_variables, shards

# Fibonacci hashing (the golden-ratio multiplier, high 32 bits). The kv
# index picks its own lock shards and slots with splitmix64 bits, a different
# function, so every parameter-server shard still spreads over all of them.
_GOLDEN = 0x9E3779B97F4A7C15


def shard_of(keys, num_shards):
    """The shard of each key among `num_shards`: a TF int32 tensor.

    Args:
        keys: int tensor of keys (any shape).
        num_shards: int >= 1.

    Example:

    >>> from keras_rec_emb.distribute import shard_of
    >>> shard_of(tf.constant([1, 2, 3], tf.int64), 2).numpy().tolist()
    [1, 0, 0]
    """
    keys = tf.cast(keys, tf.int64)
    mixed = tf.bitcast(keys, tf.uint64) * tf.constant(_GOLDEN, tf.uint64)
    high = tf.bitwise.right_shift(mixed, tf.constant(32, tf.uint64))
    return tf.cast(tf.math.floormod(high, tf.constant(num_shards, tf.uint64)), tf.int32)


def shard_of_numpy(keys, num_shards):
    """`shard_of` in NumPy (restoring into another shard count)."""
    keys = np.asarray(keys).astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        mixed = keys * np.uint64(_GOLDEN)
    return ((mixed >> np.uint64(32)) % np.uint64(num_shards)).astype(np.int64)


def _check_devices(devices):
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices:
        raise ValueError(
            "`devices` must be a non-empty list of device names such as "
            f"['/job:ps/task:0', '/job:ps/task:1']. Received: devices={devices!r}")
    for d in devices:
        if not isinstance(d, str) or not d:
            raise TypeError(
                f"`devices` must hold device name strings. Received: devices={devices!r}")
    return list(devices)


@contextlib.contextmanager
def parameter_servers(devices):
    """Layers built inside shard their tables over `devices` by key hash.

    In a worker connected with `connect(...)` (`devices` its result), the
    model built inside is the cluster's one model, its dense and optimizer
    variables on the PS tasks too; the chief (worker 0) initializes them
    and the other workers wait for the end of its scope. Workers then
    update asynchronously. See docs/distributed.md, 'Semantics'.

    Args:
        devices: list of str. One device per shard, normally
            `connect(...)`'s result (`["/job:ps/task:0", ...]`); a device
            may hold several shards.

    Example:

    >>> import keras_rec_emb as kre
    >>> with kre.distribute.parameter_servers(["/cpu:0"]):
    ...     layer = kre.layers.EmbeddingVariable(4, name="ps_doc")
    ...     layer.build()
    >>> layer.table.num_shards
    1
    """
    devices = _check_devices(devices)
    previous = ps_variables.scope_devices()
    ps_variables.set_scope_devices(devices)
    shares = previous is None and ps_variables.cluster() is not None
    if shares:
        ps_variables.install()  # this thread creates shared variables too
    try:
        yield devices
    finally:
        ps_variables.set_scope_devices(previous)
    if shares and ps_variables.scope_tasks_of(devices) is not None:
        ps_variables.scope_ended()


def _of_first_shard(name):  # every shard is built from the same arguments
    return property(lambda table: getattr(table._shards[0], name),
                    doc=f"The shards' `{name}` (the same for each).")


class ShardedEmbeddingTable(_tables.TableBase, _compat.Trackable):
    """One embedding table split by key hash over several devices.

    Shard `i` holds the keys with `shard_of(key, N) == i`; it is an
    `EmbeddingTable` on `devices[i]`, found or created by the name
    `"{name}/shard_{i}_of_{N}"`. Lookups, `export`, `import_`, `stats` and
    `evict` cover every shard; each shard's `variable` is what optimizers
    update (on its device).

    Args:
        devices: list of str. One device per shard.
        dim, key_dtype, default_values, name, **kwargs: The arguments of
            `EmbeddingTable`.
        replicas: bool. The devices are a MirroredStrategy's replicas: shard
            `i` is owned by replica `i`, which alone applies its updates
            (the optimizers gather every replica's gradient for it).

    Example:

    >>> from keras_rec_emb.distribute import ShardedEmbeddingTable
    >>> table = ShardedEmbeddingTable(["/cpu:0", "/cpu:0"], 2, "int64",
    ...                               np.ones((1, 2), np.float32), name="doc_sharded")
    >>> table.lookup(tf.constant([1, 2, 3, 4], tf.int64), insert=True).shape
    TensorShape([4, 2])
    >>> table.size(), sum(s.size() for s in table.shards)
    (4, 4)
    """

    optimizer = None  # of `EmbeddingVariable(optimizer=...)`, set by the layer

    def __init__(self, devices, dim, key_dtype, default_values, name="embedding_table",
                 replicas=False, **kwargs):
        super().__init__()
        self._devices = _check_devices(devices)
        self._name = name
        n = len(self._devices)
        # Parameter-server shards are found by name (every worker reaches the
        # same one); a replica's shard is private to this process.
        self._shards = []
        for i, device in enumerate(self._devices):
            shard_name = f"{name}/shard_{i}_of_{n}"
            self._shards.append(
                shards.ReplicaShard(device, i, dim, key_dtype, default_values,
                                    name=shard_name, **kwargs) if replicas else
                shards.ParameterServerShard(device, shard_name, dim, key_dtype, default_values,
                                            name=shard_name, **kwargs))

    @property
    def shards(self):
        return list(self._shards)

    @property
    def num_shards(self):
        return len(self._shards)

    @property
    def devices(self):
        return list(self._devices)

    @property
    def variables(self):
        return [s.variable for s in self._shards]

    local = _tables.constant(
        False, "False: the rows live in several tables (`tables.Table.local`).")
    fused_table = _tables.constant(
        None, "None: the shards live on several devices (`tables.Table.fused_table`).")
    exchange_group = _tables.constant(None, "None: each shard is looked up on its own device.")

    lookup_many = staticmethod(_tables.lookup_each)

    def _not_one_table(self, what):
        raise ValueError(
            f"Embedding table '{self._name}' is sharded over {len(self._shards)} devices "
            f"{self._devices}; it has no single `{what}`. Only EmbeddingVariable's own "
            "and GroupEmbedding's lookups (calling the layer, or the group_embedding_lookup* "
            "ops) and the optimizers of keras_rec_emb.optimizers support sharded tables "
            "so far: AdaptiveEmbedding, MultiHashEmbedding and the embedding_lookup* ops "
            "need one table per process "
            "(build them outside `parameter_servers(...)` / a MirroredStrategy scope).")

    @property
    def handle(self):
        self._not_one_table("handle")

    @property
    def variable(self):
        self._not_one_table("variable")

    dim = _of_first_shard("dim")
    key_dtype = _of_first_shard("key_dtype")
    eviction_rule = _of_first_shard("eviction_rule")
    save_filtered = _of_first_shard("save_filtered")
    filters = _of_first_shard("filters")
    no_permission_value = _of_first_shard("no_permission_value")

    @property
    def trainable(self):
        return self._shards[0].trainable

    @trainable.setter
    def trainable(self, value):
        for s in self._shards:
            s.trainable = value

    def __repr__(self):
        return (f"<ShardedEmbeddingTable '{self._name}' dim={self.dim} "
                f"shards={self._devices}>")

    # -- tf.train.Checkpoint: one table in the ordinary format ----------------
    _ROW_PARTS = tuple(p.name for p in _variables.PARTS if p.rows == "N")
    _FILTERED_PARTS = tuple(p.name for p in _variables.PARTS if p.rows == "F")

    @staticmethod
    def _shard_parts(shard, include_filtered, evict):
        with tf.device(shard.device):
            return shard._export_parts(include_filtered, evict=evict)

    def _joined(self, first, rows, filtered):
        """`first`'s parts with each per-key part replaced by `rows(name)`
        (admitted keys) or `filtered(name)` (filtered keys)."""
        out = dict(first)
        out.update((k, rows(k)) for k in self._ROW_PARTS)
        out.update((k, filtered(k)) for k in self._FILTERED_PARTS)
        # Each shard's Bloom counters cover its own keys only; not merged.
        out["bloom"] = tf.zeros([0], tf.uint8)
        return out

    def _gathered_parts(self, include_filtered, evict=False):
        """Every shard's parts in `EmbeddingTable`'s checkpoint format."""
        shard_parts = [self._shard_parts(s, include_filtered, evict) for s in self._shards]

        def rows(k):
            return tf.concat([p[k] for p in shard_parts], axis=0)

        return self._joined(shard_parts[0], rows, rows)

    def _serialize_to_tensors(self):
        """Every shard's rows as one table's (evicting first, as one table
        does), so a checkpoint restores into any shard count."""
        return self._gathered_parts(self.save_filtered, evict=True)

    def _split_restored(self, restored_tensors, n):
        """The restored parts split by key hash into `n` dicts, one per shard."""
        parts = dict(restored_tensors)
        values = parts.get("values")
        if values is not None:
            _tables.check_saved_dim(self._name, values.shape, self.dim)
        rows = shard_of(parts["keys"], n)
        filtered = shard_of(parts["keys_filtered"], n)
        split = {k: tf.dynamic_partition(parts[k], rows, n) for k in self._ROW_PARTS}
        split.update({k: tf.dynamic_partition(parts[k], filtered, n)
                      for k in self._FILTERED_PARTS})
        return [dict(parts, **{k: v[i] for k, v in split.items()}) for i in range(n)]

    def _held(self):  # (index, shard) of each shard this process holds
        return enumerate(self._shards)

    def _restore_from_tensors(self, restored_tensors):
        """Keeps the restored keys that hash to each shard held here: a
        checkpoint of any shard count (or of one table) restores."""
        split = self._split_restored(restored_tensors, self.num_shards)
        ops = []
        for i, shard in self._held():
            with tf.device(shard.device):
                ops.append(_ops.import_(shard.handle, shard.dim, split[i]))
        return tf.group(ops)

    # -- table operations -------------------------------------------------
    @_serving_context.served
    def lookup(self, keys, insert=False):
        """Rows of `keys` (any shape) as `keys.shape + (dim,)`; each shard's
        keys are looked up on its device."""
        keys = tf.convert_to_tensor(keys)
        if len(self._shards) == 1:
            with tf.device(self._devices[0]):
                return self._shards[0].lookup(keys, insert=insert)
        n = len(self._shards)
        flat = tf.reshape(keys, [-1])
        part = shard_of(flat, n)
        positions = tf.dynamic_partition(tf.range(tf.size(flat)), part, n)
        ids = tf.dynamic_partition(flat, part, n)
        rows = []
        for shard, device, shard_ids in zip(self._shards, self._devices, ids):
            with tf.device(device):
                rows.append(shard.lookup(shard_ids, insert=insert))
        out = tf.dynamic_stitch(positions, rows)
        out = tf.reshape(out, tf.concat([tf.shape(keys, out_type=tf.int32), [self.dim]], 0))
        out.set_shape(keys.shape.concatenate([self.dim]))
        return out

    def size(self):
        return sum(s.size() for s in self._shards)

    def _over_shards(self, value):
        """`value(shard)` of every shard, one row each (a `CollectiveShardedTable`
        gathers every worker's)."""
        return np.array([value(s) for s in self._shards], np.int64)

    def stats(self):
        """The shards' statistics added up (`latest_step`: the largest;
        collective for a `CollectiveShardedTable`)."""
        names = ("size", "filtered", "memory_bytes", "latest_step")

        def row(shard):
            stats = shard.stats()
            return [stats[k] for k in names]

        every = self._over_shards(row)
        out = {k: int(every[:, i].sum()) for i, k in enumerate(names[:3])}
        out["latest_step"] = int(every[:, 3].max())
        return out

    def evict(self, step=None):
        """Applies eviction on every shard; returns the keys evicted in all
        (collective for a `CollectiveShardedTable`)."""
        return int(self._over_shards(lambda s: [s.evict(step)]).sum())

    @property
    def storage_dir(self):
        """File tier: the folder holding the shards' folders (each shard's
        `storage_dir` is `<this>/<name>_shard_<i>_of_<N>`), or None (DRAM)."""
        first = self._shards[0].storage_dir
        return None if first is None else os.path.dirname(first)

    def snapshot(self):
        """File tier: a crash-safe snapshot of every shard (each under its own
        folder); returns the snapshot numbers, one per shard."""
        return [s.snapshot() for s in self._shards]

    def restore_snapshot(self, path=None):
        """File tier: every shard restores the latest snapshot of its folder
        under `path` (default `storage_dir`); returns the number of keys.
        A snapshot is per shard, so it restores only into the same shard count."""
        _tables.check_snapshot_path(path)
        root = path or self.storage_dir
        if root is None:
            self._shards[0].restore_snapshot()  # its error names the fix
        n = len(self._shards)
        folders = [os.path.join(root, os.path.basename(s.storage_dir)) for s in self._shards]
        missing = [f for f in folders if not os.path.isdir(f)]
        if missing:
            saved = saved_shard_counts(root, os.path.basename(self._shards[0].storage_dir))
            if saved and n not in saved:
                counts = " or ".join(str(c) for c in sorted(saved))
                raise ValueError(
                    f"Cannot restore the file-tier snapshot of table '{self._name}' "
                    f"under {root!r}: it was saved with {counts} shards and this table "
                    f"has {n} shards. A snapshot holds each "
                    "shard's own files and cannot be resharded; restore from a "
                    "tf.train.Checkpoint or model.save (the ordinary per-table format, "
                    "which any shard count restores), or build the table with the saved "
                    "shard count.")
            raise ValueError(
                f"No file-tier snapshot of table '{self._name}' ({n} shards) under "
                f"{root!r}: missing {missing}.")
        return sum(s.restore_snapshot(f) for s, f in zip(self._shards, folders))

    def add_slot(self, name, init=0.0, width=None):
        for s in self._shards:
            s.add_slot(name, init, width)

    def resize_rows(self, keys, values, slots):
        return self._shards[0].resize_rows(keys, values, slots)

    def export(self, include_filtered=True):
        """Every shard's rows in one dict shaped like `EmbeddingTable.export()`.
        Bloom counters are per shard and not merged: `bloom` is empty. A
        `CollectiveShardedTable`'s is collective (every worker calls it)."""
        return _variables.exported(self._gathered_parts(include_filtered))

    def import_(self, data, clear=True):
        """Splits `data` by key hash: rows saved with any shard count restore."""
        self._check_import_data(data)
        for i, shard in self._held():
            shard.import_(_rows_of_shard(data, i, self.num_shards), clear)


def _rows_of_shard(data, index, num_shards):
    keys = np.asarray(data["keys"])
    which = shard_of_numpy(keys, num_shards) if keys.size else np.zeros(0, np.int64)
    keys_f = np.asarray(data.get("keys_filtered", np.zeros(0, np.int64)))
    which_f = shard_of_numpy(keys_f, num_shards) if keys_f.size else np.zeros(0, np.int64)
    masks = {k: which == index for k in _tables.ROW_PARTS}
    masks.update((k, which_f == index) for k in _tables.FILTERED_ROW_PARTS)
    part = {k: v for k, v in data.items() if k not in masks and k not in ("slots", "bloom")}
    part.update((k, np.asarray(data[k])[masks[k]]) for k in masks if k in data)
    part["slots"] = {name: np.asarray(rows).reshape(keys.shape[0], -1)[which == index]
                     for name, rows in (data.get("slots") or {}).items()}
    return part


def saved_shard_counts(root, shard_folder):
    """The N of the folders `<table>_shard_<i>_of_<N>` under `root`."""
    base = re.sub(r"_shard_\d+_of_\d+$", "", shard_folder)
    pattern = re.compile(re.escape(base) + r"_shard_\d+_of_(\d+)$")
    try:
        names = os.listdir(root)
    except OSError:
        return set()
    return {int(m.group(1)) for m in map(pattern.match, names) if m}


def _split_address(address):
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"A cluster address must be 'host:port'. Received: address={address!r}")
    return host, int(port)


def wait_for(address, timeout):
    """Returns once `address` accepts a TCP connection (else `ConnectionError`)."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"Cannot reach the TensorFlow server at {address} (task of the "
                    f"cluster) within {timeout} s: {e}. Start it with `keras-rec-emb "
                    "ps ...` (parameter servers) and check the cluster addresses."
                ) from e
            time.sleep(0.2)


# TensorFlow's master asks each task for its devices with this RPC; its empty
# request serializes to no bytes and its answer is `repeated DeviceAttributes
# device_attributes = 1` (tensorflow/core/protobuf/worker.proto).
_GET_STATUS = "/tensorflow.WorkerService/GetStatus"


def _device_names(response):  # of a serialized GetStatusResponse
    from tensorflow.core.framework import device_attributes_pb2

    names, i = [], 0
    while i < len(response):
        tag, i = _varint(response, i)
        if tag >> 3 != 1 or tag & 7 != 2:
            raise ValueError(f"unexpected field {tag >> 3} (wire type {tag & 7})")
        size, i = _varint(response, i)
        if i + size > len(response):
            raise ValueError("truncated DeviceAttributes")
        names.append(device_attributes_pb2.DeviceAttributes.FromString(
            response[i:i + size]).name)
        i += size
    return names


def _varint(data, i):
    value, shift = 0, 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


def probe(address, job, task, timeout):
    """Returns once the server at `address` answers `WorkerService.GetStatus`
    as task `task` of `job`, within `timeout` s, else `ConnectionError`.

    An open port is not enough: a process that never answers would make
    TensorFlow's runtime (whose RPCs carry no deadline) wait forever at the
    first op placed on the task."""
    import grpc

    _split_address(address)
    name = f"{job} task {task} ({address})"
    deadline = time.monotonic() + timeout
    channel = grpc.insecure_channel(address)
    try:
        get_status = channel.unary_unary(_GET_STATUS)
        while True:
            left = deadline - time.monotonic()
            try:
                response = get_status(b"", timeout=max(left, 0.05))
                break
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline - 0.2:
                    time.sleep(0.2)  # not listening yet, or refused: a server starting
                    continue
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise ConnectionError(
                        f"The TensorFlow server of {name} did not answer within "
                        f"{timeout:.3g} s ({code.name}: {e.details()}). Something that is "
                        "not a TensorFlow server may hold that port, or the server is "
                        "not started: start it with `keras-rec-emb ps ...` and check "
                        "the cluster addresses.") from None
                raise ConnectionError(
                    f"The server at {address}, given as {job} task {task}, is not a "
                    f"TensorFlow server: it answered TensorFlow's GetStatus RPC with "
                    f"{code.name} ({e.details()}). Check the cluster addresses."
                ) from None
    finally:
        channel.close()
    try:
        names = _device_names(response)
    except ValueError as e:
        raise ConnectionError(
            f"The server at {address}, given as {job} task {task}, is not a "
            f"TensorFlow server: its answer to GetStatus does not parse ({e}). "
            "Check the cluster addresses.") from None
    prefix = f"/job:{job}/replica:0/task:{task}/"
    if not any(n.startswith(prefix) for n in names):
        raise ConnectionError(
            f"The TensorFlow server at {address} is not {job} task {task}: its "
            f"devices are {names}. Give the addresses in task order (the order "
            "of `keras-rec-emb ps --ps ...`).")


def connect(ps, worker, task_index=0, timeout=60.0):
    """Connects this process, worker `task_index`, to parameter servers.

    Workers may connect in any order, several at the same moment.

    Args:
        ps: list of str. The PS tasks' "host:port" addresses, in task order.
        worker: str. "host:port" this worker's own TensorFlow server listens
            on (it must be free).
        task_index: int. This worker's index (a name in the cluster; workers
            do not talk to each other). Worker 0 is the chief: it
            initializes the model's variables (see `parameter_servers`).
        timeout: float. Seconds to wait for each PS task to answer, as a
            TensorFlow server and as the task its position names; and, on
            a worker other than the chief, for the chief to initialize each
            variable and to end its `parameter_servers` scope.

    Returns:
        The PS devices, `["/job:ps/task:0", ...]`, for `parameter_servers`.

    Raises:
        ConnectionError: a PS task did not answer in time, answered as
            something other than a TensorFlow server, or is another task
            (the task and its address are named).

    Example:

    >>> from keras_rec_emb.distribute import connect
    >>> try:
    ...     connect(["127.0.0.1:1"], "127.0.0.1:0", timeout=0.5)
    ... except ConnectionError as e:
    ...     print(str(e).split(" (")[0])
    Cannot reach the TensorFlow server at 127.0.0.1:1
    """
    if isinstance(ps, str) or not isinstance(ps, (list, tuple)) or not ps:
        raise ValueError(f"`ps` must be a non-empty list of 'host:port'. Received: ps={ps!r}")
    if not isinstance(task_index, int) or task_index < 0:
        raise ValueError(
            f"`task_index` must be an integer >= 0. Received: task_index={task_index!r}")
    for task, address in enumerate(ps):
        deadline = time.monotonic() + timeout
        wait_for(address, timeout)
        # One `timeout` per task for both steps; the probe gets at least a
        # moment even when the port opened at the last instant.
        probe(address, "ps", task, max(deadline - time.monotonic(), 0.5))
    cluster = tf.train.ClusterSpec({"ps": list(ps), "worker": {task_index: worker}})
    tf.config.experimental_connect_to_cluster(cluster, job_name="worker",
                                              task_index=task_index)
    ps_variables.register(len(ps), task_index, timeout)
    return [f"/job:ps/task:{i}" for i in range(len(ps))]


def serve(ps, task_index, worker=None):
    """Runs PS task `task_index` of `ps` in this process until it is killed,
    holding one eager context of its own (see `_hold_own_context`)."""
    _ops.gen()
    spec = {"ps": list(ps)}
    if worker:
        spec["worker"] = list(worker)
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="ps",
                                  task_index=task_index, protocol="grpc", start=True)
    _hold_own_context(ps[task_index], task_index)
    return server


# The job of the client each PS task runs against its own server.
KEEPER_JOB = "kre_ps_keeper"


def _hold_own_context(address, task_index):
    """Makes this process an eager client of its own server, before any
    worker connects, for the life of the process.

    Why: TensorFlow 2.21's `EagerServiceImpl::CreateContext` replaces the
    server's collective-executor manager whenever it finds no context,
    checked under its lock but replaced after releasing it. Two workers
    reaching an idle server together both replace it, one context keeps a
    pointer to the manager the other freed, and the server crashes (SIGSEGV).
    Holding a context of its own, a server never has zero contexts again, so
    any number of workers may connect at the same moment."""
    with socket.socket() as s:  # a free port for this client's own server
        s.bind(("127.0.0.1", 0))
        keeper = f"127.0.0.1:{s.getsockname()[1]}"
    cluster = tf.train.ClusterSpec({"ps": {task_index: address}, KEEPER_JOB: [keeper]})
    tf.config.experimental_connect_to_cluster(cluster, job_name=KEEPER_JOB, task_index=0)
    with tf.device(f"/job:ps/task:{task_index}"):
        tf.constant(0).numpy()  # the context exists on the server now
