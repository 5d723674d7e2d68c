"""Optimizer rules are declared by name once (`keras_rec_emb._update_rules`)
and the sparse-apply kernel checks the names it receives: a reordered or
misnamed hyper-parameter or slot list fails with InvalidArgument instead of
training wrong."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_rec_emb as kre
from keras_rec_emb.backend.tensorflow import ops as _ops
from keras_rec_emb import _update_rules as rules
from keras_rec_emb.backend.tensorflow.variables import EmbeddingTable

DIM = 4
_SCALAR_SLOTS = {"beta1_power", "beta2_power", "decay_period"}


def _table(slots):
    table = EmbeddingTable(DIM, "int64", np.zeros((2, DIM), np.float32), name="rules")
    for s in slots:
        table.add_slot(s, 0.5, width=1 if s in _SCALAR_SLOTS else None)
    return table


def _apply(table, rule, names, slots, values=None):
    values = [0.1] * len(names) if values is None else values
    return _ops.sparse_apply(table.handle, tf.constant([1, 2], tf.int64),
                             tf.ones([2, DIM]), rule, dict(zip(names, values)), 1, slots)


def _hyper(rule):
    # Values every rule accepts; flags (amsgrad, nesterov, ...) off.
    return [0.0 if n in ("amsgrad", "nesterov", "use_nesterov", "apply_sparse_rmsprop",
                         "decay", "l1", "l2_shrinkage") else 0.5 for n in rule.hparam_names]


@pytest.mark.parametrize("name", sorted(rules.RULES))
def test_the_declared_names_are_the_kernels(name):
    rule = rules.RULES[name]
    table = _table(rule.slots)
    before = table.export()["values"] if table.size() else None
    _apply(table, name, rule.hparam_names, rule.slots, _hyper(rule))
    assert before is None and table.size() == 2
    assert np.all(np.isfinite(table.export()["values"]))


@pytest.mark.parametrize("name", sorted(rules.RULES))
def test_reordered_or_renamed_hyper_parameters_fail_loudly(name):
    rule = rules.RULES[name]
    table = _table(rule.slots)
    names = list(rule.hparam_names)
    swapped = names[:]
    swapped[0], swapped[-1] = swapped[-1], swapped[0]
    renamed = names[:-1] + ["not_" + names[-1]]
    for bad in (swapped, renamed):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=f"rule '{name}' takes hyper-parameters"):
            _apply(table, name, bad, rule.slots)
    assert table.size() == 0  # nothing was applied


@pytest.mark.parametrize("name", [n for n, r in sorted(rules.RULES.items()) if r.slots])
def test_reordered_or_renamed_slots_fail_loudly(name):
    rule = rules.RULES[name]
    table = _table(rule.slots + ("other",))
    renamed = ("other",) + rule.slots[1:]
    cases = [renamed] + ([rule.slots[::-1]] if len(rule.slots) > 1 else [])
    for bad in cases:
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"rule '{name}' takes slots"):
            _apply(table, name, rule.hparam_names, list(bad), _hyper(rule))


def test_the_extra_slot_follows_its_flag():
    adam = rules.RULES["adam"]
    hyper = dict(zip(adam.hparam_names, [0.1] * 7))
    assert adam.slot_names(dict(hyper, amsgrad=1.0)) == ("momentum", "velocity", "velocity_hat")
    assert adam.slot_names(dict(hyper, amsgrad=0.0)) == ("momentum", "velocity")


def test_python_side_names_missing_and_unexpected_hyper_parameters():
    with pytest.raises(ValueError, match=r"missing \['epsilon'\], unexpected \['eps'\]"):
        rules.RULES["adagrad"].ordered({"learning_rate": 0.1, "decay": 0.0, "eps": 1e-7})


def test_a_reordered_spec_fails_a_fit_instead_of_training_wrong(monkeypatch):
    """What the check is for: a spec whose order disagrees with the kernel's
    (here Adagrad's hyper-parameters swapped in the declaration) stops the
    first training step with an error naming the rule."""
    inputs = keras.Input((2,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(
        kre.layers.EmbeddingVariable(DIM, combiner="sum")(inputs)))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    x, y = np.array([[1, 2], [3, 4]]), np.zeros((2, 1), np.float32)
    model.fit(x, y, epochs=1, verbose=0)  # the declared spec trains
    # Declare the two common names in the other order: values follow the
    # declaration, so the kernel would read the decay as the learning rate;
    # it refuses the names instead.
    monkeypatch.setattr(rules, "COMMON_HPARAMS", ("decay", "learning_rate"))
    model.compile(optimizer=kre.optimizers.Adagrad(0.1), loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="rule 'adagrad' takes hyper-parameters"):
        model.fit(x, y, epochs=1, verbose=0)
