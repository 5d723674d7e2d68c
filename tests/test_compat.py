"""`backend/tensorflow/compat.py`: every private API entry works on the pinned stack, and no
other module of the package reaches past it."""

import ast
import functools
import importlib
import inspect
import pathlib
import re

import confluent_kafka
import keras
import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf

import keras_rec_emb
from keras_rec_emb import _keras_fixes
from keras_rec_emb.backend.tensorflow import compat as _compat

PACKAGE_DIR = pathlib.Path(keras_rec_emb.__file__).parent

# Spellings of private library API that only backend/tensorflow/compat.py may contain.
PRIVATE_PATTERNS = [
    r"tensorflow\.python", r"\bkeras\.src\b", r"__internal__", r"_export_to_c",
    r"_import_from_c", r"_flatten_layers", r"_track_variable", r"_get_variable_index",
    r"_use_weight_decay", r"[\"']_trainable_variables[\"']", r"\._variant_tensor",
    r"_GeneratorDataset", r"KafkaError\._", r"\._inputs\(",
    r"_maybe_symbolic_build", r"reduce_per_replica", r"_collective_all_reduce_multi_worker",
    r"_cross_device_ops", r"_launchers", r"_next_instance_key",
]


# Underscore names that are documented public API (namedtuple's methods).
PUBLIC_UNDERSCORE_NAMES = {"_asdict", "_replace", "_fields", "_make", "_field_defaults"}
_ATTR_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _attr_string(node):
    """The private name `getattr(x, "_name")` and its kin reach, or None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _ATTR_FUNCTIONS and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)):
        return node.args[1].value
    return None


def _defined_names(tree):
    """Private names a module defines: functions, classes, assigned names
    and attributes, arguments, imports."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.update((node.asname or node.name).split("."))
        elif isinstance(node, ast.Call) and _attr_string(node) and node.func.id == "setattr":
            out.add(_attr_string(node))
    return {n for n in out if _private(n)}


def _private_reads(tree):
    """(line, name) of every private attribute a module reads: `x._name`,
    `getattr(x, "_name")` and its kin."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) \
                and _private(node.attr):
            yield node.lineno, node.attr
        elif _attr_string(node) is not None:
            yield node.lineno, _attr_string(node)


def _class_body_names(tree):
    """(line, class, name) of every private name a class body defines."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            names = []
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [item.name]
            elif isinstance(item, ast.Assign):
                names = [t.id for t in item.targets if isinstance(t, ast.Name)]
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names = [item.target.id]
            for name in names:
                if _private(name):
                    yield item.lineno, node.name, name


@functools.cache
def library_private_names():
    """Private names TensorFlow's and Keras's own sources read or write as
    attributes (`x._name`, `"_name"`)."""
    pattern = re.compile(r"\.(_[A-Za-z]\w*)\b|[\"'](_[A-Za-z]\w*)[\"']")
    names = set()
    for root in (pathlib.Path(tf.__file__).parent / "python",
                 pathlib.Path(keras.__file__).parent / "src"):
        for path in root.rglob("*.py"):
            for a, b in pattern.findall(path.read_text(errors="replace")):
                names.add(a or b)
    return names


def private_api_uses(sources, library_names, declared=frozenset()):
    """Uses of private library API in `sources` ({file name: Python
    source}) that no pattern spelling a known name would catch:

    * a private attribute read (`x._name`, `getattr(x, "_name")`) that no
      module of `sources` defines: it belongs to another library's object;
    * a private name a class defines that the library reads (in
      `library_names`) and that `sources` never use otherwise (nor declare
      in `declared`): a hook the library calls on our object by duck
      typing, as `tf.GradientTape` reads `_should_act_as_resource_variable`.
    """
    trees = {name: ast.parse(text) for name, text in sources.items()}
    defined = set().union(*map(_defined_names, trees.values())) | {
        pathlib.Path(name).stem for name in sources}
    reads = {name: list(_private_reads(tree)) for name, tree in trees.items()}
    used = {attr for found in reads.values() for _, attr in found}
    out = []
    for name, found in reads.items():
        out += [f"{name}:{line}: reads {attr}" for line, attr in found
                if attr not in defined and attr not in PUBLIC_UNDERSCORE_NAMES]
    for name, tree in trees.items():
        out += [f"{name}:{line}: {cls}.{attr} is a hook the library reads"
                for line, cls, attr in _class_body_names(tree)
                if attr in library_names and attr not in used and attr not in declared]
    return out


