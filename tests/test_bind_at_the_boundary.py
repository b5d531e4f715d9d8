"""The bound model is bound at the public API and carried below it.

A scan of the package lists every call of :func:`~pyvene_causaltrace.bound.bind` (in the modules
that import it) with its enclosing function. Allowed: a function or class the package exports
(``__all__`` of the package and its subpackages, as ``api_doc`` reads them), and the
``@measured`` decorator that binds for them. The rest are named in :data:`BELOW_THE_API` with
why each still binds; the test fails on any other — a new ``bind(`` below the API — and on an
entry of the table that no longer binds (so the table only shrinks). A public ``trace()`` binds
one model (``BoundModel`` made once) and calls ``bind`` twice; ``attribute()`` once and six
times (``benchmarks/hooks_per_forward.py``).
"""

from __future__ import annotations

import ast
from importlib import import_module
from pathlib import Path

import pytest
from _support.data import tool
from _support.forwards import observe
from _support.models import PROMPT, SUBJECT, make_tiny_model

import pyvene_causaltrace
from pyvene_causaltrace import trace

PACKAGE = Path(pyvene_causaltrace.__file__).parent

#: (file, function) -> why it still binds below the exported names (the remaining work)
BELOW_THE_API = {
    ("model_guard.py", "measured.wrapper"): "the decorator of the public functions: their bind "
                                            "(and of attribute_many, ablation_test, resolve_sites "
                                            "and build_interventions, entry points of the CLI "
                                            "and of users not in __all__)",
    ("interventions/clt_splice.py", "clt_splice_representations"):
        "users build pyvene configs from a plain model with it (docs/transcoders.md)",
    ("interventions/lorsa_splice.py", "lorsa_splice_representations"):
        "users build pyvene configs from a plain model with it, as clt_splice's (issue 56 item 3 "
        "exports the Lorsa API)",
    ("transcoders/lorsa_fit.py", "fit_lorsa"): "fits from a plain model in examples (exported "
                                               "with issue 56 item 3)",
    ("interventions/frozen.py", "attention_patterns"):
        "users fetch a pattern for frozen_attention with it (docs/interventions.md)",
    ("interventions/noise.py", "rome_sigma"): "the examples' entry to ROME's sigma",
    ("transcoders/hooks.py", "hook_states"): "the entry to TransformerLens hooks' values for "
                                             "users, examples and benchmarks",
}


def _exported() -> set[tuple[str, str]]:
    """(module, qualname) of every exported function and class."""
    found = set()
    for name in tool("api_doc").public_modules():
        module = import_module(name)
        for export in module.__all__:
            obj = getattr(module, export)
            inner = getattr(obj, "__wrapped__", obj)
            if hasattr(inner, "__qualname__"):
                found.add((inner.__module__, inner.__qualname__))
    return found


def binders(package: Path = PACKAGE) -> list[tuple[str, str, str]]:
    """(file, enclosing qualname, module) of every ``bind(...)`` call in a module that imports
    ``bind`` from the bound-model module."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        imports_bind = any(isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
            "bound") and any(alias.name == "bind" for alias in node.names)
            for node in ast.walk(tree))
        if not imports_bind:
            continue
        rel = path.relative_to(package)
        module = ".".join((package.name, *rel.with_suffix("").parts))

        class Visitor(ast.NodeVisitor):
            def __init__(self, rel: Path, module: str) -> None:
                self.rel, self.module, self.stack = rel, module, []

            def visit_scope(self, node) -> None:
                self.stack.append(node.name)
                self.generic_visit(node)
                self.stack.pop()

            visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_scope

            def visit_Call(self, node: ast.Call) -> None:
                if getattr(node.func, "id", None) == "bind":
                    found.append((self.rel.as_posix(), ".".join(self.stack) or "<module>",
                                  self.module))
                self.generic_visit(node)

        Visitor(rel, module).visit(tree)
    return found


def test_bind_is_called_at_the_public_api_only():
    exported = _exported()
    below = {(file, qualname) for file, qualname, module in binders()
             if (module, qualname) not in exported
             and (module, qualname.split(".")[0]) not in exported}
    assert below - set(BELOW_THE_API) == set(), "bind() below the public API"
    assert set(BELOW_THE_API) - below == set(), "no longer binds: drop it from the table"


def test_the_scan_sees_a_bind_below_the_api(tmp_path):
    """Control: a stray call in a nested helper is found."""
    (tmp_path / "stray.py").write_text("from .bound import bind\n\ndef _helper(model):\n"
                                       "    def inner():\n        return bind(model)\n")
    assert [(f, q) for f, q, _ in binders(tmp_path)] == [("stray.py", "_helper.inner")]


@pytest.mark.parametrize("kind", ["residual", "mlp"])
def test_a_trace_binds_its_model_once(tokenizer, kind):
    model = make_tiny_model("llama")
    seen = observe(model, lambda: trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, kind=kind,
                                        progress=False))
    assert seen["bindings"] == 1 and seen["bind_calls"] <= 2, seen
