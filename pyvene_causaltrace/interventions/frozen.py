"""``frozen_layernorm`` and ``frozen_attention``: the freezes of circuit tracing's local
replacement model, which make a transformer linear in its residual stream.

``frozen_layernorm``: a norm made linear in its input by freezing its scale.

Placed on a norm module's *output*, it leaves the forward value unchanged (bit for bit) and
replaces the gradient with the frozen-scale one — the statistic (RMS or standard deviation) is
treated as a constant, as in circuit tracing's local replacement model:

- ``kind="rms"``: ``d y = w * d x / rms(x)``; ``"rms_offset"`` (Gemma): ``(1 + w) * d x / rms(x)``;
- ``kind="layer"``: ``d y = w * (d x - mean(d x)) / std(x)``.

    pv_model = IntervenableModel([{"component": "model.layers[0].input_layernorm.output",
                                   "intervention": FrozenLayerNorm(kind="rms")}], model)

A norm's bias (LayerNorm) keeps its gradient, so it can be counted as a constant node.

``frozen_attention``: placed on an attention module's *output*, it recomputes the module with
queries and keys detached after every transform (projections, q/k norms, rotary) — the pattern is
a constant while values flow — and returns the original value with that gradient. The
recomputation goes through the model's own attention function (eager, sdpa, ...) via a
registered transformers ``AttentionInterface`` entry, so it works for every architecture that
dispatches through that interface (GPT-2, Llama/SmolLM2, Mistral, Qwen2/3 with grouped-query
attention, Gemma).

    pv_model = IntervenableModel([{"component": "model.layers[0].self_attn.output",
                                   "intervention": FrozenAttention()}], model)

Both read the hooked module and its inputs from the pyvene hook that calls them (see
:func:`~pyvene_causaltrace.pyvene_compat.hooked_call`), so they run only inside an
``IntervenableModel``. ``FrozenLayerNorm()`` without a ``kind`` reads it off the module's own
output on the first call (which formula reproduces it), so pyvene can build it from the class.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from ..errors import InputError, UnsupportedModelError
from ..pyvene_compat import hooked_call
from .base import CausalTraceIntervention
from .spec_entry import Site, SpecContext

NORM_KINDS = ("layer", "rms", "rms_offset")


def _eps(module: torch.nn.Module) -> float:
    for name in ("eps", "variance_epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise AttributeError(f"{type(module).__name__} has no eps / variance_epsilon")


class FrozenLayerNorm(CausalTraceIntervention):
    """Freeze a LayerNorm/RMSNorm's scale (see module docstring); ``kind`` in ``NORM_KINDS``,
    or None to read it off the module on the first call."""

    registered_name = "frozen_layernorm"

    def __init__(self, kind: str | None = None, **pyvene_kwargs: Any) -> None:
        super().__init__(kind=kind, **pyvene_kwargs)

    def _setup(self, kind: str | None = None) -> None:
        if kind is not None and kind not in NORM_KINDS:
            raise InputError(f"kind must be one of {NORM_KINDS}, got {kind!r}")
        self._config = {"kind": kind}

    # -- spec entry: which norms, at which layers
    _NORMS = ("pre_attn", "pre_mlp", "final")

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False, "properties": {
            "type": True,
            "norms": {"type": "array", "minItems": 1, "items": {"enum": list(cls._NORMS)},
                      "default": list(cls._NORMS)},
            "layers": {"$ref": "#/$defs/layers", "default": "all"}}}

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        layers = ctx.layers(entry.get("layers", "all"), ctx.path(index, "layers"))
        sites = []
        for norm in entry.get("norms", cls._NORMS):
            if norm == "final":
                sites.append(Site(index, ctx.adapter.site("final_norm"), where=ctx.path(index),
                                  settings={"norm": norm}))
            else:
                sites.extend(Site(index, ctx.adapter.site(f"{norm}_norm", layer), layer,
                                  where=ctx.path(index), settings={"norm": norm})
                             for layer in layers)
        return sites

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        return cls(kind=ctx.adapter.norm_kind)

    def to_spec(self, site: Site) -> dict[str, Any]:
        return {"type": self.registered_name, "norms": [site.settings["norm"]],
                **({"layers": [site.layer]} if site.layer is not None else {})}

    def _kind(self, module: torch.nn.Module, x: torch.Tensor, base: torch.Tensor) -> str:
        """The configured kind, else the one whose formula gives the module's output."""
        if self._config["kind"] is not None:
            return self._config["kind"]
        with torch.no_grad():
            xf = x.double()
            w = module.weight.double()
            rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + _eps(module))
            centred = xf - xf.mean(-1, keepdim=True)
            std = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + _eps(module))
            bias = getattr(module, "bias", None)
            bias = bias.double() if isinstance(bias, torch.Tensor) else 0.0
            candidates = {"layer": w * centred / std + bias, "rms": w * xf / rms,
                          "rms_offset": (1 + w) * xf / rms}
            errors = {k: float((v - base.double()).abs().max()) for k, v in candidates.items()}
        self._config["kind"] = min(errors, key=errors.get)
        return self._config["kind"]

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        module, args, kwargs = hooked_call()
        x = args[0] if args else next(iter(kwargs.values()))
        if x.shape != base.shape:
            raise InputError(
                f"frozen_layernorm needs the norm's whole output {tuple(x.shape)}, got "
                f"{tuple(base.shape)}: give it unit_locations=None"
            )
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        dx = xf - xf.detach()  # zero in value; carries the gradient to x
        frozen = xf.detach()
        kind = self._kind(module, x, base)
        weight = module.weight.to(xf.dtype)
        if kind == "layer":
            dx = dx - dx.mean(-1, keepdim=True)
            scale = torch.sqrt(frozen.var(-1, keepdim=True, unbiased=False) + _eps(module))
        else:
            scale = torch.sqrt(frozen.pow(2).mean(-1, keepdim=True) + _eps(module))
            if kind == "rms_offset":
                weight = 1.0 + weight
        linear = weight.detach() * dx / scale
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            linear = linear + (bias - bias.detach())  # zero in value; a constant node's gradient
        return base.detach() + linear.to(base.dtype)


