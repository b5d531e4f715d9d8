"""One measurement at a time on a model, in eval mode, leaving no hook behind.

    with measuring(model):          # a trace, a spec run, an attribution graph
        ...

A trace or a graph hooks the model it measures. Two threads measuring one model object would
mix their hooks and return each other's numbers, so a second call on the same model waits for
the first to finish (calls in one thread nest). Dropout in train mode would make every run
a different random function, so the block runs in eval mode and puts each module's mode back
afterwards (said once in the log when the model was in train mode). Whatever ends the block —
an error, Ctrl-C — a hook registered by this package or pyvene inside it and still on the model
is removed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

from .bound import BoundModel
from .pyvene_compat import is_intervenable

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

#: The hook tables of a module, and the tables sharing their ids (torch keeps flags there).
_HOOK_TABLES = {
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_backward_hooks": (),
    "_backward_pre_hooks": (),
}
#: Hooks from these packages are ours to clean up; any other hook is the user's and stays.
_OUR_PACKAGES = ("pyvene_causaltrace", "pyvene")

_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _lock(model: nn.Module) -> threading.RLock:
    with _locks_guard:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = threading.RLock()
        return lock


def underlying(model: nn.Module | BoundModel) -> nn.Module:
    """The ``nn.Module`` that holds the weights (the model a pyvene wrapper wraps, or a bound
    model's)."""
    return model.model if is_intervenable(model) or isinstance(model, BoundModel) else model


def _our_hook(hook) -> bool:
    module = getattr(hook, "__module__", None) or getattr(type(hook), "__module__", "")
    return module.split(".")[0] in _OUR_PACKAGES


def _remove_left_hooks(model: nn.Module, first_id: int) -> int:
    """Remove our hooks registered since handle id ``first_id`` (torch numbers every hook
    handle from one increasing counter, so those are exactly the hooks this block added)."""
    removed = 0
    for module in model.modules():
        for table, companions in _HOOK_TABLES.items():
            hooks = getattr(module, table, None)
            if not hooks:
                continue
            for hook_id in [key for key in hooks if key >= first_id]:
                if _our_hook(hooks[hook_id]):
                    del hooks[hook_id]
                    for companion in companions:
                        getattr(module, companion, {}).pop(hook_id, None)
                    removed += 1
    return removed


@contextlib.contextmanager
def measuring(model: nn.Module) -> Iterator[nn.Module]:
    """Hold ``model`` for one measurement (see module docstring); yields ``model``.

    ``model`` may be a pyvene ``IntervenableModel``: the model it wraps is the one held."""
    inner = underlying(model)
    with _lock(inner):
        modes = [(module, module.training) for module in inner.modules()]
        training = any(training for _, training in modes)
        if training:
            logger.warning("the model is in train mode: measuring it in eval mode (dropout off); "
                           "its mode is restored afterwards")
            inner.eval()
        first_id = RemovableHandle.next_id
        try:
            yield model
        finally:
            removed = _remove_left_hooks(inner, first_id)
            if removed:
                logger.warning("removed %d hook(s) an interrupted run left on the model", removed)
            if training:
                for module, was in modes:
                    module.training = was


def measured(function: F) -> F:
    """Run ``function`` inside :func:`measuring` of its argument named ``model``."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        model = signature.bind_partial(*args, **kwargs).arguments["model"]
        with measuring(model):
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
