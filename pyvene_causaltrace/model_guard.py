"""One measurement at a time on a model, in eval mode, leaving no hook behind.

    with measurement(bound) as model:   # a trace, a spec run, an attribution graph
        ...

:func:`measurement` is what a public call runs inside: :func:`measuring` of the bound model,
the user's pyvene interventions on every forward when it was bound from a
``pv.IntervenableModel`` (:func:`~.pyvene_boundary.user_edits.applied_interventions`), and the
weights' ``requires_grad`` flags as loaded. :func:`measured` runs a function inside one.

Why (docs/errors.md, "State we refuse to measure in"): two threads hooking one model would mix
their numbers, so a second call waits for the first (calls in one thread nest); dropout would
make every run a different function, so the block runs in eval mode and puts each module's
mode back. A hook this package registered (:func:`~pyvene_causaltrace.hooking.register`) and
still on the model when the block ends is removed through its handle — a second line behind
every path's own ``finally``, logged when it finds one; anyone else's hooks stay.
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

from .arguments import call_checker
from .bound import BoundModel, bind
from .errors import PyveneModelError
from .hooking import recording
from .models import is_intervenable
from .pyvene_boundary.intervenable import uniform_grad_flags
from .pyvene_boundary.user_edits import applied_interventions

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _lock(model: nn.Module) -> threading.RLock:
    with _locks_guard:
        return _locks.setdefault(model, threading.RLock())


@contextlib.contextmanager
def measuring(model: nn.Module) -> Iterator[nn.Module]:
    """Hold ``model`` for one measurement (see module docstring); yields ``model``.

    ``model`` may be a pyvene ``IntervenableModel``: the model it wraps is the one held."""
    inner = model.model if is_intervenable(model) else model  # the one holding the weights
    with _lock(inner):
        modes = [(module, module.training) for module in inner.modules()]
        training = any(training for _, training in modes)
        if training:
            logger.warning("the model is in train mode: measuring it in eval mode (dropout off); "
                           "its mode is restored afterwards")
            inner.eval()
        record = None
        try:
            with recording() as record:
                yield model
        finally:
            if record is not None and record.left:
                logger.warning("removed %d hook(s) an interrupted run left on the model",
                               record.left)
            if training:
                for module, was in modes:
                    module.training = was


@contextlib.contextmanager
def measurement(bound: BoundModel) -> Iterator[nn.Module]:
    """One measurement of ``bound`` (module docstring): yields the module to run, with the
    interventions ``bound`` carries acting on its forwards until the block ends."""
    with measuring(bound.model), applied_interventions(bound) as model, \
            uniform_grad_flags(model):
        bound.applying += 1
        try:
            yield model
        finally:
            bound.applying -= 1


def measured(function: F | None = None, *, interventions: bool = False):
    """Run ``function`` inside :func:`measurement` of its argument named ``model``, bound
    (:func:`~.bound.bind`) and handed to it bound, once its arguments pass their annotations
    (:func:`~.arguments.checked`). ``interventions``: a ``pv.IntervenableModel`` is taken (its
    interventions act in the run); otherwise :class:`~.errors.PyveneModelError` refuses it."""
    if function is None:
        return functools.partial(measured, interventions=interventions)
    signature = inspect.signature(function)
    check = call_checker(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        call = signature.bind_partial(*args, **kwargs)
        if "model" not in call.arguments:  # refused by its arguments, or Python's TypeError
            check(call)
            return function(*call.args, **call.kwargs)
        given = call.arguments["model"]
        if not interventions and (is_intervenable(given) or (
                isinstance(given, BoundModel) and given.carries_interventions)):
            raise PyveneModelError(
                f"{function.__name__} takes the bare model: it applies its own interventions "
                "to it (pass pv_model.model)")
        pyvene = is_intervenable(given)  # bind() says what it refuses in one first
        if not pyvene:
            check(call)
        bound = bind(given, interventions=interventions)
        call.arguments["model"] = bound
        with measurement(bound):  # a pyvene model's refusals (its edits) come first
            if pyvene:
                check(call)
            return function(*call.args, **call.kwargs)

    wrapper.__checked__ = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
