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

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

# The op library's file name, without a Python tag: it is loaded with
# tf.load_op_library and uses TensorFlow's C++ ABI only, so one build serves
# every Python version (keras_rec_emb/backend/tensorflow/ops.py loads this name).
LIBRARY = "_kre_ops.so"
# The bind() shim `keras-rec-emb ps` preloads (csrc/net/kre_bind.c; see
# keras_rec_emb/distribute/ps.py): a plain C library, no Python module.
BIND_LIBRARY = "_kre_bind.so"


def _sources(pattern="*.cc", subs=("kv", "core", "ops", "kernels")):
    files = []
    for sub in subs:
        files += sorted(glob.glob(os.path.join("csrc", sub, pattern)))
    return files


# The ops and kernels include TensorFlow's framework headers, and parsing
# them is most of each file's compile time (about 12 of 15 CPU-s): those
# files compile as UNITY_PARTS unity files, each including its share of
# them (by size), so the headers are parsed once per part instead of once
# per file. The parts compile in parallel (KRE_BUILD_JOBS). csrc/kv includes
# no TensorFlow header and compiles file by file.
UNITY_DIR = os.path.join("build", "unity")
UNITY_PARTS = 2


def _unity_sources():
    """The unity files (written under UNITY_DIR when their text changes, so
    an unchanged one keeps its time stamp)."""
    parts = [[] for _ in range(UNITY_PARTS)]
    sizes = [0] * UNITY_PARTS
    for f in sorted(_sources(subs=("ops", "kernels")), key=lambda f: (-os.path.getsize(f), f)):
        i = sizes.index(min(sizes))
        parts[i].append(f)
        sizes[i] += os.path.getsize(f)
    os.makedirs(UNITY_DIR, exist_ok=True)
    paths = []
    for i, files in enumerate(parts):
        path = os.path.join(UNITY_DIR, f"kre_ops_{i}.cc")
        text = "// Written by setup.py (_unity_sources): one compile of these files.\n" + "".join(
            f'#include "{os.path.relpath(f, "csrc")}"\n' for f in sorted(files))
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as out:
                out.write(text)
        paths.append(path)
    return paths


def _compile_in_parallel(compiler, jobs):
    """Makes `compiler.compile` compile the sources of one extension `jobs`
    at a time. build_ext's `parallel` only builds several extensions at once,
    and the library is one extension of ~20 sources, each parsing
    TensorFlow's headers (~25 s of CPU apiece)."""
    from concurrent.futures import ThreadPoolExecutor

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            if obj in build:  # else up to date
                src, ext = build[obj]
                compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            list(pool.map(one, objects))  # list(): re-raises a failed compile
        return objects

    compiler.compile = compile


class TFBuildExt(build_ext):
    """build_ext that takes its flags from tf.sysconfig and compiles 2
    sources at a time (KRE_BUILD_JOBS)."""

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
        debug = bool(os.environ.get("KRE_DEBUG_BUILD"))
        if debug:
            extra = [f for f in extra if f != "-O3"] + ["-O0", "-g"]
        # setuptools passes python's own CFLAGS first (-O2 -g ...); drop -g to
        # keep the library small. C++ sources compile with compiler_so_cxx in
        # current setuptools, with compiler_so in older ones.
        for attr in ("compiler_so", "compiler_so_cxx"):
            command = getattr(self.compiler, attr, None) or []
            for flag in ("-g", "-Wstrict-prototypes"):
                while flag in command:
                    command.remove(flag)
        # Linked without its symbol table (-s; ~1.7 MB instead of ~30 MB with
        # debug info) unless built for debugging or KRE_KEEP_SYMBOLS=1 (for a
        # profiler that names the library's internal functions).
        strip = [] if debug or os.environ.get("KRE_KEEP_SYMBOLS") else ["-s"]
        for ext in self.extensions:
            if ext.name == "keras_rec_emb._kre_bind":  # plain C, no TensorFlow
                ext.extra_compile_args = ["-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra"]
                ext.extra_link_args = ["-shared", "-ldl"] + strip
                ext.language = "c"
                continue
            ext.extra_compile_args = cflags + extra
            ext.extra_link_args = lflags + ["-shared"] + strip
            ext.include_dirs = ["csrc"]
            ext.language = "c++"
        _compile_in_parallel(self.compiler, self.parallel)
        super().build_extensions()
        # Record the TensorFlow the library was built against, so that
        # keras_rec_emb/backend/tensorflow/ops.py can name both versions when they differ.
        for ext in self.extensions:
            out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
            with open(os.path.join(out_dir, "_kre_ops_build.json"), "w") as f:
                json.dump({"tensorflow": tf.__version__}, f)

    def get_export_symbols(self, ext):
        # A TensorFlow op library, not a Python module: no PyInit_ symbol.
        return []

    def get_ext_filename(self, fullname):
        # Called with the dotted name and with its last part alone.
        package, _, name = fullname.rpartition(".")
        if name in ("_kre_ops", "_kre_bind"):
            library = LIBRARY if name == "_kre_ops" else BIND_LIBRARY
            return os.path.join(*package.split("."), library) if package else library
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self):
        # `--inplace` builds under build/ and copies the library into the
        # package: the record of its TensorFlow goes with it.
        super().copy_extensions_to_source()
        built = os.path.join(self.build_lib, "keras_rec_emb", "_kre_ops_build.json")
        if os.path.exists(built):
            self.copy_file(built, os.path.join("keras_rec_emb", "_kre_ops_build.json"))


class PlatformWheel(bdist_wheel):
    """The wheel's tag is py3-none-<platform>: the library holds no Python
    extension module, so one wheel installs on every supported Python (the
    TensorFlow minor release it needs is checked when it is loaded).
    `make wheel` then retags the platform as manylinux with auditwheel."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


# `make` builds the library in place with `setup.py build_ext --inplace` and
# then registers the package with an editable install that need not build it
# again (KRE_SKIP_EXT_BUILD=1). A plain `pip install .` builds it.
_ext = [] if os.environ.get("KRE_SKIP_EXT_BUILD") else [
    # depends: the headers, so that a change to one alone rebuilds the
    # library (build_ext compares only sources and depends with it).
    # (and the files the unity files include).
    Extension("keras_rec_emb._kre_ops", sources=_sources(subs=("kv",)) + _unity_sources(),
              depends=_sources("*.h") + _sources(subs=("ops", "kernels"))),
    Extension("keras_rec_emb._kre_bind", sources=["csrc/net/kre_bind.c"])]

setup(
    ext_modules=_ext,
    cmdclass={"build_ext": TFBuildExt, "bdist_wheel": PlatformWheel},
)
