"""The strings whose TensorFlow keys (`tf.strings.to_hash_bucket_fast(s,
2**63 - 1)`) are stored in tests/layers/data/hash_strings_keys.npz, for
the JAX backend's HashStrings to match without TensorFlow: every FarmHash
code path (0-3, 4-7, 8-16, 17-32, 33-64 bytes, 64-byte blocks and their
remainders), random bytes (NUL, invalid UTF-8), unicode, Criteo hex."""

import os

import numpy as np

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layers", "data",
                    "hash_strings_keys.npz")


def make_strings():
    rng = np.random.default_rng(57)
    out = [b""]
    for n in list(range(1, 200)) + [255, 256, 257, 511, 512, 513, 1000, 4097]:
        out.append(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    alphabet = "aé日本語🙂\u0000Ωж"
    for n in range(1, 60):
        out.append("".join(rng.choice(list(alphabet), n)).encode("utf-8"))
    out += [f"{v:08x}".encode() for v in rng.integers(0, 2**32, 40)]
    return out


def load():
    """(strings as a list of bytes, keys as int64) from the stored file."""
    with np.load(PATH, allow_pickle=False) as f:
        data, lengths, keys = f["data"].tobytes(), f["lengths"], f["keys"]
    ends = np.cumsum(lengths)
    return [data[e - n:e] for e, n in zip(ends.tolist(), lengths.tolist())], keys


def save(strings, keys):
    np.savez_compressed(PATH, data=np.frombuffer(b"".join(strings), np.uint8),
                        lengths=np.array([len(s) for s in strings], np.int64),
                        keys=np.asarray(keys, np.int64))


# Bad input and the error both backends give: (id, make(HashStrings), type,
# a part of the message). (Under TensorFlow, Keras prefixes an error raised
# in `call` with "Exception encountered when calling HashStrings.call()".)
BAD_INPUTS = [
    ("missing", lambda hs: hs(missing="skip"), ValueError,
     "`missing` must be one of ('drop', 'pad'). Received: missing='skip'"),
    ("int-ids", lambda hs: hs(name="h", missing="pad")(np.array([[1, 2]], np.int64)), TypeError,
     "HashStrings 'h' expects string ids (str/bytes arrays or tf.string tensors). Received "
     "ids of dtype int64. Integer ids need no hashing"),
    ("float-ids", lambda hs: hs(name="h", missing="pad")(np.zeros((2, 3), np.float32)),
     TypeError, "Received ids of dtype float32."),
    ("rank-3-drop", lambda hs: hs(name="h")(np.array([[["a"]]])), ValueError,
     "HashStrings 'h' with missing='drop' takes dense strings of shape [batch] or [batch, L] "
     "(it returns [batch, None] ragged keys). Received rank 3. Use missing='pad' for other "
     "ranks."),
    ("rank-0-drop", lambda hs: hs(name="h")(np.array("a")), ValueError, "Received rank 0."),
    ("list-float", lambda hs: hs(name="h")([["68fd1e64", 2.5]]), TypeError,
     "HashStrings 'h' takes string ids in `inputs`: every element a str or bytes ('' for a "
     "missing id), or a string tensor. Received an element of type float: 2.5."),
    ("object-array-none", lambda hs: hs(name="h")(np.array([["a", None]], dtype=object)),
     TypeError, "Received an element of type NoneType: None."),
]
