"""Architecture facts live in the adapter table (issue 53): a row of ``models.ADAPTERS`` says
where an architecture keeps its parts and what its config keys are called, and only the bound
model (``bound.py``) reads the config, through its row.

- A scan of the package fails on any module but ``models.py`` and ``bound.py`` that reads a
  key of a model's config (``model.config.head_dim``, ``getattr(config, "n_head")``, a key
  handed to a function with the config), tests a model's type (``model_type`` anywhere but a
  message, a supported type's name in a comparison) or looks in the table itself. A control
  plants each kind in a small source and sees the scan catch it, and what is allowed pass.
- Adding an architecture is one row: a tiny Llama whose modules and config keys all have other
  names, and another ``model_type``, runs ``trace()``, ``attribute()``, head loadings, QK
  attribution and a per-head trace through one new row, with the original's numbers exactly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from _support.renamed import RENAMED_ROW, renamed_llama
from clt_fixtures import random_clt_tensors, write_clt

import pyvene_causaltrace
from pyvene_causaltrace import Tracer, models, trace
from pyvene_causaltrace.attribution import attribute, head_loadings, qk_attribution
from pyvene_causaltrace.errors import UnsupportedModelError
from pyvene_causaltrace.transcoders import load_from_disk

PACKAGE = Path(pyvene_causaltrace.__file__).parent
#: The modules that may read config keys and know the table: the table, and its one reader.
READERS = {"models.py", "bound.py"}
#: What only they may name.
TABLE_NAMES = {"ADAPTERS", "get_adapter"}


def _is_config(node: ast.AST, aliases: set[str]) -> bool:
    """``<anything>.config`` (not a call of a ``.config()`` method) or a name assigned one."""
    return (isinstance(node, ast.Attribute) and node.attr == "config") or (
        isinstance(node, ast.Name) and node.id in aliases)


#: Keys of a pyvene ``IntervenableConfig`` (``made.config``), which is no model's config.
PYVENE_CONFIG_KEYS = {"representations"}


def _private(key: str) -> bool:
    """transformers' own machinery (``_attn_implementation``, ``_name_or_path``): the same on
    every architecture, not a fact of one; or a key of pyvene's config."""
    return key.startswith("_") or key in PYVENE_CONFIG_KEYS


def offences(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of each architecture fact read outside the table in ``source``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    aliases = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Attribute) and node.value.attr == "config"
               for target in node.targets if isinstance(target, ast.Name)}
    types = set(models.ADAPTERS)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and _is_config(node.value, aliases) \
                and not _private(node.attr):
            found.append((line, f"reads config key {node.attr!r}"))
        elif isinstance(node, ast.Call) and node.args and _is_config(node.args[0], aliases):
            keys = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            keys += [k.arg for k in node.keywords]
            if getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr") \
                    and len(node.args) > 1 and not keys:
                found.append((line, "reads a config key by a computed name"))
            found += [(line, f"reads config key {key!r}") for key in keys
                      if key is None or not _private(str(key))]
        if isinstance(node, ast.Attribute) and node.attr == "model_type" \
                and not isinstance(parents.get(node), ast.FormattedValue):
            found.append((line, "tests model_type"))
        elif isinstance(node, ast.Constant) and node.value == "model_type":
            found.append((line, "names model_type"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = {getattr(e, "value", None) for side in sides
                     for e in (side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set)
                               else [side]) if isinstance(e, ast.Constant)}
            found += [(line, f"compares with the type {name!r}") for name in named & types]
        if isinstance(node, ast.Name) and node.id in TABLE_NAMES:
            found.append((line, f"uses {node.id}"))
        elif isinstance(node, ast.ImportFrom):
            found += [(line, f"imports {a.name}") for a in node.names if a.name in TABLE_NAMES]
    return sorted(set(found))


def test_only_the_table_and_the_bound_model_know_architectures():
    found = {file: offences(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))
             if (file := path.relative_to(PACKAGE).as_posix()) not in READERS}
    assert {file: hits for file, hits in found.items() if hits} == {}


