"""A jitted function's dispatch when it holds table calls.

A table call carries an ordered effect (`ffi`), and JAX's C++ dispatch of a
jitted function (its fast path) refuses computations with ordered effects:
every call of such a function takes JAX's Python dispatch, which walks
every argument several times (abstract values, shardings, layouts) before
it runs the executable. Keras's JAX trainer passes the whole model state at
each step: 86 arrays for the peer workload's 26 tables, about 2 ms a step
on these machines, a tenth of a training step at one id a feature
(docs/performance.md, "Keras's JAX backend").

`OrderedJit` keeps JAX's compiled executable per signature of the
arguments and runs it through JAX's own execution (which threads the
effects' tokens as JAX's dispatch does): the ordering guarantees of `ffi`
hold unchanged. Anything else takes `jax.jit`'s own dispatch: keyword
arguments, arguments that are not concrete JAX arrays (NumPy arrays,
Python numbers, tracers), a call under a transformation, `jax.disable_jit`,
and computations without table calls.
"""

import jax

from keras_rec_emb.backend.jax import _jax_private

_NOT_ORDERED = object()
# Signatures kept per function (the oldest goes first): Keras's steps see
# one or two (a last, smaller batch).
MAX_SIGNATURES = 32


class OrderedJit:
    """`jax.jit(fun, ...)` with the dispatch described above.

    Args:
        jitted: the function returned by `jax.jit`; its options (donation,
            shardings, static arguments) apply as they are.

    Example:

    ```python
    import jax
    import jax.numpy as jnp
    from keras_rec_emb.backend.jax.dispatch import OrderedJit

    step = OrderedJit(jax.jit(lambda x: x + 1))
    assert int(step(jnp.ones((), "int32"))) == 2
    ```
    """

    def __init__(self, jitted):
        self.jitted = jitted
        # (config, pytree, signature) -> [checked, ordered_executable(...)]
        # or _NOT_ORDERED.
        self._executables = {}
        # Set when a compilation holds no table call: the function's calls
        # all go to `jax.jit` then, without the signature's cost.
        self._plain = False

    def __call__(self, *args, **kwargs):
        if (self._plain or kwargs or jax.config.jax_disable_jit
                or not _jax_private.trace_state_clean()):
            return self.jitted(*args, **kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        signature = _jax_private.array_signature(leaves)
        if signature is None:
            return self.jitted(*args)
        key = (_jax_private.trace_context(), treedef, signature)
        entry = self._executables.get(key)
        if entry is None:
            entry = self._compile(args)
            if len(self._executables) >= MAX_SIGNATURES:
                del self._executables[next(iter(self._executables))]
            self._executables[key] = entry
        if entry is _NOT_ORDERED:
            self._plain = True
            return self.jitted(*args)
        checked, (checked_call, call, const_args, out_tree) = entry
        if checked:
            out = call(*const_args, *leaves)
        else:
            # The first call of a signature runs JAX's checks of the
            # arguments against the executable; later ones match them.
            out = checked_call(*const_args, *leaves)
            entry[0] = True
        return jax.tree_util.tree_unflatten(out_tree, out)

    def _compile(self, args):
        compiled = self.jitted.trace(*args).lower().compile()
        executable = _jax_private.ordered_executable(compiled)
        return _NOT_ORDERED if executable is None else [False, executable]
