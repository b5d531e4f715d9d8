"""The one applier: every edit of every forward we run, applied in one place by one rule
(why: docs/interventions.md, "One applier").

    with applying(model, [Edit(Site(block, "output"), restore), Edit(Site(embed, "output"), add)]):
        logits = model(input_ids=ids).logits

An :class:`Edit` is ``fn(value, call) -> tensor | None`` (None: no change) at a :class:`Site`: a
module's output (a tuple's first element) or its input (the first positional argument, else the
first keyword one). Each site carries one hook of ours per thread, running its edits in the
order added (outer blocks first). An edit *replaces* the site's value, never writing the tensor
autograd may have saved, except at a residual-stream input (``Site(stream=True)``), where the
new value is copied into it, as pyvene's setter does. A replayed block runs only the groups
:func:`only` keeps. Imports only :mod:`.hooking` and :mod:`.errors` from the package."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .errors import InputError
from .hooking import in_context, register, release

__all__ = ["Call", "Edit", "Site", "applying", "handle_ids", "only", "reader"]


@dataclass(frozen=True)
class Site:
    """A module's ``"output"`` or ``"input"``; ``stream``: an input that is the residual stream
    (the new value is copied into it)."""

    module: nn.Module
    where: str
    stream: bool = False

    def __post_init__(self) -> None:
        if self.where not in ("output", "input"):
            raise InputError(f"a site is a module's 'output' or 'input', got {self.where!r}")
        if self.stream and self.where != "input":
            raise InputError("only an input site is the residual stream itself")


@dataclass(frozen=True)
class Call:
    """The module call an edit runs in: the module, the arguments it was called with, and
    (at an output) what it returned — a tuple's first element is the value edits see."""

    module: nn.Module
    args: tuple
    kwargs: dict
    output: Any = None

    @property
    def returned_tuple(self) -> bool:
        return isinstance(self.output, tuple)


#: an edit's function: (value, call) -> the new value, or None for no change
EditFn = Callable[[torch.Tensor, Call], "torch.Tensor | None"]


@dataclass(eq=False)
class Edit:
    """``fn`` applied at ``site`` (module docstring); ``group`` names who added it. A reader
    (``last=True``) runs after the site's other edits, whenever it was added: it sees what the
    module's readers see."""

    site: Site
    fn: EditFn
    group: str = "run"
    last: bool = False


@dataclass(eq=False)
class _SiteHook:
    site: Site
    edits: list[Edit] = field(default_factory=list)
    handle: RemovableHandle | None = None


#: (ids of the modules replayed now, groups whose edits still run there)
_ONLY: contextvars.ContextVar[tuple[frozenset[int], frozenset[str]]] = contextvars.ContextVar(
    "pvct_applier_only", default=(frozenset(), frozenset()))


class _Applier:
    """The sites of one model edited in one thread."""

    def __init__(self) -> None:
        self.sites: dict[tuple[int, str], _SiteHook] = {}

    def add(self, edit: Edit) -> None:
        key = (id(edit.site.module), edit.site.where)
        hook = self.sites.get(key)
        if hook is None:
            hook = self.sites[key] = _SiteHook(edit.site)
            method = "register_forward_hook" if edit.site.where == "output" \
                else "register_forward_pre_hook"
            fn = self._output_hook(hook) if edit.site.where == "output" \
                else self._input_hook(hook)
            hook.handle = register(getattr(edit.site.module, method), fn, with_kwargs=True)
        elif edit.site.stream and not hook.site.stream:  # a reader may not know; a writer does
            hook.site = edit.site
        if edit.last:
            hook.edits.append(edit)
        else:
            at = next((i for i, e in enumerate(hook.edits) if e.last), len(hook.edits))
            hook.edits.insert(at, edit)

    def remove(self, edit: Edit) -> None:
        key = (id(edit.site.module), edit.site.where)
        hook = self.sites.get(key)
        if hook is None:
            return
        hook.edits = [e for e in hook.edits if e is not edit]
        if not hook.edits:
            del self.sites[key]
            if hook.handle is not None:
                release(hook.handle)

    @staticmethod
    def _run(hook: _SiteHook, value: torch.Tensor, call: Call) -> torch.Tensor:
        modules, keep = _ONLY.get()
        limited = bool(modules) and id(call.module) in modules
        for edit in hook.edits:
            if limited and edit.group not in keep:
                continue
            new = edit.fn(value, call)
            if new is not None:
                value = new
        return value

    def _output_hook(self, hook: _SiteHook):
        def apply(module, args, kwargs, output):
            is_tuple = isinstance(output, tuple)
            value = output[0] if is_tuple else output
            new = self._run(hook, value, Call(module, args, kwargs, output))
            if new is value:
                return None
            return (new, *output[1:]) if is_tuple else new
        return apply

    def _input_hook(self, hook: _SiteHook):
        stream = hook.site.stream

        def apply(module, args, kwargs):
            if args:
                value = args[0]
            elif kwargs:
                value = kwargs[next(iter(kwargs))]
            else:
                return None
            new = self._run(hook, value, Call(module, args, kwargs))
            if new is value:
                return None
            if stream:  # the residual add reads this tensor itself: the new value goes into it
                value.copy_(new)
                return None
            if args:
                return (new, *args[1:]), kwargs
            return args, {**kwargs, next(iter(kwargs)): new}
        return apply


_appliers: weakref.WeakKeyDictionary[nn.Module, dict[int, _Applier]] = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


@contextlib.contextmanager
def applying(model: nn.Module, edits: Iterable[Edit]) -> Iterator[list[Edit]]:
    """``edits`` act on this thread's forwards of ``model`` inside the block (module
    docstring); yields them. Edits added by blocks opened inside this one run after these."""
    with _lock:
        applier = _appliers.setdefault(model, {}).setdefault(threading.get_ident(), _Applier())
    added: list[Edit] = []
    try:
        for edit in edits:
            applier.add(edit)
            added.append(edit)
        yield added
    finally:
        for edit in reversed(added):
            applier.remove(edit)
        with _lock:  # this thread's applier goes with its last site
            per_thread = _appliers.get(model)
            if per_thread is not None and not applier.sites:
                per_thread.pop(threading.get_ident(), None)
                if not per_thread:
                    del _appliers[model]


def only(modules: Iterable[nn.Module], groups: Iterable[str]) -> contextlib.AbstractContextManager:
    """Inside the block, in this context, the edits at ``modules`` other than those of
    ``groups`` do nothing (a replayed block's stored output already holds them)."""
    return in_context(_ONLY, (frozenset(id(m) for m in modules), frozenset(groups)))


def reader(site: Site, store: dict, key: Any) -> Edit:
    """An edit that keeps the value the site's readers see in ``store[key]`` and changes
    nothing."""
    def read(value: torch.Tensor, _call: Call) -> None:
        store[key] = value
    return Edit(site, read, last=True)


def handle_ids(model: nn.Module) -> set[int]:
    """The ids of the hooks this thread's applier holds on ``model`` now."""
    applier = _appliers.get(model, {}).get(threading.get_ident(), _Applier())
    return {hook.handle.id for hook in applier.sites.values() if hook.handle is not None}
