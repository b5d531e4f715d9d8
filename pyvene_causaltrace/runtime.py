"""Our own forwards with registered intervention types applied: one hook runner.

    with intervened(model, [{"component": bound.site("embed"), "intervention": noise}]):
        logits = model(input_ids=ids).logits

pyvene stays the composition surface for users — every registered type runs inside a user's
``pv.IntervenableModel`` (:mod:`.pyvene_boundary`) and ``to_pyvene()`` of a spec builds one — but
the forwards this package runs itself need none of what an ``IntervenableModel`` adds around a
call (sources, unit locations, collection, its parameter surface). :func:`intervened` installs
the same representation dicts (``{"component": "<module path>.output" | ".input",
"intervention": made}``) as hooks through :func:`~.hooking.register` — gated to this thread,
removed when the block ends whatever ends it — and applies each as pyvene 0.1.8 applies it with
``unit_locations=None``: on a clone of the whole output (or of a pre-hook's first input),
written back into it in place, in the order given. Each hook announces its call
(module, inputs) to :func:`~.pyvene_boundary.calls.pyvene_call`, so the types that recompute
their module (frozen norms and attention) read no frame; interventions sharing state by id (a splice
built one by one) are bound among themselves first, as an ``IntervenableModel`` binds them.

The numbers are pyvene's bit for bit: ``tests/test_runtime.py`` runs every call site's
representations both ways.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from .bound import BoundModel, bare
from .errors import InputError
from .hooking import installed
from .models import get_module
from .pyvene_boundary.calls import PyveneCall, apply_like_pyvene, calling
from .pyvene_boundary.intervenable import bind_shared_state, weights_without_gradients

__all__ = ["intervened"]


class _Owner:
    """What an intervention sees as its owner in our runs (:attr:`PyveneCall.owner`): the
    interventions by key, never generating."""

    _is_generation = False

    def __init__(self, interventions: dict[str, nn.Module]) -> None:
        self.interventions = interventions


def _split(component: str) -> tuple[str, bool]:
    path, _, where = component.rpartition(".")
    if where not in ("output", "input") or not path:
        raise InputError(f"component {component!r}: expected '<module path>.output' or "
                         "'<module path>.input'")
    return path, where == "input"


def _hook(made: nn.Module, pre: bool, owner: _Owner, key: str):
    """The hook applying ``made`` as pyvene 0.1.8's setter does with ``unit_locations=None``:
    on a clone of the output (a tuple's first element; a pre-hook's first input, or its first
    keyword input in a keyword-only call), then written back into that tensor in place, so
    whatever else holds it — the residual stream a norm's input also feeds — sees the edit."""
    def apply(module, args, kwargs, value) -> None:
        target = value[0] if isinstance(value, tuple) else value
        with calling(PyveneCall(module, tuple(args), dict(kwargs or {}), None, owner, key)):
            edited = apply_like_pyvene(made, target)
        target[:] = edited

    if pre:
        def pre_hook(module, args, kwargs):
            apply(module, args, kwargs, args if args else kwargs[next(iter(kwargs))])
        return pre_hook

    def hook(module, args, kwargs, output):
        apply(module, args, kwargs, output)
    return hook


@contextlib.contextmanager
def intervened(model: nn.Module | BoundModel, representations: Sequence[dict[str, Any]], *,
               keep_model_gradients: bool = False) -> Iterator[nn.Module]:
    """Inside the block, this thread's forwards of ``model`` run with ``representations``
    applied (module docstring); yields the ``nn.Module`` to call. ``keep_model_gradients``: the
    weights' ``requires_grad`` flags stay as they are (else they are lowered for the block, as
    pyvene does, so a forward under autograd records no graph through the weights)."""
    module = bare(model)
    made = {f"{index}:{rep['component']}": rep["intervention"]
            for index, rep in enumerate(representations)}
    owner = _Owner(made)
    bind_shared_state(owner)
    hooks = []
    for (key, intervention), rep in zip(made.items(), representations, strict=True):
        path, pre = _split(rep["component"])
        hooks.append((get_module(module, path),
                      "forward_pre_with_kwargs" if pre else "forward_with_kwargs",
                      _hook(intervention, pre, owner, key)))
    with weights_without_gradients(module, keep_model_gradients), installed(hooks):
        yield module
