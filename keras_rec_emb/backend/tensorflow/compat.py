"""Every use of private TensorFlow / Keras / pyarrow / confluent-kafka API.

The stack is pinned (requirements.txt, pyproject.toml). Private names may
change in any release, so the package reaches them only through this module:
upgrading a pin means reading this file, and `tests/test_compat.py` checks
that every entry still exists in the installed versions and that no other
module of the package reaches past it.

Each entry says what it is, why the public API does not do it, and who uses
it. Private *hooks* our classes override cannot be routed through a function:
`OVERRIDDEN_HOOKS` declares them, and the test checks that the base class
still has each and that our classes override no undeclared private method.
"""

import collections
import os
import time
import weakref

import keras
import pyarrow as pa
import tensorflow as tf
from tensorflow.python.data.ops import from_generator_op
from tensorflow.python.eager import tape as _tape
from tensorflow.python.framework import op_def_registry

# The corrections of Keras that need no TensorFlow (the JAX backend installs
# them too) and the private Keras API both backends use.
from keras_rec_emb._keras_fixes import (  # noqa: F401
    flatten_layers,
    in_symbolic_build,
    install_fix,
    uses_weight_decay,
)

# -- TensorFlow -------------------------------------------------------------------


def variable_accessed(variable):
    """Records a read of `variable` on every watching `tf.GradientTape`.

    Our kernels read the table through its handle, which the tape does not
    see; `tape.watch` needs the tape object, which a layer inside `fit` lacks.
    Used by `variables.EmbeddingTable.lookup` and `ops/embedding_ops.py`.
    """
    _tape.variable_accessed(variable)


def op_def(op_type):
    """The `OpDef` registered for `op_type` (its inputs, outputs, attributes).

    The op an eager gradient function gets has no `op_def`, and the public API
    has no lookup by type. Used by `op_args`.
    """
    return op_def_registry.get(op_type)


def functional_nodes(model):
    """A Functional model's non-input nodes in the order its call runs them
    (`_nodes_by_depth`, Keras's only view of the graph). Used by `model_fusion.py`."""
    by_depth = model._nodes_by_depth  # pylint: disable=protected-access
    return [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]
            if node.operation is not None and not node.is_input]


# Keras 3.15.1's `Functional._run_through_graph` runs a Functional (or
# Sequential) model's layers in graph order. `hook_functional_graph(context)`
# wraps it so that each real run (not Keras's symbolic passes: a `call_fn`, or
# `KerasTensor` inputs) happens inside `context(model, flat_inputs)`, where
# `model_fusion.py` plans the lookups of one model call that can share one
# fused op. Keras has no hook around a graph run, and a subclass is not
# possible (`keras.Model(inputs, outputs)` makes a Functional itself). Before
# adding a version, read `_run_through_graph` and `Layer.__call__`'s input
# conversion again: the fusion relies on integer ids reaching each layer as
# the very tensor given to the graph. Elsewhere every layer looks up at its call.
KERAS_FUNCTIONAL_HOOK_VERSIONS = ("3.15.1",)
KERAS_FUNCTIONAL_ORIGINALS = {}


def hook_functional_graph(context):
    """Installs the hook described above (`_keras_fixes.install_fix`)."""
    from keras.src.models.functional import Functional

    def wrap(original):
        def _run_through_graph(self, inputs, operation_fn=lambda op: op, call_fn=None):
            flat = keras.tree.flatten(inputs)
            if (call_fn is not None or keras.backend.backend() != "tensorflow"
                    or any(isinstance(x, keras.KerasTensor) for x in flat)):
                return original(self, inputs, operation_fn=operation_fn, call_fn=call_fn)
            with context(self, flat):
                return original(self, inputs, operation_fn=operation_fn, call_fn=call_fn)
        return _run_through_graph

    return install_fix(KERAS_FUNCTIONAL_HOOK_VERSIONS, KERAS_FUNCTIONAL_ORIGINALS,
                       Functional, "_run_through_graph", wrap, marker="_kre_hook")


# A dataset built from three graph functions (init / next / finalize) over a
# Python iterator. Public `tf.data.Dataset.from_generator` wraps the same
# class but adds per-component Python checks, costly on wide batches.
# Used by `data/_source.python_dataset`.
GeneratorDataset = from_generator_op._GeneratorDataset  # pylint: disable=protected-access