def _package_modules():
    """Every Python module of the package (not the compiled library)."""
    names = [".".join(("keras_rec_emb", *p.relative_to(PACKAGE_DIR).with_suffix("").parts))
             for p in sorted(PACKAGE_DIR.rglob("*.py"))]
    return [importlib.import_module(n.removesuffix(".__init__")) for n in names]


# The modules that may spell private library API: the TensorFlow backend's
# compat, its TensorFlow-free part, and the JAX backend's `_jax_private`.
_PRIVATE_API_MODULES = ("backend/tensorflow/compat.py", "_keras_fixes.py",
                        "backend/jax/_jax_private.py")


def test_no_module_but_compat_uses_private_library_api():
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.relative_to(PACKAGE_DIR).as_posix() in _PRIVATE_API_MODULES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in PRIVATE_PATTERNS:
                if re.search(pattern, line):
                    offenders.append(f"{path.relative_to(PACKAGE_DIR)}:{number}: {line.strip()}")
    assert not offenders, "private API outside backend/tensorflow/compat.py:\n" + "\n".join(offenders)


def test_no_module_but_compat_reads_private_attributes_or_defines_library_hooks():
    """Beyond the known spellings: a private attribute the package never
    defines is another library's; a private name a class of ours defines
    only for the library to read is a hook. Both go through backend/tensorflow/compat.py
    (hooks of library subclasses are declared in OVERRIDDEN_HOOKS)."""
    sources = {str(p.relative_to(PACKAGE_DIR)): p.read_text()
               for p in sorted(PACKAGE_DIR.rglob("*.py"))
               if p.relative_to(PACKAGE_DIR).as_posix() not in _PRIVATE_API_MODULES}
    declared = {name for hooks in _compat.OVERRIDDEN_HOOKS.values() for name in hooks}
    offenders = private_api_uses(sources, library_private_names(), declared)
    assert not offenders, "private API outside backend/tensorflow/compat.py:\n" + "\n".join(offenders)


def test_the_private_api_scan_finds_reads_and_duck_typed_hooks():
    """The uses the spelling patterns once missed are found: a loaded
    SavedModel's `_misc_assets`, and a variable-like class's
    `_should_act_as_resource_variable` and `_unique_id`; our own private
    names are not."""
    sources = {
        "served.py": 'def tables(loaded):\n    return getattr(loaded, "_misc_assets", [])\n',
        "face.py": ("class Face:\n    _should_act_as_resource_variable = True\n\n"
                    "    @property\n    def _unique_id(self):\n        raise TypeError\n"),
        "own.py": ("class Own:\n    def _step(self):\n        return self._n\n\n"
                   "    def run(self):\n        self._n = 1\n        return self._step()\n"),
    }
    found = private_api_uses(sources, library_private_names())
    assert found == ["served.py:2: reads _misc_assets",
                     "face.py:2: Face._should_act_as_resource_variable is a hook the library "
                     "reads",
                     "face.py:5: Face._unique_id is a hook the library reads"], found
    # `_step` and `_name` are names the library uses too, but here the module's own.
    assert {"_step", "_name"} <= library_private_names()


def test_declared_hooks_exist_on_the_pinned_bases():
    for base, hooks in _compat.OVERRIDDEN_HOOKS.items():
        for name, why in hooks.items():
            assert callable(getattr(base, name, None)), f"{base.__name__}.{name} is gone"
            assert why


