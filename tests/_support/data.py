"""Paths and data the tests read: the shipped specs, the project's own facts, ROME's
known_1000 where it is beside the checkout."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

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


def fetch_file_urls(monkeypatch) -> None:
    """pooch fetches ``file://`` URLs (a mirror on disk, never the network) by copying them,
    for tests that point a named dataset's source at one; any other URL as before."""
    import pooch.core

    choose = pooch.core.choose_downloader

    def chooser(url: str, progressbar: bool = False):
        return _copy_file if url.startswith("file:") else choose(url, progressbar=progressbar)

    monkeypatch.setattr(pooch.core, "choose_downloader", chooser)


def _copy_file(url: str, output_file, pooch_instance=None, check_only: bool = False):
    """A pooch downloader for ``file://`` URLs (was ``dataset.sources._file_downloader``)."""
    source = Path(urlparse(url).path)
    if check_only:
        return source.is_file()
    if not source.is_file():
        raise FileNotFoundError(f"no file at {url}")
    if hasattr(output_file, "write"):
        output_file.write(source.read_bytes())
    else:
        shutil.copyfile(source, output_file)
    return None