def dataset_variant(dataset):
    """The variant tensor of a `tf.data.Dataset`, which a subclass passes to
    `Dataset.__init__`; a pipeline exposes it only as this attribute. Used by
    `data/_source.WrappedDataset`."""
    return dataset._variant_tensor  # pylint: disable=protected-access


def dataset_inputs(dataset):
    """The input datasets of `dataset` (`tf.data.Dataset._inputs`), which a
    subclass must report for tf.data's graph rewrites and checkpointing; no
    public accessor. Used by `data/_source.WrappedDataset`."""
    return dataset._inputs()  # pylint: disable=protected-access


# Base class of checkpointable state that is not a variable: its
# `_serialize_to_tensors` / `_restore_from_tensors` (see OVERRIDDEN_HOOKS) are
# what `tf.train.Checkpoint` saves. The public `tf.Module` is an
# AutoTrackable, which would also track (and try to save) every attribute.
# Used by `backend/tensorflow/data.PositionBase` (KafkaPosition's base).
Trackable = tf.__internal__.tracking.Trackable

def resolve_training(training):
    """`training`, with None read as "while a gradient tape records": Keras
    passes None to a subclassed model's layers, in `fit` too, and a table
    would count nothing while it trains. No public query of the tape stack."""
    if training is not None:
        return training
    from tensorflow.python.eager import record

    return record.could_possibly_record()


def in_xla_context():
    """Whether the graph being built is compiled by XLA: our kernels have
    none, and XLA's own error ("No registered 'KRE>...' OpKernel") says
    nothing of the fix. No public query. Used by `_ops.refuse_xla`."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def strategy_all_to_all(strategy, tensor):
    """Collective all-to-all among `strategy`'s replicas, in its replica
    function: row `r` of `tensor` goes to rank `r`, the result's comes from it.

    The replica context has no all-to-all; this launches one as the
    strategy's `CollectiveReplicaLauncher` does (its group, instance key,
    ordering token, timeout), so that it orders with the strategy's own
    collectives. Used by `distribute/collective_tables.py`.
    """
    from tensorflow.python.ops import collective_ops

    return _strategy_collective(strategy, collective_ops.all_to_all_v2, tensor)


def strategy_all_gather(strategy, tensor):
    """All-gather of a tensor of one shape on every replica, in one collective
    (`ReplicaContext.all_gather` gathers the shapes first, one more round
    trip). Launched as `strategy_all_to_all` is."""
    from tensorflow.python.ops import collective_ops

    return _strategy_collective(strategy, collective_ops.all_gather_v2, tensor)


def _strategy_collective(strategy, op, tensor):
    launcher = strategy.extended._cross_device_ops._launchers[0]  # pylint: disable=protected-access
    instance_key = launcher._next_instance_key()  # pylint: disable=protected-access
    options = launcher._options  # pylint: disable=protected-access
    with tf.device(launcher._device):  # pylint: disable=protected-access
        return op(
            tensor, launcher._group_size, launcher._group_key, instance_key,  # pylint: disable=protected-access
            communication_hint=options.implementation.value,
            timeout=options.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access


class ActsAsResourceVariable:
    """Base of a non-variable that a tape differentiates through its `handle`
    (`_should_act_as_resource_variable`, no public protocol).

    Stock optimizers key variables by `_unique_id`: here the subclass's
    `_stock_optimizer_key()`, which `variables.TableVariable` uses to refuse
    them with an error naming the fix.
    """

    _should_act_as_resource_variable = True

    @property
    def _unique_id(self):
        return self._stock_optimizer_key()

    def _stock_optimizer_key(self):
        raise NotImplementedError


# -- Keras ------------------------------------------------------------------------


def child_layers(layer):
    """The layers `layer` holds directly, in order (public `layers` exists on
    models only). Used by the CLI's `inspect`."""
    return layer._flatten_layers(include_self=False, recursive=False)  # pylint: disable=protected-access


def track_variable(layer, variable):
    """Makes `layer` own `variable`: Keras has no public way to adopt an
    existing variable. Used by `layers.EmbeddingVariable.build`."""
    layer._track_variable(variable)  # pylint: disable=protected-access


def exported_resources(loaded):
    """The resources of a loaded `model.export` SavedModel, in export order
    (`ExportArchive`'s `_misc_assets`; nothing public lists them). Used by
    `incremental.apply_to_saved_model`."""
    return list(getattr(loaded, "_misc_assets", None) or [])


