"""The one-model protocol of parameter-server variables, in one process:
the local CPU plays PS task 0 (`/job:localhost`), the process plays the
chief and then other workers. The cluster tests run it across processes
(test_ps_one_model.py, test_ps_failover.py)."""

import uuid

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import compat as _compat
from keras_rec_emb.distribute import ps_variables

PS = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.fixture
def as_worker(monkeypatch):
    """Registers this process as worker `task` of a one-task cluster."""
    # Restored after the test: variables are this process's own again.
    monkeypatch.setattr(ps_variables, "_cluster", None)

    def register(task, timeout=10.0):
        ps_variables.register(1, task, timeout, job="localhost")

    return register


def _model(name, units=3):
    x = keras.Input((2,))
    model = keras.Model(x, keras.layers.Dense(units, name=name)(x))
    model.compile(optimizer=kre.optimizers.SGD(0.1, momentum=0.5, name=f"{name}_sgd"),
                  loss="mse")
    return model


def test_workers_build_one_model_the_chief_initializes(as_worker):
    name = f"shared_{uuid.uuid4().hex[:8]}"
    as_worker(0)
    with kre.distribute.parameter_servers([PS]):
        chief = _model(name)
    kernel = chief.get_layer(name).kernel
    assert kernel.value.device == PS
    chief.fit(np.ones((4, 2)), np.ones((4, 3)), verbose=0)
    # Momentum slots beside their variable, shared too.
    assert {v.value.device for v in chief.optimizer.variables} == {PS}
    trained = keras.ops.convert_to_numpy(kernel)

    as_worker(1)  # another worker: finds the chief's values, assigns none
    with kre.distribute.parameter_servers([PS]):
        other = _model(name)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(other.get_layer(name).kernel),
                                  trained)
    other.fit(np.ones((4, 2)), np.zeros((4, 3)), verbose=0)
    # One model: the chief reads the other worker's update and step.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(kernel),
                                  keras.ops.convert_to_numpy(other.get_layer(name).kernel))
    assert int(chief.optimizer.iterations) == int(other.optimizer.iterations) == 2
    # A restarted chief joins: the trained values stay.
    as_worker(0)
    with kre.distribute.parameter_servers([PS]):
        again = _model(name)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(again.get_layer(name).kernel),
                                  keras.ops.convert_to_numpy(kernel))
    # Metrics (variables synchronized on read) are each worker's own.
    for mine, theirs in zip(chief.metrics_variables, other.metrics_variables):
        assert mine.path == theirs.path
        mine.assign(np.full(mine.shape, 123.0))
        assert not np.all(keras.ops.convert_to_numpy(theirs) == 123.0), mine.path


def test_a_worker_waits_for_the_chief_in_bounded_time(as_worker):
    name = f"never_{uuid.uuid4().hex[:8]}"
    as_worker(1, timeout=0.5)
    with pytest.raises(TimeoutError, match=rf"kre_ps/{name}/kernel.*chief, worker 0"):
        with kre.distribute.parameter_servers([PS]):
            _model(name)


def test_another_shape_under_the_same_name_is_refused(as_worker):
    name = f"shape_{uuid.uuid4().hex[:8]}"
    as_worker(0)
    with kre.distribute.parameter_servers([PS]):
        _model(name, units=3)
    with pytest.raises(ValueError, match=r"has shape \(2, 3\).*shape \(2, 4\)"):
        with kre.distribute.parameter_servers([PS]):
            _model(name, units=4)


def test_without_a_cluster_variables_stay_local():
    with kre.distribute.parameter_servers(["/cpu:0"]):
        model = _model(f"local_{uuid.uuid4().hex[:8]}")
    assert not model.get_layer(model.layers[-1].name).kernel.value.handle.device.startswith(
        "/job:ps")
    assert ps_variables.cluster() is None


def test_compat_entries_for_shared_variables():
    shared = f"compat_{uuid.uuid4().hex[:8]}"
    handles = [tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2], container="",
                                      shared_name=shared) for _ in range(2)]
    a, b = (_compat.variable_from_handle(h, "v", [2], tf.float32, True,
                                         tf.VariableSynchronization.AUTO,
                                         tf.VariableAggregation.NONE, f"{shared}/{i}")
            for i, h in enumerate(handles))
    a.assign([1.0, 2.0])
    np.testing.assert_array_equal(b.numpy(), [1.0, 2.0])  # one resource, found by name
    del a  # the Python object goes, the resource stays
    np.testing.assert_array_equal(b.numpy(), [1.0, 2.0])

    @tf.function
    def read():
        return b + 0.0

    assert read.get_concrete_function().structured_outputs.shape == [2]
    with tf.device("/cpu:0"):
        assert _compat.current_device_name().endswith("device:CPU:0")
    seen = []

    class Probe(keras.layers.Layer):
        def build(self, input_shape):
            seen.append(_compat.keras_current_path())

        def call(self, x):
            return x

    Probe(name="probe_layer")(keras.Input((1,)))
    assert seen == ["probe_layer"]
