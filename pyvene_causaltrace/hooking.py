"""Hooks we put on a model, and take off again whatever ends their run.

Every hook of the package goes through :func:`register` (torch's public methods; off only
through its handle, :func:`release`), called by the one applier (:mod:`.applier`), and acts
only on the forwards of the thread that installed it; :func:`thread_gate` and
:func:`thread_view` do the same for a replaced ``forward`` and a switched setting. Per context,
:func:`recording` removes at a measurement's end any hook registered in it that is still there,
and :func:`silenced` turns the package's hooks on given modules off (:mod:`.tracing.replay`);
:func:`in_context` is the context-variable switch they (and the package's others) share.
Imports nothing from the package."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

_ident = threading.get_ident
_NAMES = ("__name__", "__qualname__", "__doc__")


#: (ids of the modules whose hooks of ours are silent, handle ids kept running there)
_SILENT: contextvars.ContextVar[tuple[frozenset[int], frozenset[int]]] = contextvars.ContextVar(
    "pvct_silent", default=(frozenset(), frozenset()))
#: the innermost :class:`HookRecord` of this context, or None
_RECORD: contextvars.ContextVar[HookRecord | None] = contextvars.ContextVar("pvct_hook_record",
                                                                           default=None)
#: the attribute that marks a hook as the package's; its handle's id once registered
_MARK = "pvct_handle_id"


@contextlib.contextmanager
def in_context(var: contextvars.ContextVar, value: Any) -> Iterator[Any]:
    """Inside the block, context variable ``var`` holds ``value`` (the block's ``as`` target),
    set back on every exit: the one body of the package's per-context switches."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def is_ours(hook: Callable) -> bool:
    """Whether ``hook`` (a value of a module's hook table) was made by :func:`register`."""
    return hasattr(hook, _MARK)


class HookRecord:
    """The handles of the hooks registered inside one :func:`recording` block (and in no inner
    one) that have not been released."""

    def __init__(self, parent: HookRecord | None) -> None:
        self.parent = parent
        self.live: dict[int, RemovableHandle] = {}
        self.left = 0  # set when the block ends: how many hooks were still registered

    def release(self, handle: RemovableHandle) -> None:
        record: HookRecord | None = self
        while record is not None and record.live.pop(handle.id, None) is None:
            record = record.parent

    def remove_all(self) -> int:
        """Remove every hook still noted; returns how many were still registered."""
        left = 0
        for handle in self.live.values():
            hooks = handle.hooks_dict_ref()
            left += hooks is not None and handle.id in hooks
            handle.remove()
        self.live.clear()
        return left


@contextlib.contextmanager
def recording() -> Iterator[HookRecord]:
    """Note every hook :func:`register` adds in this context inside the block; at its end
    remove those still registered (``record.left``: how many were)."""
    record = HookRecord(_RECORD.get())
    try:
        with in_context(_RECORD, record):
            yield record
    finally:
        record.left = record.remove_all()


def register(register_method: Callable, fn: Callable, *args: Any,
             **kwargs: Any) -> RemovableHandle:
    """``register_method(hook, *args, **kwargs)`` — a module's bound ``register_forward_hook``
    or ``register_forward_pre_hook`` — noted in the current :func:`recording` block until
    :func:`release`. ``hook`` is ``fn`` acting only in the calling thread: None (no change) in
    any other, and in this one while its module is :func:`silenced` (unless kept)."""
    owner = _ident()

    def hook(*args):
        if _ident() != owner:
            return None
        modules, keep = _SILENT.get()
        if modules and id(args[0]) in modules and getattr(hook, _MARK) not in keep:
            return None
        return fn(*args)

    functools.wraps(fn, assigned=_NAMES)(hook)
    setattr(hook, _MARK, None)
    handle = register_method(hook, *args, **kwargs)
    setattr(hook, _MARK, handle.id)
    record = _RECORD.get()
    if record is not None:
        record.live[handle.id] = handle
    return handle


def release(handle: RemovableHandle) -> None:
    """Remove a hook :func:`register` added."""
    handle.remove()
    record = _RECORD.get()
    if record is not None:
        record.release(handle)


def silenced(modules: Iterable[nn.Module],
             keep: Iterable[int] = ()) -> contextlib.AbstractContextManager:
    """Inside the block, in this context, the package's hooks (:func:`is_ours`) on ``modules``
    return None — change nothing, record nothing — except those whose handle ids are in
    ``keep``. Anyone else's hook is untouched: the caller checks there is none
    (:mod:`.tracing.replay`)."""
    return in_context(_SILENT, (frozenset(id(module) for module in modules), frozenset(keep)))


def thread_gate() -> Callable[[], bool]:
    """A check true in the calling thread only: a ``forward`` we replace for a run does its
    own work when it holds and calls the module's own forward otherwise."""
    owner = _ident()
    return lambda: _ident() == owner



# ------------------------------------------------------------ settings switched for one thread

#: id(obj) -> {thread: [overrides, ...]} (a stack: views nest), while a view is open on obj
_views: dict[int, dict[int, list[dict[str, Any]]]] = {}
_view_bases: dict[int, type] = {}
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


@functools.cache
def _view_class(base: type, names: frozenset) -> type:
    return type(base.__name__, (base,), {name: _view_property(name) for name in names}
                | {"__module__": base.__module__, "__qualname__": base.__qualname__})


@contextlib.contextmanager
def thread_view(obj: Any, **overrides: Any) -> Iterator[None]:
    """Inside the block, the calling thread reads ``obj.<name>`` as ``overrides[name]``; every
    other thread reads the real values, which are never written (a setting switched for a run
    on a shared object, such as the model's config). ``obj`` is meanwhile an instance of a
    subclass with a property per name (plain attributes only); views nest and stack per thread."""
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
