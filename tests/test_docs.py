"""Every Python block in the README and docs/ runs, on tiny models, so the docs cannot rot.

The blocks are written for the real thing (SmolLM2, a fitted or published transcoder, ROME's
known_1000). Here ``load_model`` gives a tiny 30-layer Llama, ``load_transcoder`` a random fixture
CLT of its shape whatever it is asked for, ``load_lorsa`` a fixture Lorsa set (layers 2, 5, 8),
and ``known_1000`` is the project's own fact file served from a file URL — so each block
exercises the calls and names it shows. A block whose first line is ``# name.py`` is also a
module file: written beside every block of its page (on ``sys.path``) so the others import it.
Types a block registers stay in that block.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest
from _support.data import PROJECT_FACTS, ROOT, fetch_file_urls
from _support.docs_world import N_LAYERS, PAGES, stand_in
from clt_fixtures import random_clt_tensors, write_clt
from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa

import pyvene_causaltrace
from pyvene_causaltrace import models as model_module
from pyvene_causaltrace import transcoders
from pyvene_causaltrace.dataset import sources
from pyvene_causaltrace.interventions import registry
from pyvene_causaltrace.transcoders import formats
from pyvene_causaltrace.transcoders import lorsa as lorsa_module

BLOCK = re.compile(r"```python\n(.*?)```", re.S)
MODULE = re.compile(r"# (\w+)\.py\n")  # a block that is a module file: "# my_steer.py"
BLOCKS = [(page, i, code) for page in PAGES for i, code in enumerate(BLOCK.findall(
    page.read_text()))]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs_world")
    model, tokenizer = stand_in(tmp_path_factory)  # trained a little on the docs' facts
    clt = write_clt(root / "clt", random_clt_tensors(N_LAYERS, 32, 8, threshold=0.05))
    return model, tokenizer, clt


def test_the_docs_have_blocks_to_run():
    assert len(BLOCKS) >= 10 and {page.name for page, _, _ in BLOCKS} >= {
        "README.md", "tracing.md", "datasets.md", "transcoders.md", "attribution.md",
        "plugins.md"}


@pytest.mark.parametrize("page,index,code", BLOCKS,
                         ids=[f"{page.name}-{i}" for page, i, _ in BLOCKS])
def test_block_runs(world, page, index, code, monkeypatch, tmp_path):
    model, tokenizer, clt = world
    real_load, real_lorsa = formats.load_transcoder, lorsa_module.load_lorsa

    def load_model(*args, **kwargs):
        return model, tokenizer

    def load_transcoder(*args, **kwargs):
        return real_load(str(clt))

    for module in (model_module, pyvene_causaltrace):
        monkeypatch.setattr(module, "load_model", load_model, raising=False)
    for module in (formats, transcoders, pyvene_causaltrace):
        monkeypatch.setattr(module, "load_transcoder", load_transcoder, raising=False)

    def load_lorsa(*args, **kwargs):  # a fixture Lorsa at layers 2, 5 and 8, whatever is asked
        for layer in (2, 5, 8):
            cfg = peer_config(layer=layer, d_model=32)
            write_peer_lorsa(tmp_path / "lorsa" / f"L{layer}", cfg,
                             peer_tensors(cfg, seed=layer), (2.5, 0.7))
        return real_lorsa(tmp_path / "lorsa")

    monkeypatch.setattr(lorsa_module, "load_lorsa", load_lorsa)
    data = PROJECT_FACTS.read_bytes()
    monkeypatch.setitem(sources.DATASETS, "known_1000", sources.DatasetSource(
        PROJECT_FACTS.as_uri(), hashlib.sha256(data).hexdigest(), "known_1000.json",
        "PVCT_DOCS_UNUSED", "test"))
    fetch_file_urls(monkeypatch)
    monkeypatch.setenv("PYVENE_CAUSALTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    Path("intervention_specs").symlink_to(ROOT / "intervention_specs")
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    modules = {m.group(1): block for block in BLOCK.findall(page.read_text())
               if (m := MODULE.match(block))}
    for name, block in modules.items():
        (tmp_path / f"{name}.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        exec(compile(code, f"{page.name}[{index}]", "exec"), {"__name__": "__docs__"})
    finally:
        for name in modules:
            sys.modules.pop(name, None)
