"""The stable id hash of MultiHashEmbedding and AdaptiveEmbedding under JAX:
`fingerprint64(id) mod n`, the TensorFlow backend's `hash_to_range`
(keras_rec_emb/_hashing.py, splitmix64) to the bit, so that an id lands in
the same bucket under either backend.

Without JAX's 64-bit mode the arithmetic runs on pairs of uint32 words
(`_Word64`); with it, on uint64."""

import jax.numpy as jnp
from jax import lax

from keras_rec_emb._multi_hash_spec import GOLDEN, MIX1, MIX2

_LOW = 0xFFFFFFFF
INT32_MAX = 2**31 - 1


def _u32(value):
    return jnp.uint32(value & _LOW)


def _mul_hi(a, b):
    """The high 32 bits of the 64-bit product of uint32 arrays."""
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = b & 0xFFFF, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)


class _Word64:
    """An array of uint64 values as (hi, lo) uint32 words; arithmetic
    modulo 2**64."""

    def __init__(self, hi, lo):
        self.hi, self.lo = hi, lo

    def add(self, constant):
        lo = self.lo + _u32(constant)
        carry = (lo < self.lo).astype(jnp.uint32)
        return _Word64(self.hi + _u32(constant >> 32) + carry, lo)

    def xor_shift(self, s):
        """z ^ (z >> s), 0 < s < 32."""
        shifted_lo = (self.lo >> s) | (self.hi << (32 - s))
        return _Word64(self.hi ^ (self.hi >> s), self.lo ^ shifted_lo)

    def mul(self, constant):
        c_lo, c_hi = _u32(constant), _u32(constant >> 32)
        hi = _mul_hi(self.lo, c_lo) + self.hi * c_lo + self.lo * c_hi
        return _Word64(hi, self.lo * c_lo)

    def mod(self, n):
        """The value mod n (uint32), n <= 2**31: the bits from the top, each
        step `r = (2 r + bit) mod n` (< 2**32)."""
        n = jnp.uint32(n)
        r = self.hi % n

        def step(i, r):
            bit = (self.lo >> (31 - i).astype(jnp.uint32)) & 1
            return ((r << 1) | bit) % n

        return lax.fori_loop(0, 32, step, r)


def hash_to_range(ids, n):
    """`fingerprint64(ids) mod n` as ids' integer dtype (n >= 1; without
    JAX's 64-bit mode n <= 2**31 - 1). ids: int32 (sign-extended, as
    under TensorFlow) or int64."""
    ids = jnp.asarray(ids)
    if ids.dtype == jnp.int64:
        z = lax.bitcast_convert_type(ids, jnp.uint64) + jnp.uint64(GOLDEN)
        z = (z ^ (z >> 30)) * jnp.uint64(MIX1)
        z = (z ^ (z >> 27)) * jnp.uint64(MIX2)
        z = z ^ (z >> 31)
        return (z % jnp.uint64(n)).astype(jnp.int64)
    if ids.dtype != jnp.int32:
        raise TypeError(f"hash_to_range takes int32 or int64 ids. Received: {ids.dtype}")
    if n > INT32_MAX:
        raise ValueError(
            f"Buckets of int32 ids must number at most {INT32_MAX} (more need JAX's 64-bit "
            f"mode, jax.config.update('jax_enable_x64', True)). Received: {n}")
    lo = lax.bitcast_convert_type(ids, jnp.uint32)
    hi = jnp.where(ids < 0, jnp.uint32(_LOW), jnp.uint32(0))
    z = _Word64(hi, lo).add(GOLDEN).xor_shift(30).mul(MIX1).xor_shift(27).mul(MIX2)
    return z.xor_shift(31).mod(n).astype(jnp.int32)
