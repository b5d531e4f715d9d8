"""Hooks we put on a model for one block, and take off again whatever ends it.

    with installed([(block, "forward", read), (norm, "forward_pre", edit)]) as handles:
        model(**inputs)

Each hook is ``(module, kind, fn)``; ``kind`` names the torch registration: ``forward``
(``fn(module, args, output)``), ``forward_pre`` (``fn(module, args)``), and their
``_with_kwargs`` forms, which also hand ``fn`` the call's keyword arguments. Hooks are registered
in the order given. When the block ends — normally, on an exception, on Ctrl-C — every hook it
registered is removed, and only those: hooks the user registered before or inside the block stay.

This module imports nothing from the package: every other module may import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle

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
    """Register ``hooks`` for the block (module docstring); yields their handles, in order."""
    hooks = list(hooks)
    for _, kind, _ in hooks:
        if kind not in KINDS:
            raise ValueError(f"unknown hook kind {kind!r}; kinds: {', '.join(KINDS)}")
    handles: list[RemovableHandle] = []
    try:
        for module, kind, fn in hooks:
            method, with_kwargs = KINDS[kind]
            register = getattr(module, method)
            handles.append(register(fn, with_kwargs=True) if with_kwargs else register(fn))
        yield handles
    finally:
        for handle in handles:
            handle.remove()
