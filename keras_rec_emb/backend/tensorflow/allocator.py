"""TensorFlow's CPU allocator, chosen before TensorFlow creates its devices:
BFC instead of malloc, whose fresh pages cost a training step thousands of
page faults (docs/semantics.md, 'Memory and speed')."""

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
