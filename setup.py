"""Builds csrc/ into one TensorFlow custom-op library inside the package.

Compile and link flags come from ``tf.sysconfig`` of the TensorFlow that is
installed, so the library matches exactly the TensorFlow that will load it
(see ../shared/NOTES.md). Link flags go after the object files.
"""

import glob
import json
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _sources(pattern="*.cc"):
    files = []
    for sub in ("kv", "ops", "kernels"):
        files += sorted(glob.glob(os.path.join("csrc", sub, pattern)))
    return files


class TFBuildExt(build_ext):
    """build_ext that takes its flags from tf.sysconfig and compiles 2 at a time."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = int(os.environ.get("KRE_BUILD_JOBS", "2"))

    def build_extensions(self):
        import tensorflow as tf

        cflags = list(tf.sysconfig.get_compile_flags())
        lflags = list(tf.sysconfig.get_link_flags())
        extra = ["-O3", "-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Wno-deprecated-declarations", "-Wno-interference-size", "-Wno-sign-compare",
                 "-Wno-ignored-qualifiers", "-Wno-missing-field-initializers",
                 "-march=x86-64-v2"]
        if os.environ.get("KRE_DEBUG_BUILD"):
            extra = [f for f in extra if f != "-O3"] + ["-O0", "-g"]
        # setuptools passes python's own CFLAGS first (-O2 -g ...); drop -g to
        # keep the library small.
        for flag in ("-g", "-Wstrict-prototypes"):
            while flag in self.compiler.compiler_so:
                self.compiler.compiler_so.remove(flag)
        for ext in self.extensions:
            ext.extra_compile_args = cflags + extra
            ext.extra_link_args = lflags + ["-shared"]
            ext.include_dirs = ["csrc"]
            ext.language = "c++"
        super().build_extensions()
        # Record the TensorFlow the library was built against, so that
        # keras_rec_emb/_ops.py can name both versions when they differ.
        for ext in self.extensions:
            out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
            with open(os.path.join(out_dir, "_kre_ops_build.json"), "w") as f:
                json.dump({"tensorflow": tf.__version__}, f)

    def get_export_symbols(self, ext):
        # A TensorFlow op library, not a Python module: no PyInit_ symbol.
        return []


# `make` builds the library in place with `setup.py build_ext --inplace` and
# then registers the package with an editable install that need not build it
# again (KRE_SKIP_EXT_BUILD=1). A plain `pip install .` builds it.
_ext = [] if os.environ.get("KRE_SKIP_EXT_BUILD") else [
    # depends: the headers, so that a change to one alone rebuilds the
    # library (build_ext compares only sources and depends with it).
    Extension("keras_rec_emb._kre_ops", sources=_sources(), depends=_sources("*.h"))]

setup(
    ext_modules=_ext,
    cmdclass={"build_ext": TFBuildExt},
)
