"""A user's ``pv.IntervenableModel`` in our runs: :func:`applied_interventions` applies its
edits as pyvene does at every position of every forward; :func:`user_edits` refuses any our runs
cannot apply so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..applier import Edit, Site, applying
from ..bound import BoundModel
from ..errors import PyveneModelError
from .intervenable import bind_shared_state
from .quiet_import import import_pyvene
from .steering import SteeringSite, steering_edit

#: Why pyvene's NoiseIntervention cannot act where we apply a type at every position.
NOISE_INTERVENTION_REFUSAL = (
    "pyvene's NoiseIntervention adds a fixed draw for exactly 4 positions (seed 1, GPT-2-XL's "
    "noise level), and {where} applies it at every position: use noise_add (NoiseAdd) for "
    "seeded noise at chosen positions")


def _refusal(key: str, made: nn.Module, representation: Any) -> str | None:
    """Why our runs cannot apply the user's intervention ``key`` as pyvene would, or None."""
    if isinstance(made, import_pyvene().NoiseIntervention):
        return f"{key}: " + NOISE_INTERVENTION_REFUSAL.format(where="each of our runs")
    if "h" in str(getattr(representation, "unit", "pos") or "pos").split("."):
        return (f"{key}: unit {representation.unit!r} picks heads through unit_locations, which "
                "our runs cannot give (they apply your interventions at every position, where "
                "pyvene hands the whole module output). Put the head edit in a hand hook on "
                "pv_model.model, or run it with pv_model yourself")
    return None


def _shared_input_refusal(key: str, register: Any, bound: BoundModel) -> str | None:
    """Why a user's edit of a residual norm's *input* cannot run in our runs, or None.

    pyvene writes an input edit in place into the module's first argument, which for a block's
    norm may be the residual stream itself (Llama's), so the edit also reaches the skip path;
    our runs replace the norm's input and would compute another model. Which tensors alias is
    the architecture code's business, so every residual norm's input edit is refused."""
    module = getattr(register, "__self__", None)
    if getattr(register, "__name__", "") != "register_forward_pre_hook" \
            or id(module) not in bound.stream_inputs:  # the blocks' pre-attention/MLP norms
        return None
    name = next((n for n, m in bound.model.named_modules() if m is module), "")
    return (f"{key}: edits the input of {name}, a norm that reads the residual stream: pyvene "
            "writes such an edit in place into the tensor the norm reads, in some "
            "architectures the residual stream itself (the skip path around the sublayer "
            "then sees it too), which our runs do not reproduce. Put the edit "
            "on the block's input or output (block_input / block_output), or on the norm's "
            "output")


def user_edits(bound: BoundModel) -> list[tuple[str, nn.Module, Any]]:
    """``(key, intervention, representation)`` of the pyvene ``IntervenableModel`` ``bound``
    was bound from that act on the output, in pyvene's order (none for a plain model); refuses
    (``PyveneModelError``) any our runs cannot apply."""
    if not bound.carries_interventions:
        return []
    model = bound.given
    needy = [key for key, made in model.interventions.items()
             if not getattr(made, "is_source_constant", False)]
    if needy:
        raise PyveneModelError(
            f"this IntervenableModel's {', '.join(needy)} need a source at call time; our runs "
            "(clean, corrupted, restored) have none to give. Pass pv_model.model, or keep in "
            "the IntervenableModel only interventions that hold their own values (zero, "
            "constant, noise_add, restores with states)")
    edits = []
    for key, made in model.interventions.items():
        representation = model.representations.get(key)
        reason = _refusal(key, made, representation) or _shared_input_refusal(
            key, model.intervention_hooks.get(key), bound)
        if reason is not None:
            raise PyveneModelError(reason)
        if not isinstance(made, import_pyvene().CollectIntervention):  # changes nothing
            edits.append((key, made, representation))
    return edits


@contextlib.contextmanager
def applied_interventions(bound: BoundModel) -> Iterator[nn.Module]:
    """Yield the model to run: ``bound``'s, with — when it was bound from a pyvene
    ``IntervenableModel`` — the wrapper's interventions applied to every forward inside the
    block (docs/interventions.md, "Your pv.IntervenableModel in our calls").

    They act at every position in every run our calls make, so a trace or a graph is one *of
    the intervened model*; each is applied as pyvene applies it
    (:func:`~.calls.apply_like_pyvene`) and replaces the module's input or output, never
    writing it. What our runs cannot apply so is refused by :func:`user_edits`. Inside
    :func:`~.steering.collect_steering` each edit also routes its constant part ``f(0)``
    through a gradient leaf, the value unchanged: the graph's steering nodes.
    """
    if not bound.carries_interventions:
        yield bound.model
        return
    model, edits = bound.given, user_edits(bound)
    bind_shared_state(model.interventions.values())
    names = {module: name for name, module in model.model.named_modules()}
    hooks = []
    for key, made, representation in edits:
        register = model.intervention_hooks[key]  # pyvene's: the module's bound register method
        pre = register.__name__ == "register_forward_pre_hook"
        module = register.__self__
        site = SteeringSite(key, type(made).__name__,
                            str(getattr(representation, "component", "")),
                            names.get(module, ""), pre)
        # a residual-stream input is refused above (_shared_input_refusal): never one here
        hooks.append(Edit(Site(module, "input" if pre else "output"), steering_edit(made, site),
                          group="user"))
    with applying(model.model, hooks):
        yield model.model