# ------------------------------------------------------------------------ frozen attention

FROZEN_QK = "pvct_frozen_qk"
_inner_attention: ContextVar[Callable] = ContextVar("pvct_inner_attention")


def _frozen_qk_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention function with queries and keys detached."""
    return _inner_attention.get()(module, query.detach(), key.detach(), value, attention_mask,
                                  **kwargs)


def _register_frozen_qk() -> None:
    # transformers loads when an attention is frozen, not with the registry's built-ins
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if FROZEN_QK not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(FROZEN_QK, _frozen_qk_attention)


@contextmanager
def frozen_qk(attention: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``attention``'s forward computes its pattern from detached q and k."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # heavy: as above

    _register_frozen_qk()
    config = attention.config
    original = config._attn_implementation
    if original in (None, "eager", FROZEN_QK):
        inner = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
        if inner is None:
            raise UnsupportedModelError(f"{type(attention).__name__} has no "
                                        "eager_attention_forward")
    else:
        inner = ALL_ATTENTION_FUNCTIONS[original]
    token = _inner_attention.set(inner)
    config._attn_implementation_internal = FROZEN_QK
    try:
        yield
    finally:
        config._attn_implementation_internal = original
        _inner_attention.reset(token)


_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


class FrozenAttention(CausalTraceIntervention):
    """Freeze an attention module's pattern (see module docstring). No settings."""

    registered_name = "frozen_attention"
    spec_refusal = ("frozen_attention is part of the attribution method's local replacement "
                    "model; use an 'attribution' block (or the Python API)")

    def __init__(self, **pyvene_kwargs: Any) -> None:
        super().__init__(**pyvene_kwargs)

    def _setup(self) -> None:
        self._config = {}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        module, args, call_kwargs = hooked_call()
        for name in _CACHE_KWARGS:
            cache = call_kwargs.get(name)
            if cache is None:
                continue
            # The original call already wrote this layer's keys. Recomputing without the cache
            # is exact when it held nothing else (a plain forward); not when earlier tokens
            # are cached (generation).
            layer = getattr(module, "layer_idx", 0)
            if int(cache.get_seq_length(layer)) != base.shape[1]:
                raise InputError("frozen_attention cannot recompute attention over cached "
                                 "tokens: run the whole sequence with use_cache=False")
            call_kwargs[name] = None
        with frozen_qk(module):
            out = module.forward(*args, **call_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if out.shape != base.shape:
            raise InputError(
                f"frozen_attention needs the attention's whole output {tuple(out.shape)}, got "
                f"{tuple(base.shape)}: give it unit_locations=None")
        return base.detach() + (out - out.detach()).to(base.dtype)
