"""Where a transcoder reads and writes: TransformerLens hook names as sites of a transformers model.

Transcoder configs name their hooks as TransformerLens does (``hook_resid_mid``,
``ln2.hook_normalized``, ``hook_mlp_out``, circuit-tracer's ``mlp.hook_in``/``mlp.hook_out``), with
or without a ``blocks.{l}.`` prefix. :data:`HOOKS` says, through the architecture adapter, which
module's input or output each one is. Two need care:

- ``ln2.hook_normalized`` is the MLP norm's input *normalised but before its gain* (``x / rms(x)``,
  or ``(x - mean) / std`` for LayerNorm) — not the norm module's output. The site is the norm's
  input, and :func:`normalize` computes the value (GemmaScope transcoders read it);
- ``hook_mlp_out`` is what the MLP adds to the residual stream: after Gemma's post-feedforward
  norm, the MLP's own output elsewhere; ``mlp.hook_out`` is always the MLP module's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HookSite:
    """``part`` of the adapter, its ``"input"`` or ``"output"``; ``normalized``: the value is
    that tensor normalised by the norm's statistic, without its gain."""

    part: str
    kind: str
    normalized: bool = False


HOOKS = {
    "hook_resid_pre": HookSite("pre_attn_norm", "input"),
    "ln1.hook_normalized": HookSite("pre_attn_norm", "input", normalized=True),
    "hook_resid_mid": HookSite("pre_mlp_norm", "input"),
    "ln2.hook_normalized": HookSite("pre_mlp_norm", "input", normalized=True),
    "mlp.hook_in": HookSite("pre_mlp_norm", "output"),  # the MLP's input, after the norm's gain
    "mlp.hook_out": HookSite("mlp", "output"),
    "hook_mlp_out": HookSite("mlp_out", "output"),
}
INPUT_HOOKS = ("hook_resid_mid", "ln2.hook_normalized", "mlp.hook_in")
OUTPUT_HOOKS = ("hook_mlp_out", "mlp.hook_out")
#: The pairing check's control for each input hook: the same kind of state one module earlier.
CONTROL_HOOKS = {"hook_resid_mid": "hook_resid_pre", "ln2.hook_normalized": "ln1.hook_normalized",
                 "mlp.hook_in": "ln1.hook_normalized"}


def hook_name(hook: str) -> str:
    """``hook`` without a ``blocks.{l}.`` prefix (sae-lens configs carry one)."""
    parts = hook.split(".")
    if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit():
        return ".".join(parts[2:])
    return hook


def hook_site(hook: str) -> HookSite:
    name = hook_name(hook)
    if name not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}; known: {', '.join(HOOKS)}")
    return HOOKS[name]


def hook_component(adapter, hook: str, layer: int) -> str:
    """The pyvene component string of hook ``hook``'s site at ``layer``."""
    site = hook_site(hook)
    return f"{adapter.module_path(site.part, layer)}.{site.kind}"


def norm_settings(model, hook: str, layer: int) -> dict | None:
    """``{"kind", "eps"}`` of the norm a normalised hook divides by (None for other hooks)."""
    from ..models import get_adapter, get_module

    site = hook_site(hook)
    if not site.normalized:
        return None
    adapter = get_adapter(model)
    module = get_module(model, adapter.module_path(site.part, layer))
    eps = next((float(getattr(module, name)) for name in ("eps", "variance_epsilon")
                if hasattr(module, name)), None)
    if eps is None:
        raise ValueError(f"{type(module).__name__} has no eps / variance_epsilon")
    return {"kind": adapter.norm_kind, "eps": eps}


def normalize(x: torch.Tensor, kind: str, eps: float, frozen: bool = False) -> torch.Tensor:
    """``x`` normalised as the norm ``kind`` does before its gain, in float32 (as TransformerLens
    and Gemma compute it), returned in ``x``'s dtype. ``frozen``: the statistic is a constant
    for autograd (the attribution graph's frozen norms), so the result is linear in ``x``."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if kind == "layer":
        xf = xf - xf.mean(-1, keepdim=True)
        scale = (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    elif kind in ("rms", "rms_offset"):
        scale = (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    else:
        raise ValueError(f"unknown norm kind {kind!r}")
    if frozen:
        scale = scale.detach()
    return (xf * scale).to(x.dtype)
