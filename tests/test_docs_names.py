"""Every name the docs give in code spans exists (issue 52, item 4): a moved module or a renamed
function leaves no page pointing at nothing.

Each ``code span`` of README.md and docs/*.md (code blocks run in test_docs.py) is read for:

- file paths ending in ``.py`` or ``.json`` (package-relative or repository-relative): the file
  exists;
- dotted names ``pyvene_causaltrace.a.b``: they import (a module, then attributes);
- calls ``name(...)``: ``name`` is defined in the package, its tests, examples or build files;
- a span that is one snake_case or CamelCase identifier: the same.

Names that belong to other projects (pyvene's, circuit-tracer's, transformers') are listed in
:data:`EXTERNAL` with whose they are. CHANGELOG.md is not read: it names what was removed.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pyvene_causaltrace"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Names in the docs that are other projects' (never ours to define): name -> whose.
EXTERNAL = {
    "create_graph_files": "circuit-tracer (utils/create_graph_files.py)",
    "frontend/graph_models.py": "circuit-tracer",
    "frontend/local_server.py": "circuit-tracer",
    "utils/create_graph_files.py": "circuit-tracer",
    "device_map": "transformers' from_pretrained",
    "corrupted_config": "pyvene",
    "restore_corrupted_with_interval_config": "pyvene",
    "source_representations": "pyvene",
    "clean_restor": "a misspelling the page shows being corrected",
}

#: The repository's folders: a .json path under one of them is ours, any other the reader's.
REPOSITORY_DIRS = ("pyvene_causaltrace/", "examples/", "intervention_specs/", "tests/",
                   "benchmarks/", "docs/")

_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
_WORD = re.compile(r"[A-Za-z_]\w*")


@cache
def known_words() -> frozenset[str]:
    """Every identifier and every word of a string in the package (its Python, JSON, JS and
    HTML), the tests, examples, intervention specs and build files, and the docs' code blocks
    (a page's example may define a name its prose then uses)."""
    words: set[str] = set()
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
               *(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    for path in sources:
        if path.resolve() == Path(__file__).resolve():
            continue  # this file's control names what does not exist
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                words.add(node.name)
            elif isinstance(node, ast.Name):
                words.add(node.id)
            elif isinstance(node, ast.Attribute):
                words.add(node.attr)
            elif isinstance(node, ast.arg):
                words.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                words.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                words.update(_WORD.findall(node.value))
    texts = [*PACKAGE.rglob("*.json"), *PACKAGE.rglob("*.js"), *PACKAGE.rglob("*.html"),
             *(ROOT / "intervention_specs").glob("*.json"), ROOT / "Makefile",
             ROOT / "pyproject.toml"]
    for path in texts:
        words.update(_WORD.findall(path.read_text(encoding="utf-8")))
    for page in PAGES:
        for block in _BLOCK.findall(page.read_text(encoding="utf-8")):
            words.update(_WORD.findall(block))
    return frozenset(words)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def problems(text: str) -> list[str]:
    """What the code spans of ``text`` (a page) name that does not exist."""
    found = []
    words = known_words()
    for span in _SPAN.findall(_BLOCK.sub("", text)):
        for path in re.findall(r"[\w./-]+\.(?:py|json)\b", span):
            if path in EXTERNAL or "*" in path or path.startswith(("~", "/", ".")):
                continue
            relative = path.removeprefix("pyvene_causaltrace/")
            candidates = [PACKAGE / relative, ROOT / path, ROOT / "examples" / path,
                          *PACKAGE.rglob(relative)] if "/" in relative \
                else [PACKAGE / relative, ROOT / path]
            if path.endswith(".json") and not path.startswith(REPOSITORY_DIRS):
                continue  # a file the reader names (graph.json, OUT/summary.json): theirs
            if not any(c.exists() for c in candidates):
                found.append(f"file {path}")
        for dotted in re.findall(r"\bpyvene_causaltrace(?:\.\w+)+", span):
            if not _resolves(dotted.rstrip(".")):
                found.append(f"name {dotted}")
        for name in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\(", span):
            if name not in words and name not in EXTERNAL:
                found.append(f"call {name}()")
        one = re.fullmatch(r"\.?([A-Za-z_]\w*)(?:\(\))?", span.strip())
        if one and ("_" in one[1].strip("_") or re.search(r"[a-z][A-Z]", one[1])) \
                and one[1] not in words and one[1] not in EXTERNAL:
            found.append(f"name {one[1]}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_name_a_page_gives_exists(page):
    assert problems(page.read_text(encoding="utf-8")) == [], page.name


def test_the_check_sees_a_missing_file_module_call_and_name():
    text = ("See `pyvene_causaltrace/no_such_module.py`, `pyvene_causaltrace.tracing.nope`, "
            "`vanished_function(model)` and `gone_setting`; `tracing/engine.py`, "
            "`pyvene_causaltrace.tracing.Tracer`, `trace(model)` and `node_threshold` exist.")
    assert problems(text) == ["file pyvene_causaltrace/no_such_module.py",
                              "name pyvene_causaltrace.tracing.nope", "call vanished_function()",
                              "name gone_setting"]
