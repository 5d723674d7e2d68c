"""Every use of private JAX API by the JAX binding.

`_compat.py` holds the private TensorFlow / Keras API and imports
TensorFlow, which the JAX backend must not need; this module is its
counterpart for JAX (pinned in requirements-dev.txt). `tests/jax_backend/` checks
that every entry exists in the installed JAX.

Each entry says what it is and why the public API does not do it.
"""

from jax._src import core as _core
from jax._src import effects as _effects

# The abstract value of an XLA token. `jax.ffi`'s lowering recognises a
# token operand or result by identity with this object (its public alias,
# `jax.core.abstract_token`, is deprecated and warns).
abstract_token = _core.abstract_token


def register_ordered_effect(effect_type):
    """Declares `effect_type` as an ordered effect, as `io_callback(...,
    ordered=True)` declares its own: JAX then threads a token through every
    primitive carrying it, within a jitted computation and across
    dispatches, so those primitives run exactly once each and in program
    order. It is also allowed where the table calls sit: inside control flow
    (`lax.scan`, `cond`), `custom_vjp` (the lookup's backward) and `remat`.
    JAX has no public API to declare an effect's kind (`jax.extend.core`
    exports `Effect` only)."""
    _effects.ordered_effects.add_type(effect_type)
    _effects.lowerable_effects.add_type(effect_type)
    _effects.control_flow_allowed_effects.add_type(effect_type)
    _effects.custom_derivatives_allowed_effects.add_type(effect_type)
    _effects.remat_allowed_effects.add_type(effect_type)
