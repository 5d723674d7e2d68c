"""Dense variables on the parameter servers: one model for every worker.

In a worker connected with `connect(...)`, a variable created inside
`parameter_servers(devices)` or on a PS device (an optimizer slot) is a
resource variable on a PS task found by name, `kre_ps/<Keras path>`, so
every worker that builds the same layers reaches the same variables,
initialized and updated as in TensorFlow 1 (its chief and `SessionManager`).
See docs/distributed.md, 'Semantics'.
"""

import threading
import time

import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat

PREFIX = "kre_ps/"
READY = PREFIX + "__chief_ready__"

_cluster = None  # the connected cluster (`register`), one per process
_local = threading.local()  # this thread's creator scope and parameter_servers devices
_loads = {}  # bytes of the variables this process (the chief) placed, by PS task


class Cluster:
    """What `connect` registers: the PS job, this worker and the timeout."""

    def __init__(self, num_ps, task_index, timeout, job="ps"):
        self.num_ps = int(num_ps)
        self.task_index = int(task_index)
        self.timeout = float(timeout)
        self.job = job

    @property
    def chief(self):
        return self.task_index == 0

    def device(self, task):
        return f"/job:{self.job}/replica:0/task:{task}/device:CPU:0"

    def task_of(self, device):
        """The PS task of a device name, or None for any other device."""
        if not device:
            return None
        spec = tf.DeviceSpec.from_string(device)
        if spec.job != self.job or spec.task is None or not 0 <= spec.task < self.num_ps:
            return None
        return spec.task


def register(num_ps, task_index, timeout, job="ps"):
    """Records the cluster this process is a worker of (from `connect`) and
    starts sharing variables in this thread."""
    global _cluster
    _cluster = Cluster(num_ps, task_index, timeout, job)
    install()


def cluster():
    """The connected cluster, or None."""
    return _cluster


def install():
    """Puts the sharing creator at the bottom of this thread's variable
    creator stack, once: variables made on a PS device anywhere later in this
    thread (an optimizer's slots, built in `fit`) are shared too."""
    if getattr(_local, "scope", None) is None:
        _local.scope = tf.variable_creator_scope(_creator)
        _local.scope.__enter__()  # held for the thread's life (the reference keeps it)


def scope_devices():
    """The devices of this thread's innermost `parameter_servers` scope, or
    None outside one."""
    return getattr(_local, "devices", None)


def set_scope_devices(devices):
    _local.devices = devices


def scope_tasks_of(devices):
    """The PS tasks of `devices` (a `parameter_servers` scope's), or None for
    none or devices that are not all this cluster's PS tasks."""
    if devices is None or _cluster is None:
        return None
    tasks = [_cluster.task_of(d) for d in devices]
    return None if None in tasks else tasks


def _creator(next_creator, **kwargs):
    if _cluster is None or kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
        return next_creator(**kwargs)
    task = _cluster.task_of(_compat.current_device_name())
    tasks = [task] if task is not None else scope_tasks_of(scope_devices())
    if tasks is None:
        return next_creator(**kwargs)
    with tf.init_scope():
        value = kwargs.get("initial_value")
        value = value() if callable(value) else value
        value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
        return shared_variable(kwargs, value, list(dict.fromkeys(tasks)))


def _path(name):
    parent = _compat.keras_current_path()
    return f"{parent}/{name}" if parent else name


def shared_variable(kwargs, value, tasks):
    """The variable `kre_ps/<path>` on one of the PS tasks `tasks`.

    The task that already holds it (the chief placed it), else, on the
    chief, the least loaded of `tasks` (bytes this process placed there,
    first on ties), initialized from `value`; another worker waits until one
    of `tasks` holds it. Placement is thus decided once, by the chief, and
    found by the others whatever models or order they build in."""
    name = kwargs.get("name") or "Variable"
    shared = PREFIX + _path(name)
    handles = {}
    for task in tasks:
        with tf.device(_cluster.device(task)):
            handles[task] = tf.raw_ops.VarHandleOp(
                dtype=value.dtype, shape=value.shape, container="", shared_name=shared,
                debug_name=shared)

    def holder():
        return next((t for t in tasks if _initialized(handles[t], _cluster.device(t))), None)

    task = holder()
    if task is None and _cluster.chief:
        task = min(tasks, key=lambda t: _loads.get(t, 0))
        _loads[task] = _loads.get(task, 0) + value.shape.num_elements() * value.dtype.size
        initial = value
    else:
        if task is None:
            where = f"ps task {tasks[0]}" if len(tasks) == 1 else f"one of ps tasks {tasks}"
            _wait(lambda: holder() is not None,
                  f"variable '{shared}' to be initialized on {where}")
            task = holder()
        _check_shape(handles[task], _cluster.device(task), shared, task, value.shape)
        initial = None
    variable = _compat.variable_from_handle(
        handles[task], name=name, shape=value.shape, dtype=value.dtype,
        trainable=kwargs.get("trainable"), synchronization=kwargs.get("synchronization"),
        aggregation=kwargs.get("aggregation"), unique_id=f"{shared}@{id(handles[task])}")
    if initial is not None:
        variable.assign(initial)
    return variable


def _initialized(handle, device):
    with tf.device(device):
        return bool(tf.raw_ops.VarIsInitializedOp(resource=handle).numpy())


def _check_shape(handle, device, shared, task, shape):
    with tf.device(device):
        held = tf.TensorShape(tf.raw_ops.VariableShape(input=handle).numpy().tolist())
    if held != shape:
        raise ValueError(
            f"The variable '{shared}' on ps task {task} has shape {held}, and this worker "
            f"builds it with shape {shape}: every worker must build the same model (same "
            "layer names and sizes).")


def _wait(done, what):
    deadline = time.monotonic() + _cluster.timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Worker {_cluster.task_index} waited {_cluster.timeout:g} s (connect's "
                f"timeout) for the {what} by the chief, worker 0. Start the chief (task_index "
                "0) with the same model; it initializes the variables the parameter servers "
                "do not hold yet and marks the cluster ready when its "
                "`parameter_servers(...)` scope ends.")
        time.sleep(0.1)


def scope_ended():
    """Called when a `parameter_servers` scope over this cluster's PS tasks
    ends (outermost scope only): the chief's marks the cluster ready (other
    workers may train); another worker's ends once the chief's has."""
    if _cluster is None:
        return
    device = _cluster.device(0)
    with tf.device(device):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], container="",
                                        shared_name=READY, debug_name=READY)
        if _cluster.chief:
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(1, tf.int64))
            return

    def ready():
        if not _initialized(handle, device):
            return False
        with tf.device(device):
            return int(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int64)) == 1

    _wait(ready, "cluster's ready mark (the end of its `parameter_servers(...)` scope)")
