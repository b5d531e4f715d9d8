"""Where a transcoder reads and writes: TransformerLens hook names as sites of a transformers model.

Transcoder configs name their hooks as TransformerLens does (``hook_resid_mid``,
``ln2.hook_normalized``, ``hook_mlp_out``, circuit-tracer's ``mlp.hook_in``/``mlp.hook_out``), with
or without a ``blocks.{l}.`` prefix. :data:`HOOKS` names each one's site in the adapter's
vocabulary (:data:`~pyvene_causaltrace.models.SITES`); docs/transcoders.md, "Hooks", says what
each reads. ``ln2.hook_normalized`` is not the norm module's output: its site is the norm's
input, and :func:`hook_value` computes the value (normalised, before the gain).

:func:`hook_states` and :func:`transcoder_states` read these hooks' values at every layer of a
model, in one forward; :func:`keeping_states` keeps them from every forward in a block (a
generation's, so the text a model writes gives its activations without a second pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..applier import Edit, Site, applying
from ..bound import BoundModel, bind
from ..capture import capture
from ..errors import InputError
from ..models import get_module, norm_eps


@dataclass(frozen=True)
class HookSite:
    """The adapter ``site`` a hook reads; ``normalized``: the value is that tensor (a norm's
    input) normalised by the norm's statistic, without its gain."""

    site: str
    normalized: bool = False


HOOKS = {
    "hook_resid_pre": HookSite("resid_pre"),
    "ln1.hook_normalized": HookSite("resid_pre", normalized=True),
    "hook_resid_mid": HookSite("resid_mid"),
    "ln2.hook_normalized": HookSite("resid_mid", normalized=True),
    "mlp.hook_in": HookSite("mlp_input"),
    "mlp.hook_out": HookSite("mlp_output"),
    "hook_mlp_out": HookSite("mlp_contribution"),
    "hook_attn_out": HookSite("attn_output"),
}
INPUT_HOOKS = ("hook_resid_mid", "ln2.hook_normalized", "mlp.hook_in")
OUTPUT_HOOKS = ("hook_mlp_out", "mlp.hook_out")
#: The pairing check's control for each input hook: the same kind of state one module earlier.
CONTROL_HOOKS = {"hook_resid_mid": "hook_resid_pre", "ln2.hook_normalized": "ln1.hook_normalized",
                 "mlp.hook_in": "ln1.hook_normalized"}


def hook_name(hook: str) -> str:
    """``hook`` without a ``blocks.{l}.`` prefix (sae-lens configs carry one)."""
    parts = hook.split(".")
    if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdecimal():
        return ".".join(parts[2:])
    return hook


def hook_site(hook: str) -> HookSite:
    name = hook_name(hook)
    if name not in HOOKS:
        raise InputError(f"unknown hook {hook!r}; known: {', '.join(HOOKS)}")
    return HOOKS[name]


def hook_component(adapter, hook: str, layer: int) -> str:
    """The pyvene component string of hook ``hook``'s site at ``layer``."""
    return adapter.site(hook_site(hook).site, layer)


def norm_settings(bound: BoundModel, hook: str, layer: int) -> dict | None:
    """``{"kind", "eps"}`` of the norm a normalised hook divides by (None for other hooks)."""
    site = hook_site(hook)
    if not site.normalized:
        return None
    adapter = bound.adapter
    module = get_module(bound.model, adapter.site(site.site, layer).rpartition(".")[0])
    return {"kind": adapter.norm_kind, "eps": norm_eps(module)}


