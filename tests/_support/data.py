"""Paths and data the tests read: the shipped specs, the project's own facts, ROME's
known_1000 where it is beside the checkout."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC_DIR = ROOT / "intervention_specs"
KNOWN_FACTS = Path(os.environ.get("PVCT_KNOWN_1000",
                                   ROOT.parent / "shared" / "data" / "known_1000.json"))
#: The project's own facts in known_1000's format (tests/data/make_facts.py writes them): what
#: the machinery tests read, so a fresh clone with nothing beside it runs them.
PROJECT_FACTS = ROOT / "tests" / "data" / "facts.json"


def tool(name: str) -> ModuleType:
    """The development tool ``tools/<name>.py`` (not shipped in the wheel) as a module."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def known_facts() -> Path:
    """ROME's real known_1000.json ($PVCT_KNOWN_1000, else beside the checkout, where CI has
    it); without it the tests that need the real set are skipped, saying why."""
    if not KNOWN_FACTS.exists():
        pytest.skip(f"needs ROME's known_1000.json at {KNOWN_FACTS} (absent; set "
                    "PVCT_KNOWN_1000)")
    return KNOWN_FACTS


def fact_texts() -> list[str]:
    """"prompt attribute" of each of the project's own facts (1,200)."""
    return [f"{f['prompt']} {f['attribute']}" for f in json.loads(PROJECT_FACTS.read_text())]
