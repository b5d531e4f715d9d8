"""The package's shape, from one fresh interpreter: importing the package, and building the
CLI's parser (``--help``), loads none of torch, pyvene or transformers; the top level offers a
dozen names and each resolves; every module imports on its own (no import cycles)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process

_SCRIPT = """
import importlib, json, pkgutil, sys
HEAVY = ("torch", "pyvene", "transformers")
def loaded():
    return sorted(name for name in HEAVY if name in sys.modules)
import pyvene_causaltrace as p
report = {"after_import": loaded(), "version": p.__version__, "all": len(p.__all__)}
from pyvene_causaltrace.cli.parser import build_parser
build_parser()
report["after_parser"] = loaded()
[getattr(p, name) for name in p.__all__]
report["IntervenableModel"] = p.IntervenableModel.__name__
names = [m.name for m in pkgutil.walk_packages(p.__path__, "pyvene_causaltrace.")
         if not m.name.endswith(".__main__")]  # running it is its job
failed = []
for name in names:
    for module in [k for k in sys.modules if k.startswith("pyvene_causaltrace")]:
        del sys.modules[module]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{name}: {type(error).__name__}: {error}")
report["modules"], report["failed"] = len(names), failed
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.core
def test_importing_the_package_or_the_cli_parser_loads_nothing_heavy(report):
    """(was three subprocess checks: test_imports' top-level one, test_models' side effects,
    test_cli's --help)"""
    assert report["after_import"] == [], report
    assert report["after_parser"] == [], report
    assert report["version"]


@pytest.mark.core
def test_the_top_level_is_small_and_resolves(report):
    assert 0 < report["all"] <= 16 and report["IntervenableModel"] == "IntervenableModel"


@pytest.mark.core
def test_every_module_imports_on_its_own(report):
    assert report["modules"] > 40
    assert report["failed"] == []