def built_variables(optimizer):
    """The variables `optimizer` was built for (public `variables` are its
    slots), or `[]`. Used by `TableOptimizer.apply`."""
    return getattr(optimizer, "_trainable_variables", [])


# Keras 3.15.1's TensorFlow trainer under a multi-worker strategy
# (keras-team/keras#20585): `model.fit` / `evaluate` fail for any model.
# (1) `_maybe_symbolic_build` calls `strategy.reduce("MEAN", batch,
# axis=None)` on the first (per-replica) batch, which the collective strategy
# cannot convert; (2) `reduce_per_replica(..., "mean")` (the steps' "auto"
# log reduction) calls `strategy.reduce("MEAN", v, axis=0)`, which fails on
# scalar logs. Under a multi-worker MultiWorkerMirroredStrategy only, the
# correction does what the one-worker branches do: the symbolic build gets
# this worker's part of the batch (same shapes), the logs the element-wise
# mean over every replica. (3) A cost: Keras hands the distributed iterator
# to a tf.function every step; `DistributedStepCalls` calls the traced
# function directly after an iterator's first step, and the logs are averaged
# in one all-reduce (`_mean_over_replicas`). (4) With `steps_per_execution` >
# 1, Keras's loop of steps fails under the strategy, and under a
# MirroredStrategy of several replicas (keras-team/keras#19246):
# `_unrolled_steps_function` (not with `jit_compile=True`). (5) Under any
# strategy, `fit` / `evaluate` / `predict` each make a distributed iterator
# for the symbolic build, take one batch and drop it at once
# (`epoch_iterator.reset()`) while its MultiDeviceIterator's background
# thread fetches the next batch; TensorFlow 2.21's ~MultiDeviceIterator
# releases the dataset before it stops that thread, which then can crash the
# process (SIGSEGV in MultiDeviceBuffer::BackgroundThread, seen under load).
# Keras drops an epoch's iterator the same way when the next epoch begins
# (its thread may be fetching the end of the data). The correction takes no
# batch when nothing is left to build (no iterator is made), and keeps every
# iterator an epoch iterator drops (`reset`, or replaced between epochs) a
# while (`_keep_dropped`): released later, its thread waits on a full buffer
# or has ended. Every other case runs Keras's own code. Installed by
# `fix_keras_multi_worker()` when `keras_rec_emb.distribute` is imported.
KERAS_MULTI_WORKER_FIX_VERSIONS = ("3.15.1",)
KERAS_MULTI_WORKER_ORIGINALS = {}
# (time dropped, iterator) of the distributed iterators Keras dropped last,
# oldest first: each kept for _KEEP_DROPPED_S seconds, at most
# _KEEP_DROPPED_MAX of them (each holds a batch or two per device).
_DROPPED_ITERATORS = collections.deque()
_KEEP_DROPPED_S = 5.0
_KEEP_DROPPED_MAX = 8


def _keep_dropped(iterator):
    """Keeps `iterator`, just dropped by Keras, and releases the kept ones
    dropped more than _KEEP_DROPPED_S seconds ago (or beyond the last
    _KEEP_DROPPED_MAX)."""
    now = time.monotonic()
    kept = _DROPPED_ITERATORS
    while kept and (now - kept[0][0] > _KEEP_DROPPED_S or len(kept) >= _KEEP_DROPPED_MAX):
        kept.popleft()
    kept.append((now, iterator))


def _kept_if_replaced(epoch_iterator, seen):
    """`seen`, the epoch iterator's iterator before, kept if Keras has
    replaced it since; returns the one it holds now."""
    now = epoch_iterator._current_iterator  # pylint: disable=protected-access
    # (A strategy's: a plain tf.data iterator stops its threads first.)
    if isinstance(seen, tf.distribute.DistributedIterator) and now is not seen:
        _keep_dropped(seen)
    return now


def _needs_a_batch(trainer):
    """Whether Keras's symbolic build of `trainer` reads a data batch (its
    model, compiled metrics or compiled loss unbuilt; `_symbolic_build`'s
    tests). The optimizer builds from the variables alone."""
    metrics = trainer._compile_metrics  # pylint: disable=protected-access
    loss = trainer._compile_loss  # pylint: disable=protected-access
    return (not all(layer.built for layer in trainer._flatten_layers())  # pylint: disable=protected-access
            or (metrics is not None and not metrics.built)
            or (loss is not None and not loss.built))


def _keras_tf_trainer():
    from keras.src.backend.tensorflow import trainer

    return trainer


