"""Lazy exports: a package names what it offers without importing it (torch, pyvene and
transformers load only when a name is used).

    __getattr__, __all__ = lazy_exports(__name__, {"trace": ".tracer", ...})
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """A module ``__getattr__`` resolving ``exports`` (name -> relative module) on first use,
    and the matching ``__all__``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name], package), name)

    return __getattr__, sorted(exports)
