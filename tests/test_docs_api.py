"""docs/api.md is the public API as the code has it: regenerated here, any difference fails and
says how to regenerate; the tutorial is linked and its blocks are the ones test_docs runs."""

from __future__ import annotations

import difflib
import re

import pytest
from _support.data import ROOT, tool

from pyvene_causaltrace import attribution as attribution_package

api_doc = tool("api_doc")

API_PAGE = ROOT / "docs" / "api.md"
TUTORIAL = ROOT / "docs" / "tutorial.md"


def _stale(committed: str, generated: str) -> str:
    """'' when the page is current, else the diff and the command that fixes it."""
    if committed == generated:
        return ""
    diff = "".join(list(difflib.unified_diff(
        committed.splitlines(keepends=True), generated.splitlines(keepends=True),
        "docs/api.md (committed)", "docs/api.md (from the code)", n=0))[:40])
    return f"docs/api.md is stale; regenerate it with `{api_doc.COMMAND}`\n{diff}"


@pytest.fixture(scope="module")
def generated() -> str:
    return api_doc.render()


def test_api_page_matches_the_code(generated):
    problem = _stale(API_PAGE.read_text(), generated)
    assert not problem, problem


def test_a_changed_signature_is_noticed(generated, monkeypatch):
    """Control: the same comparison fails once an exported function's signature changes."""
    real = attribution_package.attribute

    def attribute(model, tokenizer, transcoder, prompt, answer=None, *, new_option=1):
        return real(model, tokenizer, transcoder, prompt, answer)

    attribute.__doc__ = real.__doc__
    monkeypatch.setattr(attribution_package, "attribute", attribute)
    changed = api_doc.render()
    problem = _stale(generated, changed)
    assert api_doc.COMMAND in problem
    assert re.search(r"^\+- `attribute\(.*new_option=1", problem, re.M), problem


def test_api_page_lists_every_public_module_and_name(generated):
    """Each public module gets a section holding each name of its ``__all__``; the page has no
    python block (test_docs would run it)."""
    for name in api_doc.public_modules():
        module = __import__(name, fromlist=["__all__"])
        section = generated.split(f"## `{name}`\n", 1)[1].split("\n## ", 1)[0]
        missing = [n for n in module.__all__ if f"- `{n}" not in section]
        assert not missing, f"{name}: {missing}"
    assert {"pyvene_causaltrace", "pyvene_causaltrace.attribution",
            "pyvene_causaltrace.tracing"} <= set(api_doc.public_modules())
    assert "```python" not in generated


def test_tutorial_is_linked_and_runs_in_the_docs_test():
    readme = (ROOT / "README.md").read_text()
    assert "docs/tutorial.md" in readme and "docs/api.md" in readme
    text = TUTORIAL.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 5
    for call in ("Tracer(", "attribute(", "intervene_features(", "cross_check("):
        assert any(call in block for block in blocks), call
