"""The package makes TensorFlow's BFC allocator the CPU default (fewer page
faults per training step) unless the user chose."""

import os
import subprocess
import sys

from keras_rec_emb.backend.tensorflow import allocator as _allocator

_PROBE = r"""
import resource, sys
import tensorflow as tf
import keras_rec_emb
x = tf.random.uniform([4096, 416])
f = tf.function(lambda x: tf.reduce_sum(tf.concat([x * 2.0, x + 1.0], 0)))
f(x)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    f(x)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 50)
"""


def _faults_per_call(env_update):
    # TF_ENABLE_ONEDNN_OPTS=0: where TensorFlow turns oneDNN on by default
    # (CPUs with AVX512-VNNI, BF16 or AMX), its oneDNN allocator, which pools
    # too, replaces malloc as the CPU default; the baseline here is malloc.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    env.update(env_update)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_sets_bfc_default_with_the_machine_memory_as_limit():
    env = {}
    assert _allocator.use_bfc_allocator(env)
    assert env["TF_CPU_ALLOCATOR_USE_BFC"] == "true"
    assert int(env["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) == _allocator._physical_memory_mb()


def test_respects_the_users_choice():
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "false"}
    assert not _allocator.use_bfc_allocator(env)
    assert env == {"TF_CPU_ALLOCATOR_USE_BFC": "false"}
    env = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": "1000"}
    assert _allocator.use_bfc_allocator(env)
    assert env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] == "1000"


def test_importing_the_package_removes_per_step_page_faults():
    # Two 6.8 MB temporaries per call: malloc maps them fresh every call
    # (~500 faults), the BFC pool reuses its pages.
    default = _faults_per_call({})
    opted_out = _faults_per_call({"TF_CPU_ALLOCATOR_USE_BFC": "false"})
    assert opted_out > 200, opted_out
    assert default < opted_out / 10, (default, opted_out)
