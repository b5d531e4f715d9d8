"""``unchecked``: the parameters the argument boundary (:mod:`pyvene_causaltrace.arguments`)
does not check, for the fuzz test that holds them to what the package documents."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from pyvene_causaltrace.arguments import _checks_of


def unchecked(function: Callable) -> list[str]:
    """The parameters of ``function`` whose annotation admits anything (or names what the
    module imports only for type checkers)."""
    checks = _checks_of(function)
    return [name for name, p in inspect.signature(function).parameters.items()
            if name not in checks and name not in ("self", "cls")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
