"""Hooks we put on a model for one block, and take off again whatever ends it.

    with installed([(block, "forward", read), (norm, "forward_pre", edit)]) as handles:
        model(**inputs)

Each hook is ``(module, kind, fn)``; ``kind`` names the torch registration: ``forward``
(``fn(module, args, output)``), ``forward_pre`` (``fn(module, args)``), and their
``_with_kwargs`` forms, which also hand ``fn`` the call's keyword arguments. Hooks are registered
in the order given. When the block ends — normally, on an exception, on Ctrl-C — every hook it
registered is removed, and only those: hooks the user registered before or inside the block stay.

A hook is global to its module: a forward from any thread runs it. Ours act only on the forwards
of the thread that installed them — the measuring thread — and return None (change nothing) in
every other, so a user's own forward of the same model in another thread sees the bare model.
The same gate serves everything else we put on a model for a run: :func:`thread_gate` for a
replaced ``forward`` (other threads get the module's own), :func:`thread_view` for settings we
switch on a shared object such as the model's config (other threads read the real values).

This module imports nothing from the package: every other module may import it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

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

_ident = threading.get_ident
_NAMES = ("__name__", "__qualname__", "__doc__")  # not __module__: model_guard reads ours


def gated(fn: Callable, owner: int | None = None, *, ours: bool = True) -> Callable:
    """Hook ``fn`` acting only in thread ``owner`` (default: the calling thread); None — no
    change — in any other. ``ours=False``: the reverse, ``fn`` acts everywhere except there
    (a user's hook set aside for our forwards only)."""
    owner = _ident() if owner is None else owner
    if ours:
        def hook(*args):
            return fn(*args) if _ident() == owner else None
    else:
        def hook(*args):
            return None if _ident() == owner else fn(*args)
    return functools.wraps(fn, assigned=_NAMES)(hook)


def thread_gate() -> Callable[[], bool]:
    """A check true in the calling thread only: a ``forward`` we replace for a run does its
    own work when it holds and calls the module's own forward otherwise."""
    owner = _ident()
    return lambda: _ident() == owner


@contextlib.contextmanager
def installed(hooks: Iterable[Hook]) -> Iterator[list[RemovableHandle]]:
    """Register ``hooks`` for the block (module docstring); yields their handles, in order.
    Each acts only on this thread's forwards (:func:`gated`)."""
    hooks = list(hooks)
    for _, kind, _ in hooks:
        if kind not in KINDS:
            raise ValueError(f"unknown hook kind {kind!r}; kinds: {', '.join(KINDS)}")
    handles: list[RemovableHandle] = []
    try:
        for module, kind, fn in hooks:
            method, with_kwargs = KINDS[kind]
            register = getattr(module, method)
            fn = gated(fn)
            handles.append(register(fn, with_kwargs=True) if with_kwargs else register(fn))
        yield handles
    finally:
        for handle in handles:
            handle.remove()


# ------------------------------------------------------------ settings switched for one thread

#: id(obj) -> {thread: [overrides, ...]} (a stack: views nest), while a view is open on obj
_views: dict[int, dict[int, list[dict[str, Any]]]] = {}
_view_bases: dict[int, type] = {}
_view_classes: dict[tuple[type, frozenset], type] = {}
_views_lock = threading.Lock()


def _view_property(name: str) -> property:
    def get(self):
        stack = _views.get(id(self), {}).get(_ident())
        if stack and name in stack[-1]:
            return stack[-1][name]
        try:
            return self.__dict__[name]
        except KeyError:
            return getattr(super(type(self), self), name)

    def set_(self, value):
        self.__dict__[name] = value

    return property(get, set_)


def _view_class(base: type, names: frozenset) -> type:
    key = (base, names)
    if key not in _view_classes:
        _view_classes[key] = type(base.__name__, (base,),
                                  {name: _view_property(name) for name in names}
                                  | {"__module__": base.__module__,
                                     "__qualname__": base.__qualname__})
    return _view_classes[key]


@contextlib.contextmanager
def thread_view(obj: Any, **overrides: Any) -> Iterator[None]:
    """Inside the block, the calling thread reads ``obj.<name>`` as ``overrides[name]``; every
    other thread reads the real values, which are never written.

    For a setting we switch for a run on an object the model shares between threads — the
    attention implementation or the logit soft-cap on the model's config. While a view is
    open ``obj`` is an instance of a subclass with a property per overridden name (plain
    attributes of ``obj`` only); its own class is back when the last view on it closes.
    Views nest and stack per thread."""
    key, me = id(obj), _ident()
    with _views_lock:
        threads = _views.setdefault(key, {})
        base = _view_bases.setdefault(key, type(obj))
        stack = threads.setdefault(me, [])
        stack.append({**(stack[-1] if stack else {}), **overrides})
        names = frozenset(name for per in threads.values() for view in per for name in view)
        obj.__class__ = _view_class(base, names)
    try:
        yield
    finally:
        with _views_lock:
            stack.pop()
            if not stack:
                del threads[me]
            if threads:
                names = frozenset(name for per in threads.values() for view in per
                                  for name in view)
                obj.__class__ = _view_class(base, names)
            else:
                obj.__class__ = base
                del _views[key], _view_bases[key]
