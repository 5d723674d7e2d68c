"""FarmHash's Fingerprint64 (`farmhashna::Hash64`) in NumPy, vectorized over
many strings: the hash of TensorFlow's `tf.strings.to_hash_bucket_fast`
(and of DeepRec's string embedding variables), to the bit, without
TensorFlow. All arithmetic is on uint64 arrays, modulo 2**64 as in C.

Strings are hashed in groups of one code path (0-3, 4-7, 8-16, 17-32, 33-64
bytes, and longer), reading the bytes from one buffer at each string's offset."""

import numpy as np

# DeepRec's string EV hashes with `to_hash_bucket_fast(s, INT64_MAX)`: keys
# in [0, 2**63 - 2], so a negative pad value can never be a real key.
NUM_BUCKETS = 2**63 - 1
PAD_ID = -1
_U64 = np.uint64
K0, K1, K2 = _U64(0xC3A5C85C97CB3127), _U64(0xB492B66FBE98F273), _U64(0x9AE16A3B2F90404F)


def _rot(v, s):
    return (v >> _U64(s)) | (v << _U64(64 - s))


def _shift_mix(v):
    return v ^ (v >> _U64(47))


def _len16(u, v, mul):
    a = (u ^ v) * mul
    a ^= a >> _U64(47)
    b = (v ^ a) * mul
    b ^= b >> _U64(47)
    return b * mul


def _weak32(w, x, y, z, a, b):
    """WeakHashLen32WithSeeds of the 32 bytes read as words w, x, y, z."""
    a = a + w
    b = _rot(b + a + z, 21)
    c = a
    a = a + x + y
    b = b + _rot(a, 44)
    return a + z, b + c


def _long(block, s, n):
    """Hash64 of strings over 64 bytes at offsets `s` (int64), `n` bytes;
    `block(p)` reads the 64 bytes at offsets `p` as [len(p), 8] words."""
    # Longest first: the strings still in the loop at block i are a prefix.
    order = np.argsort(-n, kind="stable")
    s, n = s[order], n[order]
    count = len(s)
    blocks = (n - 1) // 64  # at least 1
    y = np.full(count, (81 * int(K1) + 113) % 2**64, _U64)
    z = _shift_mix(y * K2 + _U64(113)) * K2
    v0, v1, w0, w1 = (np.zeros(count, _U64) for _ in range(4))
    x = _U64(81 * int(K2) % 2**64) + block(s)[:, 0]
    for i in range(int(blocks[0])):
        on = slice(0, int(np.searchsorted(-blocks, -i, side="left")))  # blocks > i
        f = block(s[on] + 64 * i)
        xo, yo, zo, v0o, v1o, w0o, w1o = x[on], y[on], z[on], v0[on], v1[on], w0[on], w1[on]
        nx = _rot(xo + yo + v0o + f[:, 1], 37) * K1
        ny = _rot(yo + v1o + f[:, 6], 42) * K1
        nx ^= w1o
        ny = ny + v0o + f[:, 5]
        nz = _rot(zo + w0o, 33) * K1
        v0[on], v1[on] = _weak32(f[:, 0], f[:, 1], f[:, 2], f[:, 3], v1o * K1, nx + w0o)
        w0[on], w1[on] = _weak32(f[:, 4], f[:, 5], f[:, 6], f[:, 7], nz + w1o, ny + f[:, 2])
        x[on], y[on], z[on] = nz, ny, nx
    mul = K1 + ((z & _U64(0xFF)) << _U64(1))
    f = block(s + n - 64)
    w0 = w0 + ((n - 1) & 63).astype(_U64)
    v0 = v0 + w0
    w0 = w0 + v0
    x = _rot(x + y + v0 + f[:, 1], 37) * mul
    y = _rot(y + v1 + f[:, 6], 42) * mul
    x ^= w1 * _U64(9)
    y = y + v0 * _U64(9) + f[:, 5]
    z = _rot(z + w0, 33) * mul
    v0, v1 = _weak32(f[:, 0], f[:, 1], f[:, 2], f[:, 3], v1 * mul, x + w0)
    w0, w1 = _weak32(f[:, 4], f[:, 5], f[:, 6], f[:, 7], z + w1, y + f[:, 2])
    x, z = z, x
    out = np.empty(count, _U64)
    out[order] = _len16(_len16(v0, w0, mul) + _shift_mix(y) * K0 + z,
                        _len16(v1, w1, mul) + x, mul)
    return out


