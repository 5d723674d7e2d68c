"""Every use of private JAX API by the JAX binding.

`_compat.py` holds the private TensorFlow / Keras API and imports
TensorFlow, which the JAX backend must not need; this module is its
counterpart for JAX (pinned in requirements-dev.txt). `tests/jax_backend/` checks
that every entry exists in the installed JAX.

Each entry says what it is and why the public API does not do it.
"""

import functools

import jax
import numpy as np
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src.array import ArrayImpl

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




@functools.lru_cache(maxsize=None)
def _kept_dtype(dtype, x64=None):
    del x64  # part of the cache's key only
    return jax.dtypes.canonicalize_dtype(dtype) == dtype


def array_signature(leaves):
    """What a compiled executable depends on of its flat arguments, as
    JAX's dispatch reads them (a JAX array's abstract value, sharding and
    whether it is committed to its device; a NumPy array's shape and
    dtype), or None when one is neither a concrete JAX array (`jax.Array`
    also admits tracers) nor a NumPy array of a dtype JAX keeps (JAX would
    convert an int64 one in its 32-bit mode)."""
    signature = []
    for x in leaves:
        kind = type(x)
        if kind is ArrayImpl:
            signature.append((x.aval, x.sharding, x._committed))
        elif kind is np.ndarray and _kept_dtype(x.dtype, jax.config.jax_enable_x64):
            signature.append((x.shape, x.dtype))
        else:
            return None
    return tuple(signature)


# Whether no transformation is tracing (JAX's dispatch asks it too): a call
# under one must stage into that trace, not run.
trace_state_clean = _core.trace_state_clean


def trace_context():
    """The configuration that a jitted function's compilation depends on
    (JAX keys its own jit cache on it)."""
    return _config.trace_context()


def ordered_executable(compiled):
    """`(checked_call, call, const_args, out_tree)` of an ahead-of-time
    `jax.stages.Compiled` whose computation carries an ordered effect, or
    None when it carries none (JAX's own C++ dispatch is then the faster).

    `call(*const_args, *flat_args)` is JAX's own execution of the
    executable (`ExecuteReplicated`: it passes the effects' tokens in and
    takes them out, so ordering is JAX's), without its per-call checks of
    the arguments; `checked_call` is the same after those checks
    (`MeshExecutable.call`). Public `Compiled.__call__` cannot stand in: in
    this JAX its dispatch of a computation with ordered effects passes no
    token ("Execution supplied N arguments but compiled program expected
    N+1")."""
    executable = getattr(compiled, "_executable", None)
    params = getattr(compiled, "_params", None)
    call = getattr(executable, "unsafe_call", None)
    if call is None or params is None or not getattr(call, "ordered_effects", None):
        return None
    if getattr(params, "is_high", False) or getattr(call, "mut", None) is not None:
        return None
    return executable.call, call, tuple(params.const_args), params.out_tree