def hook_value(x: torch.Tensor, norm: dict | None, frozen: bool = False) -> torch.Tensor:
    """A hook's value from its site's ``x``: ``x``, or with ``norm`` (:func:`norm_settings`) ``x``
    normalised as the norm ``kind`` does before its gain, in float32 (as TransformerLens and Gemma
    compute it), in ``x``'s dtype. ``frozen``: the statistic is a constant for autograd (the
    attribution graph's frozen norms), so the result is linear in ``x``."""
    if norm is None:
        return x
    kind, eps = norm["kind"], norm["eps"]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if kind == "layer":
        xf = xf - xf.mean(-1, keepdim=True)
    elif kind not in ("rms", "rms_offset"):
        raise InputError(f"unknown norm kind {kind!r}")
    scale = (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (xf * (scale.detach() if frozen else scale)).to(x.dtype)


def hook_states(model: nn.Module | BoundModel, ids: torch.Tensor,
                hooks: dict[str, str],
                run: Callable[[], object] | None = None) -> dict[str, torch.Tensor]:
    """The values of TransformerLens hooks (``{key: hook name}``, e.g.
    ``{"out": "hook_mlp_out"}``) at every layer for one prompt ``ids [1, P]``:
    ``{key: [L, P, D]}``, one forward (``run()``, when given, performs it: a forward the
    caller needs anyway)."""
    if ids.dim() != 2 or not bool((ids == ids[:1]).all()):  # [0] below keeps the first row
        raise InputError(f"hook states are read for one prompt (input_ids [1, P], or rows of "
                         f"it repeated); these input_ids {list(ids.shape)} hold "
                         f"{len(ids)} rows, not all the same")
    bound = bind(model)
    paths = {key: [hook_component(bound.adapter, hook, layer)
                   for layer in range(bound.n_layers)]
             for key, hook in hooks.items()}
    found = capture(bound.model, {"input_ids": ids}, [p for ps in paths.values() for p in ps],
                    run=run)
    out = {}
    for key, ps in paths.items():
        norms = [norm_settings(bound, hooks[key], layer) for layer in range(len(ps))]
        out[key] = torch.stack([hook_value(found[p][0], norm)
                                for p, norm in zip(ps, norms, strict=True)])
    return out


def transcoder_states(model: nn.Module, transcoder, ids: torch.Tensor,
                      control: bool = False) -> dict[str, torch.Tensor]:
    """``{"input", "output"}`` (and ``"control"``: the pairing check's wrong input hook) of
    ``transcoder``'s hooks at every layer, ``[L, P, D]`` each, one forward."""
    cfg = transcoder.cfg
    hooks = {"input": cfg.feature_input_hook, "output": cfg.feature_output_hook}
    if control:
        hooks["control"] = CONTROL_HOOKS[hook_name(cfg.feature_input_hook)]
    return hook_states(model, ids, hooks)


@contextmanager
def keeping_states(bound: BoundModel, hooks: dict[str, str],
                   dtype: torch.dtype = torch.float32,
                   layers: Sequence[int] | None = None) -> Iterator[Callable[[], dict]]:
    """Keep the values of TransformerLens ``hooks`` (``{key: hook name}``, plain sites only) at
    ``layers`` (default every layer) from each forward of the bound model in the block, in
    ``dtype``; yields ``take()``, which hands over ``{key: [batch, positions, len(layers), D]}``
    — the forwards since the last take joined along positions (a generation's prompt, then one
    position a step) — and forgets them. Readers of the one applier (:mod:`~..applier`), gone
    when the block ends."""
    layers = list(range(bound.n_layers)) if layers is None else list(layers)
    kept: dict[str, list[list[torch.Tensor]]] = {key: [[] for _ in layers] for key in hooks}
    edits = []
    for key, hook in hooks.items():
        if hook_site(hook).normalized:
            raise InputError(f"{hook} is computed from its site, not read: use hook_states")
        for layer, parts in zip(layers, kept[key], strict=True):
            path, _, where = hook_component(bound.adapter, hook, layer).rpartition(".")
            edits.append(Edit(Site(get_module(bound.model, path), where),
                              lambda value, _call, parts=parts: parts.append(
                                  value.detach().to(dtype)), last=True))

    def take() -> dict[str, torch.Tensor]:
        out = {key: torch.stack([torch.cat(parts, 1) for parts in layers], 2)
               for key, layers in kept.items()}
        for layers in kept.values():
            for parts in layers:
                parts.clear()
        return out

    with applying(bound.model, edits):
        yield take