def in_multi_worker_mode(strategy):
    """Whether `strategy` spans several worker processes (Keras's own test)."""
    return bool(strategy is not None and _keras_tf_trainer()._collective_all_reduce_multi_worker(  # pylint: disable=protected-access
        strategy))


def _local_part(strategy, value):
    if value is None:
        return None
    return strategy.experimental_local_results(value)[0]


def configure_lost_worker_timeout(cluster_spec, seconds):
    """Sets the coordination service's heartbeat timeout (after which the
    survivors of a lost worker fail naming it) before the strategy configures
    the service with the defaults, which it does only when none is configured."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs]
    leader = multi_worker_util.coordination_leader(cluster_spec)
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=leader, coordinated_jobs=jobs,
        heartbeat_timeout_in_ms=int(seconds * 1000))


def coordination_heartbeat_timeout_ms():
    """The coordination service's heartbeat timeout, or None."""
    from tensorflow.python.eager import context

    config = context.context().coordination_service
    return None if config is None else config.heartbeat_timeout_in_ms


def fix_keras_multi_worker():
    """Installs the correction described above, for each function it wraps."""
    trainer = _keras_tf_trainer()
    cls = trainer.TensorFlowTrainer

    def wrap_build(keras_build):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            strategy = self._distribute_strategy  # pylint: disable=protected-access
            if iterator is None or strategy is None:
                return keras_build(self, iterator=iterator, data_batch=data_batch)
            if not _needs_a_batch(self):  # (5): no iterator made
                return keras_build(self, iterator=None, data_batch=data_batch)
            if not in_multi_worker_mode(strategy):
                return keras_build(self, iterator=iterator, data_batch=data_batch)
            for _, _, it in iterator:
                batch = next(it)
                data_batch = keras.tree.map_structure(lambda v: _local_part(strategy, v), batch)
                return keras_build(self, iterator=None, data_batch=data_batch)
            return keras_build(self, iterator=iterator, data_batch=data_batch)
        return _maybe_symbolic_build

    def wrap_reset(keras_reset):
        def reset(self):
            dropped = self._current_iterator  # pylint: disable=protected-access
            keras_reset(self)
            _kept_if_replaced(self, dropped)  # (5)
        return reset

    def wrap_enumerate(keras_enumerate):
        def _enumerate_iterator(self):
            seen = self._current_iterator  # pylint: disable=protected-access
            for step in keras_enumerate(self):
                seen = _kept_if_replaced(self, seen)  # (5): replaced between epochs
                yield step
            _kept_if_replaced(self, seen)
        return _enumerate_iterator

    def wrap_reduce(keras_reduce):
        def reduce_per_replica(values, strategy, reduction):
            resolved = reduction
            if reduction == "auto" and not isinstance(strategy, tf.distribute.TPUStrategy):
                resolved = "mean"
            if resolved != "mean" or not in_multi_worker_mode(strategy):
                return keras_reduce(values, strategy, reduction)
            return _mean_over_replicas(strategy, values)
        return reduce_per_replica

    def wrap_make_function(keras_make_function):
        def _make_function(self, step_function):
            strategy = self._distribute_strategy  # pylint: disable=protected-access
            function = keras_make_function(self, step_function)
            if self.run_eagerly:
                return function
            # (Written out, a step is traced in place: `jit_compile=True`, which
            # tables never take, keeps Keras's own loop and its XLA.)
            unroll = self.steps_per_execution > 1 and not self.jit_compile
            if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
                if unroll:
                    function = _unrolled_steps_function(self, step_function, function)
                return DistributedStepCalls(function)
            if (unroll and isinstance(strategy, tf.distribute.MirroredStrategy)
                    and strategy.num_replicas_in_sync > 1):
                return _unrolled_steps_function(self, step_function, function)
            return function
        return _make_function

    return all([install_fix(KERAS_MULTI_WORKER_FIX_VERSIONS, KERAS_MULTI_WORKER_ORIGINALS,
                            owner, name, wrap)
                for owner, name, wrap in ((cls, "_maybe_symbolic_build", wrap_build),
                                          (trainer, "reduce_per_replica", wrap_reduce),
                                          (cls, "_make_function", wrap_make_function),
                                          (trainer.TFEpochIterator, "reset", wrap_reset),
                                          (trainer.TFEpochIterator, "_enumerate_iterator",
                                           wrap_enumerate))])


