"""Every use of private JAX API by the JAX binding.

`_compat.py` holds the private TensorFlow / Keras API and imports
TensorFlow, which the JAX backend must not need; this module is its
counterpart for JAX (pinned in requirements-dev.txt). `tests/jax_backend/` checks
that every entry exists in the installed JAX.

Each entry says what it is and why the public API does not do it.
"""

from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects

# The abstract value of an XLA token. `jax.ffi`'s lowering recognises a
# token operand or result by identity with this object (its public alias,
# `jax.core.abstract_token`, is deprecated and warns).
abstract_token = _core.abstract_token


def register_ordered_effect(effect_type):
    """Declares `effect_type` as an ordered effect, as `io_callback(...,
    ordered=True)` declares its own: JAX threads a token through every
    primitive carrying it, so they run once each and in program order, also
    inside control flow, `custom_vjp` (the lookup's backward) and `remat`.
    JAX has no public API to declare an effect's kind."""
    _effects.ordered_effects.add_type(effect_type)
    _effects.lowerable_effects.add_type(effect_type)
    _effects.control_flow_allowed_effects.add_type(effect_type)
    _effects.custom_derivatives_allowed_effects.add_type(effect_type)
    _effects.remat_allowed_effects.add_type(effect_type)


def pass_tokens_in_place():
    """Makes JAX hand an ordered effect's last token to the next dispatch as
    it is when it already lies on the one device that dispatch runs on.

    JAX's dispatch `device_put`s the effect's last token onto the
    computation's devices at every call (`RuntimeTokenSet.get_token_input`),
    there already or not, which cost more than the rest of the path
    (docs/performance.md, "Keras's JAX backend"). The token passed is the
    same buffer, so the ordering is JAX's own; the first token, and several
    devices, take JAX's code. No public API exists for this."""
    cls = getattr(_dispatch, "RuntimeTokenSet", None)
    original = getattr(cls, "get_token_input", None)
    if original is None or getattr(original, "_kre_in_place", False):
        return  # another JAX: its own dispatch, unchanged

    def get_token_input(self, eff, devices):
        token = self.current_tokens.get(eff)
        if isinstance(token, _core.Token) and len(devices) == 1:
            sharding = getattr(getattr(token, "_buf", None), "sharding", None)
            if sharding is not None and sharding.device_set == {devices[0]}:
                return token
        return original(self, eff, devices)

    get_token_input._kre_in_place = True
    get_token_input.__wrapped__ = original
    cls.get_token_input = get_token_input