def _ours(cls):
    return cls.__module__.startswith("keras_rec_emb")


def test_every_overridden_private_hook_is_declared():
    """Private methods our classes (mixins included, as combined with a
    library class) define over a library base's, each declared in
    _compat.OVERRIDDEN_HOOKS under one of the class's library bases."""
    declared = {(base, name) for base, hooks in _compat.OVERRIDDEN_HOOKS.items()
                for name in hooks}
    undeclared, seen = set(), set()
    for module in _package_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            library = [b for b in cls.__mro__ if not _ours(b) and b is not object]
            for owner in (c for c in cls.__mro__ if _ours(c)):
                for name, value in vars(owner).items():
                    if not (name.startswith("_") and not name.startswith("__")
                            and callable(value)):
                        continue
                    bases = [b for b in library if name in vars(b)]
                    if not bases:
                        continue
                    seen.add((owner.__qualname__, name))
                    if not any(issubclass(cls, base) and (base, name) in declared
                               for base in _compat.OVERRIDDEN_HOOKS):
                        undeclared.add(f"{owner.__module__}.{owner.__qualname__}.{name} "
                                       f"(overrides {bases[0].__module__}."
                                       f"{bases[0].__qualname__}.{name})")
    assert not undeclared, "declare these in _compat.OVERRIDDEN_HOOKS:\n" + \
        "\n".join(sorted(undeclared))
    # The optimizer mixin's hooks, the table's and the datasets' were seen.
    assert {("TableOptimizer", "_backend_update_step"), ("EmbeddingTable", "_create_resource"),
            ("PositionBase", "_serialize_to_tensors"), ("WrappedDataset", "_inputs")} <= seen


def test_variable_accessed_is_seen_by_the_tape():
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        _compat.variable_accessed(v)
    assert [w.ref() for w in tape.watched_variables()] == [v.ref()]


def test_op_def_names_an_ops_arguments():
    """The group lookup's registration names its inputs and outputs (what
    `_op_args` reads them by); unknown op types give None."""
    op_def = _compat.op_def("KRE>GroupLookup")
    assert [a.name for a in op_def.input_arg] == ["tables", "dense_params", "ids",
                                                  "row_splits", "weights"]
    assert [(a.name, a.number_attr) for a in op_def.output_arg] == [
        ("outputs", "num_features"), ("unique_ids", "num_params"), ("inverse", "num_features")]
    assert _compat.op_def("NoSuchOpAnywhere") is None


def test_dataset_entries():
    base = tf.data.Dataset.range(4)
    mapped = base.map(lambda x: x * 2)
    assert _compat.dataset_variant(mapped).dtype == tf.variant
    assert _compat.dataset_inputs(mapped) == [base]
    assert issubclass(_compat.GeneratorDataset, tf.data.Dataset)

    state = {}

    def init(start):
        state["next"] = int(start)
        return np.int64(0)

    def step(_):
        if state["next"] >= 3:
            raise StopIteration
        state["next"] += 1
        return np.int64(state["next"])

    ds = _compat.GeneratorDataset(
        (tf.constant(0, tf.int64),),
        lambda s: tf.numpy_function(init, [s], tf.int64),
        lambda i: tf.reshape(tf.numpy_function(step, [i], tf.int64), []),
        lambda i: tf.constant(0, tf.int64),
        tf.TensorSpec([], tf.int64))
    assert [int(x) for x in ds] == [1, 2, 3]


def test_trackable_state_round_trips_a_checkpoint(tmp_path):
    class Counter(_compat.Trackable):
        def __init__(self, n):
            self.n = n

        def _serialize_to_tensors(self):
            return {"n": tf.constant(self.n, tf.int64)}

        def _restore_from_tensors(self, restored_tensors):
            self.n = int(restored_tensors["n"])

    path = tf.train.Checkpoint(c=Counter(7)).write(str(tmp_path / "ckpt"))
    restored = Counter(0)
    tf.train.Checkpoint(c=restored).read(path).assert_consumed()
    assert restored.n == 7


