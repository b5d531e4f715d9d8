"""The test suite's own shape (issue 38): helpers live in ``tests/_support`` and test files
import them from there, never from ``conftest`` (a module pytest imports under its own rules);
``conftest.py`` holds only fixtures and hooks."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_no_test_file_imports_conftest():
    offenders = [p.name for p in sorted(TESTS.rglob("*.py")) if "conftest" in _imported_modules(p)]
    assert offenders == [], f"import helpers from _support, not conftest: {offenders}"


def test_conftest_holds_only_fixtures_and_hooks():
    tree = ast.parse((TESTS / "conftest.py").read_text())
    others = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if not (node.name.startswith("pytest_") or any("fixture" in d for d in decorators)):
            others.append(node.name)
    assert others == [], f"helpers belong in tests/_support: {others}"
