"""The peer suite (``make test-peer``): our attribution graphs against circuit-tracer 0.5's on
the same tiny weights and transcoder files. It runs in its own venv (``.venv-peer``:
circuit-tracer pins transformers <= 4.57.3); the default suite never collects it
(``testpaths``), and without circuit-tracer it skips.

The tiny models, tokenizer corpus and transcoder writers are the main suite's (``tests/``),
imported, not copied (:mod:`peer`). Nothing is downloaded: everything is built from random init
in a temporary directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import lorsa_peer
import pytest
import torch
from peer import RESULTS, make_tokenizer, suite

N_LAYERS, D_MODEL, D_TRANSCODER = 3, 32, 48


@dataclass
class World:
    """A tiny model saved with its tokenizer in ``model_dir`` and loaded back from it."""

    arch: str
    model_dir: Path
    model: torch.nn.Module
    tokenizer: object


@pytest.fixture(scope="session")
def worlds(tmp_path_factory):
    """``worlds(arch)``: the tiny model of ``arch``, built once per session."""
    from transformers import AutoModelForCausalLM  # seconds to import: only when used

    made: dict[str, World] = {}

    def get(arch: str) -> World:
        if arch not in made:
            # a neutral name: TransformerLens reads the architecture off a path holding "llama"
            model_dir = tmp_path_factory.mktemp("peer") / "hf-model"
            tokenizer = make_tokenizer(suite.CORPUS, model_dir)
            suite.make_tiny_model(arch, init=0.2, n_layers=N_LAYERS).save_pretrained(model_dir)
            # eager attention: transformers' SDPA path drops Gemma-2's attention soft-cap, which
            # circuit-tracer's nnsight backend (eager) and TransformerLens both apply
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation="eager").eval()
            made[arch] = World(arch, model_dir, model, tokenizer)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def transcoder_files(tmp_path_factory):
    """``transcoder_files(kind)``: the path our ``load_transcoder`` and circuit-tracer's loaders
    both read — a per-layer set's ``config.yaml`` (circuit-tracer's ``transcoder_set``, its
    files listed by absolute path so that circuit-tracer's own config reader finds them) or a
    CLT directory (the mntss layout circuit-tracer's ``load_clt`` reads)."""
    # the main suite's writers (tests/ is on the path once peer is imported)
    from clt_fixtures import random_clt_tensors, write_clt
    from transcoder_fixtures import random_set, write_circuit_tracer

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"transcoder-{kind}")
            if kind == "clt":
                tensors = random_clt_tensors(N_LAYERS, D_MODEL, D_TRANSCODER, threshold=0.1)
                made[kind] = write_clt(root, tensors)
            else:
                options = {"jumprelu": {}, "skip": {"skip": True},
                           "relu": {"activation": "relu"}}[kind]
                tensors = random_set(N_LAYERS, D_MODEL, D_TRANSCODER, **options)
                files = [str(root / f"layer_{layer}.safetensors") for layer in range(N_LAYERS)]
                made[kind] = write_circuit_tracer(root, tensors, files=files)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def lorsa_dump(tmp_path_factory):
    """llamascopium's graph of the Lorsa fixture (:mod:`lorsa_peer`), made once per session
    in its own venv (about 35 s, most of it importing llamascopium); ``PVCT_LORSA_PEER_DUMP``
    names one already made."""
    made = os.environ.get("PVCT_LORSA_PEER_DUMP")
    if made:
        return lorsa_peer.read_dump(Path(made))
    return lorsa_peer.run_dump(tmp_path_factory.mktemp("lorsa-peer"))


def pytest_terminal_summary(terminalreporter):
    """The comparison's numbers, one line per case (also when a case failed)."""
    if lorsa_peer.RESULTS:
        terminalreporter.section("ours vs llamascopium (Lorsa + transcoders)")
        for name, value in lorsa_peer.RESULTS.items():
            terminalreporter.write_line(f"{name:44} {value}")
    if not RESULTS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("ours vs circuit-tracer")
    write(f"{'model':8} {'transcoder':15} {'backend':16} {'features':>8} {'logits':>6} "
          f"{'max rel edge diff':>18} {'pruned nodes (ours/theirs)':>27}")
    for (arch, kind, backend), r in sorted(RESULTS.items()):
        write(f"{arch:8} {kind:15} {backend:16} {r['features']:8d} {r['logits']:6d} "
              f"{r['edge_diff']:18.2e} {r['pruned']:>27}")
