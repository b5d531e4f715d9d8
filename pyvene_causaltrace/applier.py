"""The one applier: every edit of every forward we run, applied in one place by one rule.

    with applying(model, [Edit(Site(block, "output"), restore), Edit(Site(embed, "output"), add)]):
        logits = model(input_ids=ids).logits

An :class:`Edit` is a function ``fn(value, call) -> tensor | None`` at a :class:`Site` — a
module's output (its first element when it returns a tuple) or its input (the first positional
argument, or the first keyword argument of a keyword-only call); ``call`` is the
:class:`Call` (module, args, kwargs) it happens in. None means "no change": a reader (a
capture) or a switch (grad mode) returns it. Everything the package does inside a forward is
such an edit: the trace engine's restores and noise, per-head restores, the splice, frozen
norms and attention, captures, a user's pyvene interventions and their steering leaves.

**One hook per site.** However many edits target a site in one thread, the site carries one
hook of ours (:func:`~.hooking.register`, gated to the thread), which runs them in the order
they were added — an outer block's (a user's interventions, added by the measurement) before an
inner one's (the run's own) — each on the value the previous left. The hook comes off when the
site's last edit leaves; edits leave when the block that added them ends, however it ends.

**The rule: an edit replaces the site's value.** The hook hands the new value on — returns the
new output, or the new first argument — so the module's readers see it, and the tensor the
module produced or was handed is never written. That is why it was chosen over writing in
place: a tensor autograd saved for the backward is never modified under it (no "modified by an
inplace operation"), a no-grad view is never written into, nothing is copied back, and an edit
may narrow what a module computes (the engine's last MLP on the last position alone). One kind
of site needs the same rule carried out differently: an input that *is* the residual stream
(the adapter's ``resid_pre`` / ``resid_mid``, the input of a block's norm, which the block's
residual add reads too without calling any module). There the readers of the site are the norm
and the add, and the add holds the tensor itself, so the new value is copied into it; a
:class:`Site` says which it is (``stream=True``), as the bound model knows
(:attr:`~.bound.BoundModel.stream_inputs`). This is what pyvene's setter does at such a site,
and the numbers of a spec run equal pyvene's bit for bit (``tests/test_runtime.py``).

Edits carry a ``group``: a replayed block (:mod:`.tracing.replay`) runs only the edits of the
groups :func:`only` keeps, in the blocks it names — its stored outputs already hold the
others'.

This module imports nothing from the package but :mod:`.hooking` and :mod:`.errors`.
"""

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
from .hooking import register, release

__all__ = ["Call", "Edit", "Site", "applying", "edits_on", "handle_ids", "only", "reader"]


@dataclass(frozen=True)
class Site:
    """A module's ``"output"`` or ``"input"``; ``stream``: an input that is the residual stream
    (module docstring: the new value is copied into it)."""

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
            return (new, *output[1:]) if isinstance(output, tuple) else new
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


def _applier(model: nn.Module) -> _Applier:
    me = threading.get_ident()
    with _lock:
        per_thread = _appliers.setdefault(model, {})
        applier = per_thread.get(me)
        if applier is None:
            applier = per_thread[me] = _Applier()
        return applier


def _forget(model: nn.Module, applier: _Applier) -> None:
    with _lock:
        per_thread = _appliers.get(model)
        if per_thread is not None and not applier.sites:
            per_thread.pop(threading.get_ident(), None)
            if not per_thread:
                del _appliers[model]


@contextlib.contextmanager
def applying(model: nn.Module, edits: Iterable[Edit]) -> Iterator[list[Edit]]:
    """``edits`` act on this thread's forwards of ``model`` inside the block (module
    docstring); yields them. Edits added by blocks opened inside this one run after these."""
    applier = _applier(model)
    added: list[Edit] = []
    try:
        for edit in edits:
            applier.add(edit)
            added.append(edit)
        yield added
    finally:
        for edit in reversed(added):
            applier.remove(edit)
        _forget(model, applier)


def edits_on(model: nn.Module, module: nn.Module) -> int:
    """How many edits of this thread sit on ``module``'s input and output now."""
    applier = _appliers.get(model, {}).get(threading.get_ident())
    if applier is None:
        return 0
    return sum(len(hook.edits) for (key, _), hook in applier.sites.items()
               if key == id(module))


@contextlib.contextmanager
def only(modules: Iterable[nn.Module], groups: Iterable[str]) -> Iterator[None]:
    """Inside the block, in this context, the edits at ``modules`` other than those of
    ``groups`` do nothing (a replayed block's stored output already holds them)."""
    token = _ONLY.set((frozenset(id(m) for m in modules), frozenset(groups)))
    try:
        yield
    finally:
        _ONLY.reset(token)


def reader(site: Site, store: dict, key: Any) -> Edit:
    """An edit that keeps the value the site's readers see in ``store[key]`` and changes
    nothing."""
    def read(value: torch.Tensor, _call: Call) -> None:
        store[key] = value
    return Edit(site, read, last=True)


def handle_ids(model: nn.Module) -> set[int]:
    """The ids of the hooks this thread's applier holds on ``model`` now."""
    applier = _appliers.get(model, {}).get(threading.get_ident())
    if applier is None:
        return set()
    return {hook.handle.id for hook in applier.sites.values() if hook.handle is not None}