def _hash64(buf, s, n):
    """Hash64 of the strings at byte offsets `s` of length `n` in `buf`."""
    u8 = buf
    size = len(buf)
    # Views of every byte offset as a little-endian uint64 / uint32 (FarmHash
    # reads unaligned words; every read lies inside its string).
    u64 = np.ndarray((max(size - 7, 0),), "<u8", buffer=buf, strides=(1,))
    u32 = np.ndarray((max(size - 3, 0),), "<u4", buffer=buf, strides=(1,))
    # ... and of every offset as 64 bytes: one row copy per string and block.
    rows = np.ndarray((max(size - 63, 0), 64), np.uint8, buffer=buf, strides=(1, 1))

    def fetch(p):
        return u64[p].astype(_U64, copy=False)

    def block(p):
        return rows[p].view("<u8").astype(_U64, copy=False)

    out = np.empty(len(s), _U64)
    nu = n.astype(_U64)
    mul = K2 + nu * _U64(2)
    m = n == 0
    out[m] = K2
    m = (n > 0) & (n < 4)
    if m.any():
        sm, nm = s[m], n[m]
        a, b, c = (u8[sm].astype(_U64), u8[sm + (nm >> 1)].astype(_U64),
                   u8[sm + nm - 1].astype(_U64))
        y = a + (b << _U64(8))
        z = nm.astype(_U64) + (c << _U64(2))
        out[m] = _shift_mix(y * K2 ^ z * K0) * K2
    m = (n >= 4) & (n < 8)
    if m.any():
        sm, nm = s[m], n[m]
        a = u32[sm].astype(_U64)
        out[m] = _len16(nm.astype(_U64) + (a << _U64(3)), u32[sm + nm - 4].astype(_U64), mul[m])
    m = (n >= 8) & (n <= 16)
    if m.any():
        sm, nm, mm = s[m], n[m], mul[m]
        a = fetch(sm) + K2
        b = fetch(sm + nm - 8)
        out[m] = _len16(_rot(b, 37) * mm + a, (_rot(a, 25) + b) * mm, mm)
    m = (n > 16) & (n <= 32)
    if m.any():
        sm, nm, mm = s[m], n[m], mul[m]
        a, b = fetch(sm) * K1, fetch(sm + 8)
        c, d = fetch(sm + nm - 8) * mm, fetch(sm + nm - 16) * K2
        out[m] = _len16(_rot(a + b, 43) + _rot(c, 30) + d, a + _rot(b + K2, 18) + c, mm)
    m = (n > 32) & (n <= 64)
    if m.any():
        sm, nm, mm = s[m], n[m], mul[m]
        a, b = fetch(sm) * K2, fetch(sm + 8)
        c, d = fetch(sm + nm - 8) * mm, fetch(sm + nm - 16) * K2
        y = _rot(a + b, 43) + _rot(c, 30) + d
        z = _len16(y, a + _rot(b + K2, 18) + c, mm)
        e, f = fetch(sm + 16) * mm, fetch(sm + 24)
        g = (y + fetch(sm + nm - 32)) * mm
        h = (z + fetch(sm + nm - 24)) * mm
        out[m] = _len16(_rot(e + f, 43) + _rot(g, 30) + h, e + _rot(f + a, 18) + g, mm)
    m = n > 64
    if m.any():
        out[m] = _long(block, s[m], n[m])
    return out


def _fingerprints(strings):
    """(fingerprints, byte lengths) of `strings` (see `fingerprint64`)."""
    if not isinstance(strings, np.ndarray):
        strings = np.array(strings, dtype=object)
    shape = strings.shape
    if strings.dtype.kind == "U" and strings.size:
        codes = np.ascontiguousarray(strings).view(np.uint32)
        if codes.max() < 128:  # ASCII: its UTF-8 is one byte per code point
            strings = codes.astype(np.uint8).view(f"S{strings.dtype.itemsize // 4}")
        else:
            strings = strings.astype(object)
    if strings.dtype.kind == "S":
        width = strings.dtype.itemsize
        flat = np.ascontiguousarray(strings.reshape(-1))
        buf = np.frombuffer(flat.tobytes(), np.uint8) if width else np.zeros(0, np.uint8)
        n = np.char.str_len(flat).astype(np.int64)
        s = np.arange(flat.size, dtype=np.int64) * width
    else:
        parts = [v.encode("utf-8") if isinstance(v, str) else bytes(v)
                 for v in strings.reshape(-1).tolist()]
        n = np.fromiter(map(len, parts), np.int64, len(parts))
        s = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64) if len(parts) else n
        buf = np.frombuffer(b"".join(parts), np.uint8)
    if buf.size == 0:
        buf = np.zeros(1, np.uint8)  # a view needs a buffer even with no bytes
    return _hash64(buf, s, n).reshape(shape), n.reshape(shape)


def fingerprint64(strings):
    """FarmHash Fingerprint64 of each string, as a uint64 array of the
    shape of `strings`.

    Args:
        strings: a NumPy array of dtype `bytes_` (`S`) or `str_` (`U`,
            hashed as UTF-8), or an array or sequence of `str`/`bytes`
            objects (each hashed as is: `bytes` as its bytes, `str` as
            UTF-8). NumPy's fixed-width dtypes drop trailing NUL bytes, as
            they do everywhere.

    Example:

    >>> from keras_rec_emb._farmhash import fingerprint64
    >>> fingerprint64(["", "a"]).tolist()
    [11160318154034397263, 12917804110809363939]
    """
    return _fingerprints(strings)[0]


def hash_buckets(strings, empty=None):
    """`tf.strings.to_hash_bucket_fast(strings, 2**63 - 1)` without
    TensorFlow: int64 keys of the shape of `strings` (see `fingerprint64`),
    `empty` (when not None) for the empty string."""
    fingerprints, lengths = _fingerprints(strings)
    keys = (fingerprints % _U64(NUM_BUCKETS)).astype(np.int64)
    return keys if empty is None else np.where(lengths == 0, np.int64(empty), keys)