def test_keras_layer_entries():
    inner = keras.layers.Dense(2, name="inner")
    block = keras.Sequential([inner], name="block")
    model = keras.Sequential([keras.Input((3,)), block])
    assert inner in list(_compat.flatten_layers(model))
    assert inner not in model.layers

    class Adopting(keras.layers.Layer):
        def build(self, input_shape):
            self.adopted = tf.Variable(np.ones(3, np.float32), name="adopted")
            _compat.track_variable(self, self.adopted)

        def call(self, x):
            return x * self.adopted

    layer = Adopting()
    layer.build((None, 3))
    assert [w is layer.adopted for w in layer.trainable_weights] == [True]

    signature = _keras_fixes.input_specs(model)
    flat = tf.nest.flatten(signature)
    assert len(flat) == 1 and list(flat[0].shape) == [None, 3]


def test_optimizer_entries():
    a = keras.Variable(np.zeros(2, np.float32), name="a")
    b = keras.Variable(np.zeros(2, np.float32), name="bias_b")
    opt = keras.optimizers.AdamW(weight_decay=0.1)
    assert _compat.built_variables(opt) == []
    opt.exclude_from_weight_decay(var_names=["bias"])
    opt.build([a, b])
    assert [_keras_fixes.variable_index(opt, v) for v in (a, b)] == [0, 1]
    assert _compat.uses_weight_decay(opt, a) and not _compat.uses_weight_decay(opt, b)
    assert [v.name for v in _compat.built_variables(opt)] == ["a", "bias_b"]