def _mean_over_replicas(strategy, values):
    """A step's logs averaged over the replicas; traced, those of one dtype
    in one all-reduce (each collective is a round of messages every step)."""
    flat = keras.tree.flatten(values)
    if tf.executing_eagerly() or len(flat) < 2:
        return keras.tree.map_structure(
            lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None), values)
    by_dtype = {}
    for i, v in enumerate(flat):
        by_dtype.setdefault(strategy.experimental_local_results(v)[0].dtype, []).append(i)
    reduced = [None] * len(flat)
    for places in by_dtype.values():
        results = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.MEAN, [(flat[i], flat[i]) for i in places])
        for i, r in zip(places, results):
            reduced[i] = strategy.experimental_local_results(r)[0]
    return keras.tree.pack_sequence_as(values, reduced)


# The most steps written out in one traced function under the strategy: a
# step with tables is about 700 ops, and tracing took about 0.75 s a step
# (8 tables, `steps_per_execution` 8 / 32: 6 / 25 s before the first step),
# while more steps a call saved no CPU (docs/history.md). An execution of
# more steps calls these functions one after another.
UNROLLED_STEPS_MAX = 4


def _unrolled_steps_function(trainer, step_function, keras_function):
    """Keras's train / test function for `steps_per_execution` > 1 under a
    multi-replica strategy (`keras_function`, Keras's, takes non-iterators).

    Keras loops over the steps in a `tf.while_loop`, calling the one-step
    `tf.function` in a `tf.cond`. A collective's instance key is captured at
    call time, which TensorFlow cannot thread through control flow into a
    nested function ("You must feed a value for placeholder tensor
    'while/.../Placeholder'"), and a loop body traced once would reuse the
    keys. Here the steps are written out in one traced function, each traced
    in place: each collective gets its own key, and a step after the data ran
    out is skipped by a `tf.cond` (every worker agrees, as the distributed
    iterator's `get_next_as_optional` does). One function holds at most
    `UNROLLED_STEPS_MAX` steps; a longer execution calls them in turn
    (`function._kre_step_functions`) and returns its last step's logs."""
    trainer_module = _keras_tf_trainer()
    strategy = trainer.distribute_strategy

    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return trainer_module.reduce_per_replica(outputs, strategy, reduction="auto")

    one_step_on_data = trainer._autoconvert_optionals(one_step_on_data)  # pylint: disable=protected-access

    def steps_on_iterator(count):
        @tf.autograph.experimental.do_not_convert
        def multi_step_on_iterator(iterator):
            # As Keras's loop: the outputs' spec is known once a step is
            # traced (the first `tf.cond` branch traced is the step's).
            empty = tf.experimental.Optional.empty(None)
            outputs, inputs = empty, iterator.get_next_as_optional()
            for step in range(count):
                def has_next(inputs=inputs):
                    out = tf.experimental.Optional.from_value(
                        one_step_on_data(inputs.get_value()))
                    empty._element_spec = out.element_spec  # pylint: disable=protected-access
                    return out

                def no_next(outputs=outputs):
                    outputs._element_spec = empty._element_spec  # pylint: disable=protected-access
                    return outputs

                outputs = tf.cond(inputs.has_value(), has_next, no_next)
                if step + 1 < count:
                    inputs = tf.cond(inputs.has_value(), iterator.get_next_as_optional,
                                     lambda inputs=inputs: inputs)
            return outputs

        steps = tf.function(multi_step_on_iterator, reduce_retracing=True)
        steps._kre_steps = count  # pylint: disable=protected-access
        return steps

    full, rest = divmod(trainer.steps_per_execution, UNROLLED_STEPS_MAX)
    sizes = [UNROLLED_STEPS_MAX] * full + ([rest] if rest else [])
    functions = {size: steps_on_iterator(size) for size in set(sizes)}
    plan = [functions[size] for size in sizes]

    def function(iterator):
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return keras_function(iterator)  # (its steps are called eagerly, one by one)
        return last_step_logs(fn(iterator) for fn in plan)

    function._kre_step_functions = plan  # pylint: disable=protected-access
    return function


def last_step_logs(optional_outputs):
    """The logs of the last step that ran (the first empty one: the data ran
    out); `StopIteration` if no step ran."""
    last = None
    for outputs in optional_outputs:
        if not outputs.has_value():
            break
        last = outputs
    if last is None:
        raise StopIteration
    return last.get_value()


