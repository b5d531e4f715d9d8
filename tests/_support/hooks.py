"""``installed``: a block's hooks ``(module, kind, fn)`` through the package's one registration
(:func:`pyvene_causaltrace.hooking.register`), taken off when the block ends. The tests' own
hooks (the package installs through :mod:`pyvene_causaltrace.applier`); :func:`edits_on` counts
the applier's edits on a module."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle

from pyvene_causaltrace.applier import _Applier, _appliers
from pyvene_causaltrace.hooking import register, release

#: kind -> (the module's registration method, with_kwargs)
KINDS: dict[str, tuple[str, bool]] = {
    "forward": ("register_forward_hook", False),
    "forward_with_kwargs": ("register_forward_hook", True),
    "forward_pre": ("register_forward_pre_hook", False),
    "forward_pre_with_kwargs": ("register_forward_pre_hook", True),
}

Hook = tuple[nn.Module, str, Callable]


@contextlib.contextmanager
def installed(hooks: Iterable[Hook]) -> Iterator[list[RemovableHandle]]:
    """Register ``hooks`` for the block (module docstring); yields their handles, in order.
    Each acts only on this thread's forwards (:func:`register`)."""
    hooks = list(hooks)
    for _, kind, _ in hooks:
        if kind not in KINDS:
            raise ValueError(f"unknown hook kind {kind!r}; kinds: {', '.join(KINDS)}")
    handles: list[RemovableHandle] = []
    try:
        for module, kind, fn in hooks:
            method, with_kwargs = KINDS[kind]
            handles.append(register(getattr(module, method), fn, with_kwargs=with_kwargs))
        yield handles
    finally:
        for handle in handles:
            release(handle)


def edits_on(model: nn.Module, module: nn.Module) -> int:
    """How many edits of this thread sit on ``module``'s input and output now."""
    applier = _appliers.get(model, {}).get(threading.get_ident(), _Applier())
    return sum(len(hook.edits) for (key, _), hook in applier.sites.items()
               if key == id(module))
