"""The house's shape, checked from the source: no import circle between package modules
(imports inside functions included), and every import inside a function says why it is there
(a ``#`` comment on its line or the line above), and no module over :data:`MAX_LINES` lines.
docs/layout.md draws the floors."""

from __future__ import annotations

import ast
from pathlib import Path

import pyvene_causaltrace

PACKAGE = Path(pyvene_causaltrace.__file__).parent
NAME = PACKAGE.name


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()

#: The most lines one module may have: past it a module holds more than one concept.
MAX_LINES = 500


def _imports(name: str, path: Path) -> list[tuple[ast.AST, bool, list[str]]]:
    """Each import statement of ``path``: (node, inside a function or class, package modules
    it names)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                         | ast.ClassDef)
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child, nested, _targets(child, package)))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    targets = set()
    for alias in node.names:
        full = f"{module}.{alias.name}"
        if full in MODULES:
            targets.add(full)
        elif module in MODULES:
            targets.add(module)
    return sorted(targets)


def _graph() -> dict[str, set[str]]:
    return {name: {t for _, _, targets in _imports(name, path) for t in targets if t != name}
            for name, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, on, stack, groups, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_import_circle_between_package_modules():
    circles = _circles(_graph())
    assert not circles, f"import circles (function-level imports count): {circles}"


def test_every_import_inside_a_function_says_why():
    silent = []
    for name, path in MODULES.items():
        lines = path.read_text().split("\n")
        for node, nested, _ in _imports(name, path):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
            if nested and "#" not in here and not above.startswith("#"):
                silent.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {here.strip()}")
    assert not silent, ("an import inside a function needs a one-line reason (or belongs at the "
                        "module's top):\n" + "\n".join(silent))


def test_the_checks_see_a_circle_and_a_silent_import(tmp_path):
    """The two checks above can fail: a made-up two-module circle is found."""
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_package_cites_nothing_outside_it():
    """Comments and docstrings cite papers or state the fact: no reference to documents that
    ship with the development checkout but not with the package."""
    outside = ("DESIGN.md", "STYLE.md", "../shared", "the seed's", "seed section", "as in the seed")
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}"
             for path in MODULES.values()
             for number, line in enumerate(path.read_text().split("\n"), 1)
             if any(word in line for word in outside)]
    assert not found, found


def oversized(paths, limit: int = MAX_LINES) -> list[str]:
    """``path: lines`` of every file in ``paths`` longer than ``limit`` lines."""
    found = []
    for path in paths:
        count = len(Path(path).read_text().splitlines())
        if count > limit:
            found.append(f"{path}: {count}")
    return found


def test_no_module_is_over_the_line_limit():
    found = oversized(MODULES.values())
    assert not found, f"modules over {MAX_LINES} lines (split them by concept): {found}"


def test_the_line_limit_sees_a_long_module(tmp_path):
    """The check above can fail: a module one line too long is named, one at the limit is not."""
    long, ok = tmp_path / "long.py", tmp_path / "ok.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    ok.write_text("x = 1\n" * MAX_LINES)
    assert oversized([long, ok]) == [f"{long}: {MAX_LINES + 1}"]
