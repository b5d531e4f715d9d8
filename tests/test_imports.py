"""The package's shape: every module imports on its own (no import cycles), the top level
offers a dozen names, each resolves, and importing the package loads neither torch nor pyvene."""

from __future__ import annotations

import subprocess
import sys

_EACH_ALONE = """
import importlib, pkgutil, sys
import pyvene_causaltrace as pkg
names = [m.name for m in pkgutil.walk_packages(pkg.__path__, "pyvene_causaltrace.")
         if not m.name.endswith(".__main__")]  # running it is its job
failed = []
for name in names:
    for loaded in [k for k in sys.modules if k.startswith("pyvene_causaltrace")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{name}: {type(error).__name__}: {error}")
print(len(names))
print("\\n".join(failed))
"""


def test_every_module_imports_on_its_own():
    done = subprocess.run([sys.executable, "-c", _EACH_ALONE], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    count, *failed = done.stdout.strip().split("\n")
    assert int(count) > 40
    assert not [f for f in failed if f], failed


def test_the_top_level_is_small_lazy_and_resolves():
    code = ("import sys, pyvene_causaltrace as p; print(len(p.__all__)); "
            "print('torch' in sys.modules, 'pyvene' in sys.modules); "
            "[getattr(p, name) for name in p.__all__]; print(p.IntervenableModel.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    count, lazy, cls = done.stdout.strip().split("\n")[-3:]
    assert int(count) <= 15 and lazy == "False False" and cls
