"""Child process of the Bloom-filter memory tests (tests/test_filters_eviction.py,
tests/jax_backend/test_jax_filters_eviction.py), under the Keras backend that
KERAS_BACKEND names: `python tests/_bloom_memory_child.py SPELLING`, where
SPELLING names the counter type ("uint64", "tf.int64", "np.uint64",
"jnp.int64"). A process of its own, so that its resident memory (VmRSS)
counts this table alone.

Prints `KEY value` lines: SAME (a table with DeepRec's modelzoo filter,
CBFFilter(3, 2**30, 0.01), reads what an exact CounterFilter(3) and a small
CBFFilter read, round after round), WARNED (the filter's size was warned
about, with its bytes), GROWN (VmRSS growth while that table was built and
looked up), MEMORY (its memory_bytes), FULL (the filter's bytes), GROWN24
(VmRSS growth of a 2**24 filter's first lookup), FULL24 and TENSORFLOW
(whether tensorflow was imported).
"""

import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import keras_rec_emb as kre
from keras_rec_emb.layers import EmbeddingVariable


def resident_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def counter_type(spelling):
    if spelling.startswith("tf."):
        import tensorflow as tf
        return getattr(tf, spelling[3:])
    if spelling.startswith("np."):
        return getattr(np, spelling[3:])
    if spelling.startswith("jnp."):
        import jax.numpy as jnp
        return getattr(jnp, spelling[4:])
    return spelling


def make_layer(name, filter_option):
    init = kre.InitializerOption(initializer=keras.initializers.RandomUniform(seed=2),
                                 default_value_dim=7, default_value_no_permission=-0.5)
    # An optimizer of its own: the JAX backend refuses a training lookup
    # without one (no gradient is applied here).
    return EmbeddingVariable(4, name=name, optimizer=kre.optimizers.SGD(0.1),
                             ev_option=kre.EmbeddingVariableOption(init_option=init,
                                                                   filter_option=filter_option))


def main(spelling):
    ct = counter_type(spelling)
    keys = np.arange(2000, dtype=np.int64) * 7919 + 5

    def rounds(layer, n=4):
        return [np.asarray(layer(keys, training=True)) for _ in range(n)]

    exact = rounds(make_layer("exact", kre.CounterFilter(3)))
    small = rounds(make_layer("small", kre.CBFFilter(3, 100_000, 1e-4, counter_type=ct)))
    before = resident_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        big_filter = kre.CBFFilter(3, max_element_size=2**30, false_positive_probability=0.01,
                                   counter_type=ct)
    m, _, b = big_filter.sizing()
    big = make_layer("big", big_filter)
    got = rounds(big)
    grown = resident_bytes() - before
    print("SAME", all(np.array_equal(g, e) and np.array_equal(g, s)
                      for g, e, s in zip(got, exact, small)), flush=True)
    print("ADMITTED", int(big.table_size()), flush=True)
    print("WARNED", any(f"{m * b} bytes" in str(w.message) for w in caught), flush=True)
    print("GROWN", grown, flush=True)
    print("MEMORY", int(big.stats()["memory_bytes"]), flush=True)
    print("FULL", m * b, flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f24 = kre.CBFFilter(3, max_element_size=2**24, false_positive_probability=0.01,
                            counter_type=ct)
    m24, _, b24 = f24.sizing()
    layer24 = make_layer("f24", f24)
    before = resident_bytes()
    layer24(keys[:1000], training=True)
    print("GROWN24", resident_bytes() - before, flush=True)
    print("FULL24", m24 * b24, flush=True)
    print("TENSORFLOW", "tensorflow" in sys.modules, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