def test_the_scan_catches_each_kind_and_passes_what_is_allowed():
    """Control: a planted offender of each kind is caught, line by line; what the package
    does instead (ask the bound model, name its type in a message) is not."""
    planted = '''
from .models import ADAPTERS
def f(model, bound, made, key):
    heads = model.config.num_attention_heads
    inner = getattr(model.config, "n_inner", None)
    config = model.config
    width = config.head_dim
    cap = getattr(config, key)
    if bound.adapter.model_type == "gemma2":
        pass
    if arch in ("gpt2", "llama"):
        pass
    kind = getattr(model.config, "model_type")
    with thread_view(config, final_logit_softcapping=None):
        pass
    return ADAPTERS[kind]
'''
    assert [line for line, _ in offences(planted)] == [2, 4, 5, 7, 8, 9, 9, 11, 11, 13, 13, 14,
                                                       16]
    allowed = '''
def f(model, bound, made):
    heads, cap = bound.n_heads, bound.logit_softcap
    settings = made.config()["clt_layer"] + self._config.get("source")
    cache = DynamicCache(config=bound.decoder_config)
    with thread_view(attention.config, _attn_implementation_internal="eager"):
        implementation = attention.config._attn_implementation
    raise ValueError(f"{bound.model_type} has no {path}")
'''
    assert offences(allowed) == []


# ------------------------------------------------------------------ one row, a new architecture


@pytest.fixture
def renamed(monkeypatch):
    """The renamed tiny Llama, its row registered for the test alone."""
    monkeypatch.setitem(models.ADAPTERS, RENAMED_ROW.model_type, RENAMED_ROW)
    return renamed_llama


def test_the_renamed_model_shares_no_name_with_llama(renamed, tokenizer, monkeypatch):
    """Control: nothing of Llama's naming is left for a fact outside the row to find, and
    without the row the model is refused."""
    model, llama = renamed(), make_tiny_model("llama")
    common = set(type(model.config)().to_dict())  # every config's: return_dict, ...
    names = {name for name, _ in model.named_modules() if name} | set(model.config.to_dict())
    llama_names = {name for name, _ in llama.named_modules()} | set(llama.config.to_dict())
    assert names & (llama_names - common) == set()
    assert "llama" not in str(model.config.to_dict()).lower()
    monkeypatch.delitem(models.ADAPTERS, RENAMED_ROW.model_type)
    with pytest.raises(UnsupportedModelError, match=RENAMED_ROW.model_type):
        trace(model, tokenizer, PROMPT, SUBJECT)


@pytest.mark.parametrize("prompt,subject", [(PROMPT, SUBJECT),
                                            ("Miles Davis plays the trumpet", "the trumpet")])
def test_a_trace_of_the_renamed_model_is_the_llamas(renamed, tokenizer, prompt, subject):
    """The second subject starts mid-prompt: the trace reuses the clean prefix's key/value
    cache, which transformers builds from the decoder's own config."""
    llama, model = make_tiny_model("llama"), renamed()
    for kind in ("residual", "mlp", "attn"):
        ours, theirs = (trace(m, tokenizer, prompt, subject, seeds=2, kind=kind, progress=False)
                        for m in (model, llama))
        assert ours.sigma == theirs.sigma and ours.clean_prob == theirs.clean_prob
        np.testing.assert_array_equal(ours.restored_probs, theirs.restored_probs)
        np.testing.assert_array_equal(ours.corrupt_probs, theirs.corrupt_probs)


def test_graphs_heads_and_qk_of_the_renamed_model_are_the_llamas(renamed, tokenizer, tmp_path):
    llama, model = make_tiny_model("llama", init=0.2), renamed(init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 48,
                                                                          threshold=0.1))))
    ours, theirs = (attribute(m, tokenizer, clt, PROMPT) for m in (model, llama))
    assert ours.n_features == theirs.n_features > 0
    assert torch.equal(ours.feature_id, theirs.feature_id)
    assert torch.equal(ours.activation, theirs.activation)
    assert torch.equal(ours.target_row(), theirs.target_row())
    assert ours.closure.relative == theirs.closure.relative
    assert torch.equal(head_loadings(model, clt, ours).parts,
                       head_loadings(llama, clt, theirs).parts)
    qk = [qk_attribution(m, clt, g, 1, 3, -1, 2) for m, g in ((model, ours), (llama, theirs))]
    assert qk[0].score == qk[1].score and torch.equal(qk[0].query_parts, qk[1].query_parts)
    heads = [Tracer(m, tokenizer, PROMPT, SUBJECT, seeds=2).trace_heads(progress=False)
             for m in (model, llama)]
    np.testing.assert_array_equal(heads[0].restored_probs, heads[1].restored_probs)