class DistributedStepCalls:
    """Keras's train / test function under a MultiWorkerMirroredStrategy,
    called on one distributed iterator step after step without tf.function's
    per-call work.

    Each call walks the iterator's `TypeSpec`, built anew, to find the traced
    function and flatten the iterator (about a third of a worker's Python
    time per step at global batch 4096). After Keras's first call on an
    iterator this calls that traced function directly (`_call_flat`),
    reading its captured inputs each call: the collectives' instance keys are
    fresh every step. Anything else goes to Keras's function.
    """

    def __init__(self, function):
        self._function = function
        plan = getattr(function, "_kre_step_functions", None)
        if plan is None:  # Keras's own function: its one traced function
            names = function.__code__.co_freevars
            cell = (function.__closure__[names.index("multi_step_on_iterator")]
                    if "multi_step_on_iterator" in names else None)
            plan = [cell.cell_contents] if cell is not None else []
        self._plan = plan  # the traced functions an execution calls, in order
        self._iterator = None  # a weak reference: the epoch's iterator
        self._calls = None

    def __call__(self, iterator):
        if self._calls is not None and self._iterator() is iterator:
            return last_step_logs(
                concrete._call_flat(flat, captured_inputs=concrete.captured_inputs)  # pylint: disable=protected-access
                for concrete, flat in self._calls)
        self._calls = None
        result = self._function(iterator)
        if isinstance(iterator, tf.distribute.DistributedIterator):
            traced = {id(step): self._traced(step, iterator) for step in self._plan}
            calls = [traced[id(step)] for step in self._plan]
            if calls and all(c is not None for c in calls):
                self._calls = calls
                self._iterator = weakref.ref(iterator)
        return result

    @staticmethod
    def _traced(step, iterator):
        """(`step`'s traced function just run, the iterator's tensors), or None."""
        from tensorflow.python.eager.polymorphic_function import tracing_compilation

        config = None
        if hasattr(step, "_variable_creation_config"):
            config = (step._no_variable_creation_config if step._created_variables  # pylint: disable=protected-access
                      else step._variable_creation_config)  # pylint: disable=protected-access
        if config is None:
            return None
        concrete = tracing_compilation.trace_function(args=(iterator,), kwargs={},
                                                      tracing_options=config)
        flat = concrete.function_type.unpack_inputs(concrete.function_type.bind(iterator))
        return concrete, flat


# Keras 3.15.1 gives a subclassed model a default SavedModel signature
# (`TFLayer._default_save_signature`) of float32 specs, whatever the inputs'
# dtypes. Tracing it, as `model.export` and `tf.saved_model.save` do, feeds
# float ids to our id layers, which refuse them, and the export fails
# ("references an 'untracked' resource"). The correction gives such a model
# no default signature when it holds our id layers (`ids_input_dtype`);
# `model.export` adds its own endpoint from its `input_signature`. Installed
# by `fix_subclassed_save_signature()` when `keras_rec_emb.layers` is imported.
KERAS_SAVE_SIGNATURE_FIX_VERSIONS = ("3.15.1",)
KERAS_SAVE_SIGNATURE_ORIGINALS = {}


def fix_subclassed_save_signature():
    """Installs the correction described above (`_keras_fixes.install_fix`)."""
    from keras.src.backend.tensorflow.layer import TFLayer
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    def wrap(keras_get):
        def _default_save_signature(self):
            symbolic = isinstance(self, Functional) or (
                isinstance(self, Sequential) and getattr(self, "_functional", None) is not None)
            if not symbolic and isinstance(self, keras.Model) and any(
                    getattr(layer, "ids_input_dtype", None)
                    for layer in self._flatten_layers(include_self=False)):  # pylint: disable=protected-access
                return None
            return keras_get(self)
        return _default_save_signature

    return install_fix(KERAS_SAVE_SIGNATURE_FIX_VERSIONS, KERAS_SAVE_SIGNATURE_ORIGINALS,
                       TFLayer, "_default_save_signature", wrap)


# -- Parameter-server variables (TensorFlow and Keras) -----------------------------


def keras_current_path():
    """Keras's current name-scope path: a `tf.variable_creator_scope` gets
    only the short `name`, the path names a variable alike in every worker.
    Used by `distribute/ps_variables`."""
    from keras.src.backend.common.name_scope import current_path

    return current_path()


def current_device_name():
    """The innermost `tf.device` scope, fully specified, or '' (no public
    reader). Used by `distribute/ps_variables`."""
    from tensorflow.python.eager import context

    return context.context().device_name


