"""TensorFlow's CPU allocator, chosen before TensorFlow creates its devices.

By default TensorFlow allocates CPU tensors with `malloc`. A training step of
an embedding model allocates many tensors of a few hundred kB to a few MB
(rows per feature, their gradients, concatenations); glibc serves and
returns each from fresh pages, so every step pays thousands of page
faults, a large share of its CPU (the README gives a measured step).
TensorFlow's own BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`) keeps the
pages and reuses them, and the faults all but stop. (Where TensorFlow
turns oneDNN on by default, on x86 CPUs with AVX512-VNNI, BF16 or AMX, its
oneDNN CPU allocator replaces malloc and pools too; BFC changes little there.)

`use_bfc_allocator()` sets that default, with a memory limit of the
machine's physical memory (TensorFlow's default limit is 64 GB), unless the
user set the variables; it is a no-op once TensorFlow has created its
devices (the allocator is chosen then). Opt out with
`TF_CPU_ALLOCATOR_USE_BFC=false` in the environment before importing this
package. The cost: the pool keeps its peak size (memory freed by tensors is
reused by TensorFlow, not returned to the system).
"""

import os

_VAR = "TF_CPU_ALLOCATOR_USE_BFC"
_LIMIT_VAR = "TF_CPU_BFC_MEM_LIMIT_IN_MB"


def _physical_memory_mb():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
    except (ValueError, OSError, AttributeError):
        return None


def use_bfc_allocator(environ=None):
    """Makes TensorFlow's BFC allocator the CPU default unless the user chose
    (`TF_CPU_ALLOCATOR_USE_BFC` set); returns whether this call set it."""
    environ = os.environ if environ is None else environ
    if _VAR in environ:
        return False
    environ[_VAR] = "true"
    if _LIMIT_VAR not in environ:
        mb = _physical_memory_mb()
        if mb and mb > 0:
            environ[_LIMIT_VAR] = str(int(mb))
    return True
