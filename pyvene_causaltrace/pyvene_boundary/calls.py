"""What pyvene's setter hook knows about an intervention's call and does not hand it.

pyvene 0.1.8 hands an intervention only the (gathered) output. The types that recompute their
module or have their own positions read the module, its inputs, the call's ``unit_locations``
and the owner from :func:`pyvene_call`, announced by our ``IntervenableModel``'s setter
(:func:`announcing_setter`: no frame or closure is read) or by our own hooks (:func:`calling`).
pyvene's own class announces nothing: there those types refuse (:func:`announced_call`).
"""

from __future__ import annotations

import contextvars
import functools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InputError, PyveneModelError
from ..hooking import in_context


@dataclass(frozen=True)
class PyveneCall:
    """What pyvene's hook knows about the call of an intervention and does not pass it.

    ``module``, ``args``, ``kwargs``: the hooked module and its inputs; ``unit_locations``: this
    intervention's base locations in this call (None: every position); ``owner``: the
    ``IntervenableModel`` (None in our own hooks); ``key``: the intervention's key in it.
    """

    module: nn.Module
    args: tuple
    kwargs: dict
    unit_locations: Any
    owner: Any
    key: str

    @property
    def generating(self) -> bool:
        """Inside ``IntervenableModel.generate``."""
        return bool(getattr(self.owner, "_is_generation", False))

    @property
    def generation_round(self) -> object:
        """An object that is the same for every step of one ``generate`` call and new for the
        next: pyvene replaces its hook counters at the start of each call."""
        return getattr(self.owner, "_key_setter_call_counter", None)


#: The call of the hook running now in this context, as :func:`announcing_setter` (or our hook
#: runner) announces it; None outside one.
_CALL: contextvars.ContextVar[PyveneCall | None] = contextvars.ContextVar("pvct_pyvene_call",
                                                                          default=None)


def calling(module: nn.Module, args: tuple, kwargs: dict | None, unit_locations: Any = None,
            owner: Any = None, key: str = "") -> AbstractContextManager:
    """Inside the block :func:`pyvene_call` returns this call (:class:`PyveneCall`'s fields):
    for a hook of ours that applies an intervention itself, to the whole value by default
    (:func:`~pyvene_causaltrace.runtime.intervened`, the trace engine, a user's edits)."""
    return in_context(_CALL, PyveneCall(module, tuple(args), dict(kwargs or {}), unit_locations,
                                        owner, key))


def applied(intervention: nn.Module, value: torch.Tensor, call: Any) -> torch.Tensor:
    """``intervention(value)`` in a hook of ours, the hook's ``call`` (the applier's: module
    and inputs) announced, to the whole value: the trace engine's direct application."""
    with calling(call.module, call.args, call.kwargs):
        return intervention(value)


def pyvene_call() -> PyveneCall | None:
    """The :class:`PyveneCall` of the pyvene setter hook (or our hook runner's hook) that is
    calling the caller, or None outside one (a direct call). ``tests/test_pyvene_setter.py``
    fails, naming pyvene's version, if pyvene registers its setter hooks otherwise."""
    return _CALL.get()


def _announcing(register, owner, key: str, locations: list, index: int):
    """``register`` (pyvene's ``intervention_hooks[key]``) registering each hook wrapped so
    that its calls set their :class:`PyveneCall` for :func:`pyvene_call`."""
    def register_announced(hook, *args: Any, **kwargs: Any):
        def announced(module, hook_args, hook_kwargs, *output):
            with calling(module, hook_args, hook_kwargs, locations[index], owner, key):
                return hook(module, hook_args, hook_kwargs, *output)
        return register(announced, *args, **kwargs)
    return register_announced


def announcing_setter(setter):
    """pyvene's ``_intervention_setter(self, keys, unit_locations_base, ...)`` with the
    register methods of ``keys`` announcing (:func:`_announcing`) for its run and put back
    after; its arguments, results and hooks' behaviour are pyvene's."""

    @functools.wraps(setter)
    def _intervention_setter(self, keys, unit_locations_base, *args: Any, **kwargs: Any):
        hooks = self.intervention_hooks
        saved = {key: hooks[key] for key in keys if callable(hooks.get(key))}
        hooks.update({key: _announcing(saved[key], self, key, unit_locations_base, i)
                      for i, key in enumerate(keys) if key in saved})
        try:
            return setter(self, keys, unit_locations_base, *args, **kwargs)
        finally:
            hooks.update(saved)

    return _intervention_setter


def announced_call(name: str, needs: str) -> PyveneCall:
    """The announced call (:func:`pyvene_call`) of a type ``name`` that ``needs`` it; refused
    without one — a plain ``pv.IntervenableModel``'s hook (or a direct call) announces none."""
    call = pyvene_call()
    if call is None:
        raise PyveneModelError(
            f"{name} {needs}, which pyvene's own IntervenableModel does not hand an intervention "
            "(nor does a direct call): build the model with "
            "pyvene_causaltrace.IntervenableModel(...), and load a saved one with "
            "pyvene_causaltrace.IntervenableModel.load(...), not pv.IntervenableModel.load")
    return call


def apply_like_pyvene(intervention: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """``intervention`` at every position of ``value`` as pyvene 0.1.8 applies it with
    ``unit_locations=None`` — on a clone of the tensor, through ``do_intervention`` — but
    returned as a new tensor: ``value`` itself (which may be an upstream module's output) is
    never written."""
    # pyvene is imported on first use (5 s): the package and the CLI's --help stay light
    from pyvene.models.interventions import InterventionOutput
    from pyvene.models.modeling_utils import do_intervention  # the same reason

    edited = do_intervention(value.clone(), None, intervention, None)
    if isinstance(edited, InterventionOutput):
        edited = edited.output
    if edited.shape != value.shape:
        raise InputError(f"{type(intervention).__name__} returned {tuple(edited.shape)} for an "
                         f"output of {tuple(value.shape)}")
    return edited

