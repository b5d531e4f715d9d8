"""docs/layout.md is true of the code: every module it names exists, every package module is on
it, and the floors it draws are the floors the imports keep (a module imports from its own
floor or below, imports inside functions included).

The page's first code block is the floor diagram: ``floor N  <name>  <entries>``, entries being
package paths (``tracing/``, ``bound.py``, ``transcoders/checks.py``; a folder holds every
module below it unless a deeper entry names one) or words in parentheses. Its second is "what
lives where": two-space-indented entries (``bound.py``, ``tracing/``), each folder's text naming
every module directly in it (a word, ``engine``) and each folder below it (``formats/``).
"""

from __future__ import annotations

import re

import pytest
from test_house import MODULES, NAME, PACKAGE, _imports

PAGE = PACKAGE.parent / "docs" / "layout.md"
_BLOCK = re.compile(r"^```\n(.*?)^```", re.S | re.M)
_FLOOR = re.compile(r"^floor (\d+)\s")


def _blocks() -> tuple[str, str]:
    blocks = _BLOCK.findall(PAGE.read_text(encoding="utf-8"))
    return blocks[0], blocks[1]


def floors(diagram: str) -> dict[str, int]:
    """Package path (``tracing/``, ``bound.py``) -> its floor, from the diagram."""
    found: dict[str, int] = {}
    floor = None
    for line in diagram.splitlines():
        match = _FLOOR.match(line)
        if match:
            floor = int(match[1])
        text = re.sub(r"\([^)]*\)", "", line)  # words in parentheses are no paths
        for path in re.findall(r"[\w./]+(?:\.py|\.json|/)(?=[\s,]|$)", text):
            found[path] = floor
    return found


def floor_of(module: str, page_floors: dict[str, int]) -> int | None:
    """The floor of a dotted package module: its own entry, else its deepest folder's."""
    relative = MODULES[module].relative_to(PACKAGE).as_posix()
    if relative in page_floors:
        return page_floors[relative]
    parts = relative.split("/")[:-1]
    for depth in range(len(parts), 0, -1):
        folder = "/".join(parts[:depth]) + "/"
        if folder in page_floors:
            return page_floors[folder]
    return None


def entries(lives: str) -> dict[str, str]:
    """"What lives where": entry (``bound.py``, ``tracing/``) -> its text."""
    found: dict[str, str] = {}
    current = None
    for line in lives.splitlines():
        match = re.match(r"^  (\S+)\s*(.*)$", line)
        if match:
            current = match[1]
            found[current] = match[2]
        elif current is not None and line.startswith("   "):
            found[current] += " " + line.strip()
        elif not line.startswith(" "):
            current = None  # a top-level line (pyvene_causaltrace/, tests/)
    return found


def problems(diagram: str, lives: str) -> list[str]:
    found = []
    page_floors = floors(diagram)
    for path in page_floors:
        if not (PACKAGE / path).exists():
            found.append(f"the floors name {path}, which is not in the package")
    described = entries(lives)
    for path in described:
        if not (PACKAGE / path).exists():
            found.append(f"what lives where names {path}, which is not in the package")
    for module, file in MODULES.items():
        relative = file.relative_to(PACKAGE)
        if file.name in ("__init__.py", "__main__.py") or module == NAME:
            continue
        if floor_of(module, page_floors) is None:
            found.append(f"{relative.as_posix()} is on no floor")
        top = relative.parts[0] + ("/" if len(relative.parts) > 1 else "")
        if top not in described:
            found.append(f"{relative.as_posix()}: {top} is not in what lives where")
        elif len(relative.parts) > 1:
            text = described[top]
            named = relative.parts[1] + "/" if len(relative.parts) > 2 else relative.stem
            if not re.search(rf"(?<![\w/]){re.escape(named)}(?![\w])", text):
                found.append(f"{relative.as_posix()}: {top}'s text does not name {named}")
    return found


def climbs(diagram: str) -> list[str]:
    """Imports from a higher floor than the importer's."""
    page_floors = floors(diagram)
    found = []
    for module, path in MODULES.items():
        mine = floor_of(module, page_floors)
        for _node, _nested, targets in _imports(module, path):
            for target in targets:
                theirs = floor_of(target, page_floors)
                if mine is not None and theirs is not None and theirs > mine \
                        and not module.startswith(target + "."):
                    found.append(f"{module} (floor {mine}) imports {target} (floor {theirs})")
    return sorted(set(found))


def test_every_module_is_on_the_page_and_every_name_exists():
    assert problems(*_blocks()) == []


def test_no_module_imports_from_a_floor_above_its_own():
    assert climbs(_blocks()[0]) == []


def test_the_check_sees_a_missing_module_a_ghost_and_a_climb():
    diagram, lives = _blocks()
    ghost = diagram.replace("errors.py", "errors.py, ghost.py", 1)
    assert "the floors name ghost.py, which is not in the package" in problems(ghost, lives)
    without = lives.replace("\n  bound.py", "\n  unbound.py", 1)
    missing = problems(diagram, without)
    assert "bound.py: bound.py is not in what lives where" in missing
    assert any("unbound.py, which is not in the package" in p for p in missing)
    errors_floor = re.search(r"^floor (\d+).*errors\.py", diagram, re.M)
    assert errors_floor is not None
    raised = "floor 9  roof  errors.py\n" + diagram.replace("errors.py,", "", 1)
    assert any(c.endswith("imports pyvene_causaltrace.errors (floor 9)")
               for c in climbs(raised))


@pytest.mark.parametrize("entry", ["tracing/", "bound.py"])
def test_the_page_reads_its_own_entries(entry):
    assert entry in floors(_blocks()[0]) and entry in entries(_blocks()[1])