def test_arrow_c_export_round_trip():
    batch = pa.record_batch({"x": pa.array([1, 2, 3], pa.int64()),
                             "s": pa.array(["a", None, "c"])})
    memory = np.zeros((80 + 72) // 8, np.uint64)  # ArrowArray, then ArrowSchema
    address = memory.ctypes.data
    _compat.export_record_batch(batch, address, address + 80)
    assert memory[8] != 0  # the ArrowArray's release callback is set
    back = _compat.import_record_batch(address, address + 80)
    assert back.equals(batch)
    assert memory[8] == 0  # moved out: released by pyarrow from now on


def test_kafka_error_codes():
    codes = {_keras_fixes.KAFKA_TRANSPORT, _keras_fixes.KAFKA_PARTITION_EOF}
    assert len(codes) == 2 and all(isinstance(c, int) and c < 0 for c in codes)
    error = confluent_kafka.KafkaError(_keras_fixes.KAFKA_PARTITION_EOF)
    assert error.code() == _keras_fixes.KAFKA_PARTITION_EOF
    assert "eof" in error.name().lower()


@pytest.mark.parametrize("module", ["keras_rec_emb.backend.tensorflow.data",
                                    "keras_rec_emb.backend.tensorflow.variables"])
def test_modules_use_compat(module):
    assert importlib.import_module(module)._compat is _compat


def test_in_xla_context():
    seen = []

    def probe(x):
        seen.append(_compat.in_xla_context())
        return x + 1

    tf.function(probe, jit_compile=True)(tf.constant(1.0))
    tf.function(probe)(tf.constant(1.0))
    probe(tf.constant(1.0))
    assert seen == [True, False, False]


def test_child_layers_in_tracking_order():
    inner = keras.layers.Dense(2, name="b_dense")

    class Holder(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.first = keras.layers.Dense(1, name="z_dense")
            self.second = inner

    assert [layer.name for layer in _compat.child_layers(Holder())] == ["z_dense", "b_dense"]


def test_keras_multi_worker_fix_is_installed_for_the_pinned_keras_only_where_needed():
    """keras-team/keras#20585: the correction is installed for the pinned
    Keras (listed), wraps exactly the two faulty spots, which are still in
    Keras's code (an upgrade that mends them fails here: drop the entry), and
    leaves one process's and MirroredStrategy's log reduction to Keras's own
    code (their symbolic build: the test after this one)."""
    import inspect

    from keras.src.backend.tensorflow import trainer

    assert keras.__version__ in _compat.KERAS_MULTI_WORKER_FIX_VERSIONS
    assert _compat.fix_keras_multi_worker()  # idempotent: already installed on import
    originals = _compat.KERAS_MULTI_WORKER_ORIGINALS
    assert trainer.reduce_per_replica is not originals["reduce_per_replica"]
    assert trainer.TensorFlowTrainer._maybe_symbolic_build is not originals[
        "_maybe_symbolic_build"]
    reduce_source = inspect.getsource(originals["reduce_per_replica"])
    assert 'strategy.reduce("MEAN", v, axis=0)' in reduce_source
    build_source = " ".join(inspect.getsource(originals["_maybe_symbolic_build"]).split())
    assert 'self.distribute_strategy.reduce( "MEAN", maybe_distributed_data_batch' in build_source
    # The direct calls on an epoch's distributed iterator: Keras's function
    # still calls its tf.function `multi_step_on_iterator` on the iterator and
    # returns the Optional's value, and TensorFlow still calls a traced
    # function as DistributedStepCalls does.
    from tensorflow.python.eager.polymorphic_function import (
        concrete_function,
        polymorphic_function,
        tracing_compilation,
    )

    assert trainer.TensorFlowTrainer._make_function is not originals["_make_function"]
    make_source = " ".join(inspect.getsource(originals["_make_function"]).split())
    assert "opt_outputs = multi_step_on_iterator(iterator)" in make_source
    assert "return opt_outputs.get_value()" in make_source
    # Several steps an execution: Keras still loops over them in a
    # tf.while_loop calling its one-step function in a tf.cond (which the
    # strategy's collectives fail in; `_unrolled_steps_function` writes the
    # steps out instead, with the same step, reduction and conversions).
    assert "tf.while_loop(" in make_source and "self.steps_per_execution" in make_source
    assert ('outputs = self.distribute_strategy.run(step_function, args=(data,)) '
            'outputs = reduce_per_replica( outputs, self.distribute_strategy, '
            'reduction="auto", )') in make_source
    assert "one_step_on_data = self._autoconvert_optionals(one_step_on_data)" in make_source
    call_source = " ".join(inspect.getsource(tracing_compilation.call_function).split())
    assert ("function._call_flat( # pylint: disable=protected-access flat_inputs, "
            "captured_inputs=function.captured_inputs )") in call_source
    assert hasattr(concrete_function.ConcreteFunction, "_call_flat")
    function_source = inspect.getsource(polymorphic_function.Function._call)
    for name in ("_no_variable_creation_config", "_variable_creation_config",
                 "_created_variables"):
        assert f"self.{name}" in function_source

    logs = {"loss": tf.constant(2.0), "mae": tf.constant([1.0, 3.0])}
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(loss="mse")
    model.make_train_function()  # one process: Keras's own function
    assert not isinstance(model.train_function, _compat.DistributedStepCalls)
    for strategy in (tf.distribute.get_strategy(), tf.distribute.MirroredStrategy(["/cpu:0"])):
        assert not _compat.in_multi_worker_mode(strategy)
        for reduction in ("auto", "mean", "sum", "first", "concat"):
            got = trainer.reduce_per_replica(logs, strategy, reduction)
            want = originals["reduce_per_replica"](logs, strategy, reduction)
            for key in logs:
                np.testing.assert_array_equal(got[key], want[key])
    assert not _compat.in_multi_worker_mode(None)
    # And fit / evaluate / predict in one process and under MirroredStrategy
    # go through Keras's own symbolic build (tests/distribute/test_mirrored.py,
    # tests/test_keras_citizen.py); tests/distribute/test_multi_worker.py
    # runs them on 2 and 3 worker processes.


def test_keras_sequential_fix_gives_id_layers_an_int_input_and_others_keras_own():
    """Keras's `Sequential.build` still types its automatic InputLayer from
    the first layer's compute_dtype (an upgrade that changes the rule fails
    here: read it again); our id layers get their `ids_input_dtype`,
    every other first layer Keras's float32."""
    import inspect

    from keras.src.models.sequential import Sequential

    assert keras.__version__ in _keras_fixes.KERAS_SEQUENTIAL_FIX_VERSIONS
    assert _keras_fixes.fix_sequential_ids_input()  # idempotent: installed on import
    assert Sequential.build._kre_fix
    original = _keras_fixes.KERAS_SEQUENTIAL_ORIGINALS["build"]
    assert Sequential.build is not original
    source = " ".join(inspect.getsource(original).split())
    assert "dtype = self._layers[0].compute_dtype" in source
    plain = keras.Sequential([keras.layers.Dense(2)])
    plain.build((None, 3))
    assert plain.inputs[0].dtype == "float32"
    ids = keras.Sequential([keras_rec_emb.layers.EmbeddingVariable(2, key_dtype="int32")])
    ids.build((None, 3))
    assert ids.inputs[0].dtype == "int32"


def test_in_symbolic_build_only_inside_keras_shape_inference():
    seen = []

    def fn(x):
        seen.append(_compat.in_symbolic_build())
        return x

    keras.src.backend.compute_output_spec(fn, keras.KerasTensor((2, 3)))
    fn(tf.constant([1.0]))
    tf.function(fn)(tf.constant([1.0]))
    assert seen == [True, False, False]


def test_keras_save_signature_fix_for_subclassed_models_with_id_layers():
    """Keras still builds a subclassed model's default save signature from
    `self.input_dtype` (float32); ours then has none, others keep Keras's."""
    import inspect

    from keras.src.backend.tensorflow.layer import TFLayer

    from tests._model_forms import ChainModel

    assert keras.__version__ in _compat.KERAS_SAVE_SIGNATURE_FIX_VERSIONS
    assert _compat.fix_subclassed_save_signature()  # idempotent: installed on import
    original = _compat.KERAS_SAVE_SIGNATURE_ORIGINALS["_default_save_signature"]
    assert TFLayer.__dict__["_default_save_signature"].fget is not original
    assert "tf.TensorSpec(s, self.input_dtype)" in " ".join(inspect.getsource(original).split())
    ours = ChainModel([keras_rec_emb.layers.EmbeddingVariable(2, combiner="sum")])
    plain = ChainModel([keras.layers.Dense(2)])
    for model in (ours, plain):
        model(np.ones((2, 3), np.int64 if model is ours else np.float32))
    assert ours._default_save_signature is None
    assert plain._default_save_signature is not None
    functional_in = keras.Input((3,), dtype="int64")
    functional = keras.Model(functional_in, keras_rec_emb.layers.EmbeddingVariable(
        2, combiner="sum")(functional_in))
    assert functional._default_save_signature is not None


def test_resolve_training_reads_none_as_a_recording_tape():
    assert _compat.resolve_training(None) is False
    assert _compat.resolve_training(True) is True and _compat.resolve_training(False) is False
    with tf.GradientTape():
        assert _compat.resolve_training(None) is True
        assert _compat.resolve_training(False) is False

    @tf.function
    def traced():
        with tf.GradientTape():
            inside = _compat.resolve_training(None)
        return tf.constant(inside), tf.constant(_compat.resolve_training(None))

    assert [bool(v) for v in traced()] == [True, False]


def test_functional_graph_hook_runs_each_real_graph_run_inside_its_context():
    """Installed for the pinned Keras (on import): a Functional model's call
    runs its graph inside the context, given the model and its flattened
    inputs; Keras's symbolic pass (KerasTensors) does not; the nodes come in
    the order the call runs them."""
    from keras.src.models.functional import Functional

    assert _compat.hook_functional_graph(None)  # idempotent: installed on import
    assert Functional._run_through_graph._kre_hook  # pylint: disable=protected-access
    a, b = keras.Input(shape=(2,)), keras.Input(shape=(2,))
    dense = keras.layers.Dense(1)
    model = keras.Model([a, b], dense(keras.layers.Add()([a, b])))
    assert [type(n.operation).__name__ for n in _compat.functional_nodes(model)] == [
        "Add", "Dense"]
    from keras_rec_emb.backend.tensorflow import model_fusion as _model_fusion

    seen = []
    original = _model_fusion._ModelCall.__init__  # pylint: disable=protected-access

    def spy(self, model_, flat):
        seen.append((model_, len(flat)))
        original(self, model_, flat)

    _model_fusion._ModelCall.__init__ = spy  # pylint: disable=protected-access
    try:
        model([np.ones((1, 2), "float32")] * 2)
        model.compute_output_spec([keras.KerasTensor((1, 2))] * 2)
    finally:
        _model_fusion._ModelCall.__init__ = original  # pylint: disable=protected-access
    assert seen == [(model, 2)]


def test_under_a_strategy_no_iterator_is_made_for_a_built_model_and_dropped_ones_are_kept_a_while(
        monkeypatch):
    """(5) of the Keras fix: under a strategy Keras's `fit` / `evaluate` /
    `predict` each made a distributed iterator for the symbolic build, took a
    batch and dropped it while its MultiDeviceIterator fetched the next
    (TensorFlow's teardown then can crash the process); an epoch's iterator
    is dropped the same way when the next epoch begins. Once the model, its
    metrics and loss are built, no iterator is made for the build (one fewer
    than Keras's own code makes, the same evaluation); every distributed
    iterator Keras drops is kept a while (the build's, each epoch's), then
    released; no plain iterator is kept."""
    from keras.src.backend.tensorflow import trainer

    made = []
    get_iterator = trainer.TFEpochIterator._get_iterator
    monkeypatch.setattr(trainer.TFEpochIterator, "_get_iterator",
                        lambda self: made.append(self) or get_iterator(self))
    kept = _compat._DROPPED_ITERATORS
    monkeypatch.setattr(_compat, "_DROPPED_ITERATORS", type(kept)())
    kept = _compat._DROPPED_ITERATORS
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert not kept  # one process: plain iterators, not kept
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    # The build's; the first epoch's (consumed to its last step when Keras
    # made the next); that next one (never read: the second epoch makes its
    # own); the second epoch's.
    assert len(kept) == 4
    assert all(isinstance(it, tf.distribute.DistributedIterator) for _, it in kept)
    assert len({id(it) for _, it in kept}) == 4

    def calls(fn):
        del made[:]
        result = fn()
        return len(made), result

    ours, got = calls(lambda: model.evaluate(x, y, batch_size=4, verbose=0))
    with monkeypatch.context() as keras_own:
        keras_own.setattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build",
                          _compat.KERAS_MULTI_WORKER_ORIGINALS["_maybe_symbolic_build"])
        theirs, want = calls(lambda: model.evaluate(x, y, batch_size=4, verbose=0))
    assert ours == theirs - 1
    assert got == want
    ours_predict, _ = calls(lambda: model.predict(x, batch_size=4, verbose=0))
    assert ours_predict == ours
    # At most _KEEP_DROPPED_MAX; none once older than _KEEP_DROPPED_S.
    assert len(kept) == _compat._KEEP_DROPPED_MAX
    monkeypatch.setattr(_compat, "_KEEP_DROPPED_S", 0.0)
    model.evaluate(x, y, batch_size=4, verbose=0)
    assert len(kept) == 1
