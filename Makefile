# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install the package with its compiled ops, run the demo
#   make test   same set-up, then the C++ table tests (plain, ASan+UBSan, TSan) and pytest
PY ?= python3.11
VENV := .venv
PYTHON := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
INSTALL_STAMP := $(VENV)/.install-stamp
EXT_SUFFIX := $(shell $(PY) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
SO := keras_rec_emb/_kre_ops$(EXT_SUFFIX)
CSRC := $(shell find csrc -name '*.cc' -o -name '*.h' | grep -v '/tests/')
KV_SRC := $(wildcard csrc/kv/*.cc)
KV_TESTS := $(wildcard csrc/kv/tests/*_test.cc)
KV_BIN := csrc/kv/tests/bin
CXX ?= g++
KV_FLAGS := -std=c++17 -Wall -Wextra -Werror -pthread -Icsrc

.PHONY: all install build demo test test-kv test-kv-asan test-kv-tsan test-py test-fuzz-long bench bench-peers peer-venvs clean

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

$(INSTALL_STAMP): pyproject.toml $(DEPS_STAMP) | $(SO)
	KRE_SKIP_EXT_BUILD=1 $(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

install: $(INSTALL_STAMP) $(SO)

build: $(SO)

demo: install
	$(VENV)/bin/keras-rec-emb demo $(DEMO_ARGS)

$(KV_BIN)/%: csrc/kv/tests/%.cc $(KV_SRC) $(wildcard csrc/kv/*.h) $(wildcard csrc/kv/tests/*.h)
	@mkdir -p $(KV_BIN)
	$(CXX) $(KV_FLAGS) -O2 -o $@ $< $(KV_SRC)

$(KV_BIN)/%-asan: csrc/kv/tests/%.cc $(KV_SRC) $(wildcard csrc/kv/*.h) $(wildcard csrc/kv/tests/*.h)
	@mkdir -p $(KV_BIN)
	$(CXX) $(KV_FLAGS) -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -o $@ $< $(KV_SRC)

$(KV_BIN)/%-tsan: csrc/kv/tests/%.cc $(KV_SRC) $(wildcard csrc/kv/*.h) $(wildcard csrc/kv/tests/*.h)
	@mkdir -p $(KV_BIN)
	$(CXX) $(KV_FLAGS) -O1 -g -fsanitize=thread -fno-omit-frame-pointer -o $@ $< $(KV_SRC)

test-kv: $(patsubst csrc/kv/tests/%.cc,$(KV_BIN)/%,$(KV_TESTS))
	@for t in $^; do echo "== $$t"; $$t || exit 1; done

test-kv-asan: $(patsubst csrc/kv/tests/%.cc,$(KV_BIN)/%-asan,$(KV_TESTS))
	@for t in $^; do echo "== $$t"; ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1 $$t || exit 1; done

# ThreadSanitizer over the same tests (stress_test runs lookups with insert,
# fused applies, eviction and export on one table at once).
test-kv-tsan: $(patsubst csrc/kv/tests/%.cc,$(KV_BIN)/%-tsan,$(KV_TESTS))
	@for t in $^; do echo "== $$t"; TSAN_OPTIONS=halt_on_error=1 $$t || exit 1; done

test-py: install
	$(VENV)/bin/python -m pytest -q --durations=25 $(PYTEST_ARGS)

test: install test-kv test-kv-asan test-kv-tsan test-py

# The fuzz test with thousands of cases (CI runs a small sample in test-py).
test-fuzz-long: install
	KRE_FUZZ_LONG=1 $(VENV)/bin/python -m pytest -q tests/test_fuzz.py --long

bench: install
	$(VENV)/bin/keras-rec-emb bench

# Side-by-side peer benchmark (issue 19): TorchRec and TFRA each in their own
# virtualenv (large: torch pulls ~5 GB of CUDA wheels), never part of `make test`.
# PEERS_ARGS is passed to benchmarks/peers/run.py (e.g. PEERS_ARGS=--quick).
TR_VENV := .venv-torchrec
TFRA_VENV := .venv-tfra
PEERS_REQ := benchmarks/peers

$(TR_VENV)/.stamp: $(PEERS_REQ)/requirements-torchrec.txt
	$(PY) -m venv $(TR_VENV)
	$(TR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TR_VENV)/bin/python -m pip install --quiet -r $<
	# torchrec's dependency fbgemm-gpu (CUDA) overwrites fbgemm-gpu-cpu's files:
	$(TR_VENV)/bin/python -m pip uninstall --quiet -y fbgemm-gpu fbgemm-gpu-cpu
	$(TR_VENV)/bin/python -m pip install --quiet --no-deps fbgemm-gpu-cpu==1.9.0
	$(TR_VENV)/bin/python -c "import torchrec, fbgemm_gpu"
	touch $@

$(TFRA_VENV)/.stamp: $(PEERS_REQ)/requirements-tfra.txt
	$(PY) -m venv $(TFRA_VENV)
	$(TFRA_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TFRA_VENV)/bin/python -m pip install --quiet -r $<
	TF_USE_LEGACY_KERAS=1 $(TFRA_VENV)/bin/python -c "import tensorflow_recommenders_addons.dynamic_embedding"
	touch $@

peer-venvs: $(TR_VENV)/.stamp $(TFRA_VENV)/.stamp

bench-peers: install peer-venvs
	$(PYTHON) benchmarks/peers/run.py $(PEERS_ARGS)

clean:
	rm -rf build $(KV_BIN) keras_rec_emb/*.so *.egg-info
