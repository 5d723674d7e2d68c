"""The update rules of the fused sparse-apply kernel, declared by name.

One entry per rule of `KRE>TableSparseApply` (csrc/kernels/apply_kernels.cc):
its hyper-parameters in the layout of the kernel's `hyper` vector, and the
table slots it reads, in order. The kernel checks the names it receives
against its own, so a reordered or renamed list fails with InvalidArgument
instead of training wrong.
"""

from typing import NamedTuple

# Every rule starts with these: the learning rate and the decoupled weight
# decay factor (weight_decay * learning_rate), which the optimizer base fills.
COMMON_HPARAMS = ("learning_rate", "decay")


class Rule(NamedTuple):
    """One kernel rule: `hparams` after `COMMON_HPARAMS`, `slots` in order,
    and `extra_slot` (slot, flag): a slot passed only when hyper-parameter
    `flag` is non-zero (Adam's `velocity_hat` with `amsgrad`)."""

    name: str
    hparams: tuple
    slots: tuple
    extra_slot: tuple = None

    @property
    def hparam_names(self):
        return COMMON_HPARAMS + self.hparams

    def ordered(self, hyper):
        """The values of dict `hyper` in the kernel's order; a ValueError
        names missing or unexpected names."""
        names = self.hparam_names
        if set(hyper) != set(names):
            raise ValueError(
                f"rule {self.name!r} takes hyper-parameters {names}. Received: "
                f"{tuple(hyper)} (missing {sorted(set(names) - set(hyper))}, "
                f"unexpected {sorted(set(hyper) - set(names))})")
        return [hyper[n] for n in names]

    def slot_names(self, hyper):
        """The slots the kernel reads, given the rule's hyper-parameters."""
        if self.extra_slot is not None and float(hyper[self.extra_slot[1]]):
            return self.slots + (self.extra_slot[0],)
        return self.slots


_FTRL = ("learning_rate_power", "l1", "l2_plus_beta", "l2_shrinkage")

RULES = {r.name: r for r in (
    Rule("sgd", (), ()),
    Rule("momentum", ("momentum", "nesterov"), ("momentum",)),
    Rule("adagrad", ("epsilon",), ("accumulator",)),
    Rule("adam", ("alpha", "beta_1", "beta_2", "epsilon", "amsgrad"), ("momentum", "velocity"),
         extra_slot=("velocity_hat", "amsgrad")),
    Rule("ftrl", _FTRL, ("accumulator", "linear")),
    Rule("ftrl_group", _FTRL, ("accumulator", "linear")),
    Rule("adam_async", ("beta_1", "beta_2", "epsilon", "use_nesterov", "apply_sparse_rmsprop"),
         ("momentum", "velocity", "beta1_power", "beta2_power")),
    Rule("adagrad_decay", ("epsilon", "decay_rate", "baseline", "period"),
         ("accumulator", "decay_period")),
)}
