"""Steering: inside :func:`collect_steering` (the attribution graph's forward) each user edit
applied through :func:`steering_edit` routes its constant part ``f(0)`` through a gradient leaf
(:class:`SteeringLeaf`), the value unchanged: the graph's steering nodes.
"""

from __future__ import annotations

import contextvars
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from ..hooking import in_context
from .calls import apply_like_pyvene, calling


@dataclass(frozen=True)
class SteeringSite:
    """Where a user's intervention acts: its key in the ``IntervenableModel``, class name,
    pyvene component, the hooked module's name in the wrapped model and whether it edits the
    module's input (a pre-hook)."""

    key: str
    intervention: str
    component: str
    module: str
    pre: bool

    @property
    def layer(self) -> int | None:
        """The block index in the module's name (``model.layers.1.mlp`` -> 1), None outside
        the blocks (embeddings, final norm)."""
        numbers = [int(part) for part in self.module.split(".") if part.isdecimal()]
        return numbers[0] if numbers else None

    def describe(self) -> dict:
        return {"key": self.key, "class": self.intervention, "component": self.component,
                "module": self.module, "layer": self.layer, "input": self.pre}


@dataclass
class SteeringLeaf:
    """The constant part ``c = f(0)`` of one call of a user's intervention ``f`` during a
    :func:`collect_steering` block, as a gradient leaf shaped like the edited tensor: the
    edited value is ``f(x) + (leaf - leaf.detach())``, exactly ``f(x)``, so ``leaf * grad`` is
    the constant's contribution. Zero constants (``ZeroIntervention``) are recorded too, never
    nodes. ``reached`` (set by the caller after the forward): whether the logits' gradient
    reaches the leaf — False when no gradient was recorded there, or the edited output is
    detached downstream (then ``leaf`` is None: its constant cannot be a node)."""

    site: SteeringSite
    leaf: torch.Tensor | None
    value: torch.Tensor
    reached: bool | None = None

    @property
    def is_zero(self) -> bool:
        return not bool(self.value.ne(0).any())

    @property
    def positions(self) -> torch.Tensor:
        """Positions (axis 1) where the constant is nonzero."""
        flat = self.value.reshape(self.value.shape[0], self.value.shape[1], -1) \
            if self.value.dim() >= 2 else self.value.reshape(1, -1, 1)
        return (flat != 0).any(-1).any(0).nonzero().squeeze(-1)


_STEERING: contextvars.ContextVar[list | None] = contextvars.ContextVar("pvct_steering",
                                                                       default=None)


def collect_steering() -> AbstractContextManager:
    """Inside the block, every call of a user's intervention applied by
    :func:`~.user_edits.applied_interventions` appends a :class:`SteeringLeaf` to the yielded
    list and, where a gradient is recorded, routes its value through the leaf (outside, ``f(0)``
    is not even computed). Each intervention our runs accept (zero, addition, subtraction, a
    constant source, ``noise_add``, restores with states) is affine, ``f(x) = A x + c``, so the
    leaf holds all of the edit that is not a path from ``x``."""
    return in_context(_STEERING, [])


def steering_edit(intervention: nn.Module, site: SteeringSite):
    """The :mod:`~..applier` edit applying ``intervention`` as pyvene does (a new value: the
    applier's rule; its call announced, to the whole value), its constant part recorded in
    :func:`collect_steering`."""
    def steer(value: torch.Tensor, call) -> torch.Tensor:
        with calling(call.module, call.args, call.kwargs, key=site.key):
            edited = apply_like_pyvene(intervention, value)
            collected = _STEERING.get()
            if collected is None:
                return edited
            with torch.no_grad():
                constant = apply_like_pyvene(intervention, torch.zeros_like(value)).detach()
        if not torch.is_grad_enabled():  # inside a module whose output is recomputed
            collected.append(SteeringLeaf(site, None, constant, reached=False))
            return edited
        leaf = constant.clone().requires_grad_(True)
        collected.append(SteeringLeaf(site, leaf, constant))
        return edited + (leaf - leaf.detach())

    return steer