def variable_from_handle(handle, name, shape, dtype, trainable, synchronization,
                         aggregation, unique_id):
    """A `tf.Variable` over an existing, shared resource handle that never
    destroys it (the public `tf.Variable` owns an anonymous resource). Used by
    `distribute/ps_variables`."""
    from tensorflow.python.ops import handle_data_util, resource_variable_ops

    # The shape and dtype the handle carries into traced functions (what
    # `tf.Variable` sets on its own handles): without them a read inside
    # `tf.function` has an unknown shape.
    handle._handle_data = handle_data_util.create_handle_data(  # pylint: disable=protected-access
        tf.TensorShape(shape), tf.as_dtype(dtype))
    return resource_variable_ops.BaseResourceVariable(
        trainable=trainable, shape=shape, dtype=dtype, handle=handle, name=name,
        unique_id=unique_id, handle_name=name, synchronization=synchronization,
        aggregation=aggregation, in_graph_mode=False)


def constant_variable(value, name):
    """A non-trainable variable made without the creator scopes: a
    `tf.function` whose first trace makes one (even under `init_scope`)
    traces everything again."""
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.ResourceVariable(value, trainable=False, name=name)


# -- pyarrow ----------------------------------------------------------------------


def export_record_batch(batch, array_address, schema_address):
    """Exports `batch` as Arrow C structs at the given addresses: the public
    `__arrow_c_array__` gives PyCapsules, whose addresses Python cannot hand
    to a kernel. Used by `backend/tensorflow/data._Exports`."""
    batch._export_to_c(array_address, schema_address)  # pylint: disable=protected-access


def import_record_batch(array_address, schema_address):
    """Imports (and so releases) Arrow C structs: `export_record_batch`'s
    counterpart, for batches never consumed."""
    return pa.RecordBatch._import_from_c(  # pylint: disable=protected-access
        array_address, schema_address)


# -- confluent-kafka: in `keras_rec_emb._keras_fixes`, which `data/kafka.py` imports.


# -- Private hooks our classes override ---------------------------------------------

# {library base class: {hook: why we override it, and where}}.
OVERRIDDEN_HOOKS = {
    keras.optimizers.Optimizer: {
        "_var_key": "backend/tensorflow/optimizer.py: a table's variable is keyed by its table, "
                    "so Keras's slot lookup finds the table's slots",
        "_backend_update_step": "backend/tensorflow/optimizer.py: the TF backend's seam where "
                                "table gradients (IndexedSlices over keys) go to the "
                                "fused C++ kernel, the rest to Keras",
        "_apply_weight_decay": "backend/tensorflow/optimizer.py, AdamW: a table's decoupled weight "
                               "decay is applied by the kernel to the updated rows only",
        "_clip_gradients": "backend/tensorflow/optimizer.py: global_clipnorm counts a table's rows "
                           "without densifying them",
        "_all_reduce_sum_gradients": "backend/tensorflow/optimizer.py: outside a tf.distribute "
                                     "strategy the one-replica sum is skipped (its "
                                     "tf.custom_gradient kept every traced train step "
                                     "alive in TF's gradient registry)",
    },
    tf.data.Dataset: {
        "_inputs": "backend/tensorflow/data.WrappedDataset: reports the wrapped pipeline as its "
                   "input (an abstract method of every dataset)",
    },
    tf.saved_model.experimental.TrackableResource: {
        "_create_resource": "variables.EmbeddingTable: creates the C++ table (the "
                            "documented way to define a TrackableResource, so that "
                            "SavedModels re-create it on load)",
        "_destroy_resource": "variables.EmbeddingTable: a file-tier table releases the "
                             "lock on its folder when the Python table goes (the C++ "
                             "resource may outlive it in TF's function caches)",
    },
    Trackable: {
        "_serialize_to_tensors": "variables.EmbeddingTable, KafkaPosition (its base "
                                 "backend/tensorflow/data.PositionBase), distribute.ShardedEmbeddingTable: the state "
                                 "tf.train.Checkpoint saves",
        "_restore_from_tensors": "variables.EmbeddingTable, KafkaPosition (its base "
                                 "backend/tensorflow/data.PositionBase), distribute.ShardedEmbeddingTable: restores it",
    },
}


def exit_now(code):
    """`os._exit`: a running TensorFlow gRPC server can hold a normal exit."""

    os._exit(code)
