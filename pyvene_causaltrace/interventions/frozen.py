"""``frozen_layernorm`` and ``frozen_attention``: the freezes of circuit tracing's local
replacement model, which make a transformer linear in its residual stream.

``frozen_layernorm``, on a norm's *output*, keeps the value (bit for bit) and gives the gradient
with the statistic (RMS or standard deviation) a constant; a LayerNorm's bias keeps its own:

- ``kind="rms"``: ``d y = w * d x / rms(x)``; ``"rms_offset"`` (Gemma): ``(1 + w) * d x / rms(x)``;
- ``kind="layer"``: ``d y = w * (d x - mean(d x)) / std(x)``.

    pv_model = IntervenableModel([{"component": "model.layers[0].input_layernorm.output",
                                   "intervention": FrozenLayerNorm(kind="rms")}], model)

Given ``scale`` (``[batch, n, 1]``, the clean run's, :func:`norm_scales`) it holds the scale in
the forward too at the first ``n`` positions, so the norm is linear in its input whatever the
input becomes (``crosscheck``'s linear check).

``frozen_attention``, on an attention's *output*, recomputes the module with queries and keys
detached after every transform (projections, q/k norms, rotary) and returns the original value
with that gradient: the pattern a constant, values flowing. Given a ``pattern`` (``[1, heads, n,
n]``, the clean run's, :func:`attention_patterns`) it holds it in the forward too at query
positions below ``n`` (circuit-tracer's ``freeze_attention``). The recomputation calls the
model's own attention function (eager, sdpa, ...) through a registered transformers
``AttentionInterface`` entry: every architecture dispatching through it, grouped-query included.

    pv_model = IntervenableModel([{"component": "model.layers[0].self_attn.output",
                                   "intervention": FrozenAttention()}], model)

Both read the hooked module and its inputs from the announced call
(:func:`~pyvene_causaltrace.pyvene_boundary.calls.announced_call`): in our ``IntervenableModel``
or our runs, not pyvene's own. ``FrozenLayerNorm()`` without a ``kind`` reads it off the module's
first output, so pyvene can build it from the class.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from ..applier import Call, Edit, applying
from ..bound import BoundModel, bind
from ..capture import capture
from ..errors import InputError, SpecError, UnsupportedModelError
from ..hooking import in_context, thread_view
from ..models import get_module, norm_eps
from ..pyvene_boundary.calls import announced_call
from .base import CausalTraceIntervention
from .spec_entry import Site, SpecContext

NORM_KINDS = ("layer", "rms", "rms_offset")


class FrozenLayerNorm(CausalTraceIntervention):
    """Freeze a LayerNorm/RMSNorm's scale (see module docstring); ``kind`` in ``NORM_KINDS``,
    or None to read it off the module on the first call."""

    registered_name = "frozen_layernorm"
    tensor_fields = ("scale",)

    def __init__(self, kind: str | None = None, **pyvene_kwargs: Any) -> None:
        super().__init__(kind=kind, **pyvene_kwargs)

    def _setup(self, kind: str | None = None, scale: torch.Tensor | None = None) -> None:
        if kind is not None and kind not in NORM_KINDS:
            raise InputError(f"kind must be one of {NORM_KINDS}, got {kind!r}")
        if scale is not None and (scale.dim() != 3 or scale.shape[-1] != 1):
            raise InputError(f"a held norm scale is [batch, n, 1], got {tuple(scale.shape)}")
        self._set_tensor("scale", scale)
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
        return [Site(index, ctx.adapter.site(f"{norm}_norm", layer), layer, where=ctx.path(index),
                     settings={"norm": norm})
                for norm in entry.get("norms", cls._NORMS)
                for layer in ([None] if norm == "final" else layers)]

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        return cls(kind=ctx.adapter.norm_kind)

    def to_spec(self, site: Site) -> dict[str, Any]:
        if self.scale is not None:
            raise InputError("a frozen_layernorm holding a scale in the forward is not a spec "
                             "entry (only the gradient-only freeze of attribution is)")
        return {"type": self.registered_name, "norms": [site.settings["norm"]],
                **({"layers": [site.layer]} if site.layer is not None else {})}

    def _kind(self, module: torch.nn.Module, x: torch.Tensor, base: torch.Tensor) -> str:
        """The configured kind, else the one whose formula gives the module's output."""
        if self._config["kind"] is not None:
            return self._config["kind"]
        with torch.no_grad():
            xf = x.double()
            w = module.weight.double()
            rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps(module))
            centred = xf - xf.mean(-1, keepdim=True)
            std = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm_eps(module))
            bias = getattr(module, "bias", None)
            bias = bias.double() if isinstance(bias, torch.Tensor) else 0.0
            candidates = {"layer": w * centred / std + bias, "rms": w * xf / rms,
                          "rms_offset": (1 + w) * xf / rms}
            errors = {k: float((v - base.double()).abs().max()) for k, v in candidates.items()}
        self._config["kind"] = min(errors, key=errors.get)
        return self._config["kind"]

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        call = announced_call(self.registered_name, "recomputes the norm from its inputs")
        module, args, kwargs = call.module, call.args, call.kwargs
        x = args[0] if args else next(iter(kwargs.values()))
        if x.shape != base.shape:
            raise InputError(
                f"frozen_layernorm needs the norm's whole output {tuple(x.shape)}, got "
                f"{tuple(base.shape)}: give it unit_locations=None")
        kind = self._kind(module, x, base)
        if self.scale is None:
            return frozen_norm(module, x, base, kind)
        # the held scale at the first n positions, the live one after
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        held = self.scale.to(xf.device, xf.dtype)
        if held.shape[0] not in (1, xf.shape[0]):
            raise InputError(f"a held norm scale for {held.shape[0]} rows, the batch has "
                             f"{xf.shape[0]}")
        n = min(held.shape[1], xf.shape[1])
        live = _statistic(xf.detach(), kind, norm_eps(module))
        scale = torch.cat([held[:, :n].expand(xf.shape[0], -1, -1), live[:, n:]], dim=1)
        weight = module.weight.to(xf.dtype)
        weight = 1.0 + weight if kind == "rms_offset" else weight
        centred = xf - xf.mean(-1, keepdim=True) if kind == "layer" else xf
        out = weight * centred / scale
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            out = out + bias.to(out.dtype)
        return out.to(base.dtype)


def frozen_norm(module: torch.nn.Module, x: torch.Tensor, base: torch.Tensor,
                kind: str) -> torch.Tensor:
    """The norm ``module``'s output ``base`` on input ``x`` with the frozen-scale gradient
    (module docstring), over the last axis of any shape."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    dx = xf - xf.detach()  # zero in value; carries the gradient to x
    weight = module.weight.to(xf.dtype)
    if kind == "layer":
        dx = dx - dx.mean(-1, keepdim=True)
    elif kind == "rms_offset":
        weight = 1.0 + weight
    linear = weight.detach() * dx / _statistic(xf.detach(), kind, norm_eps(module))
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        linear = linear + (bias - bias.detach())  # zero in value; a constant node's gradient
    return base.detach() + linear.to(base.dtype)


@contextmanager
def frozen_qk_norms(bound: BoundModel) -> Iterator[None]:
    """Inside the block, every layer's per-head query and key norms (Qwen3, Gemma-3: the
    adapter's ``qk_norms``; nothing elsewhere) have the frozen-scale gradient of
    :func:`frozen_norm`, their statistic taken per head. Their inputs are ``[B, P, heads,
    head_dim]``, which pyvene's whole-state types refuse, so this is a hook of our runner, not
    a ``frozen_layernorm``."""
    adapter = bound.adapter
    if adapter.qk_norms is None:
        yield
        return

    def freeze(output: torch.Tensor, call: Call) -> torch.Tensor:
        return frozen_norm(call.module, call.args[0], output, adapter.norm_kind)

    with applying(bound.model, [Edit(bound.at(part, layer), freeze)
                                for layer in range(bound.n_layers)
                                for part in ("q_norm", "k_norm")]):
        yield


def _statistic(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """The norm's divisor over the last axis: the standard deviation (LayerNorm) or the RMS."""
    if kind == "layer":
        return torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + eps)
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def norm_scales(bound: BoundModel, input_ids: torch.Tensor,
                components: list[str]) -> dict[str, torch.Tensor]:
    """The clean run's statistic (``[batch, P, 1]``, float32 or wider) of each norm whose
    output is ``components[i]`` (``"<norm module>.output"``), for :class:`FrozenLayerNorm`'s
    ``scale``; the kind is the model adapter's."""
    model, kind = bound.model, bound.adapter.norm_kind
    modules = {c: get_module(model, c.rpartition(".")[0]) for c in components}
    inputs = capture(model, {"input_ids": input_ids},
                     [c.rpartition(".")[0] + ".input" for c in components])
    out = {}
    for component, module in modules.items():
        x = inputs[component.rpartition(".")[0] + ".input"]
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        out[component] = _statistic(x, kind, norm_eps(module))
    return out


# ------------------------------------------------------------------------ frozen attention

FROZEN_QK = "pvct_frozen_qk"
HELD_PATTERN = "pvct_held_pattern"
_inner_attention: ContextVar[Callable] = ContextVar("pvct_inner_attention")
_held_pattern: ContextVar[torch.Tensor | None] = ContextVar("pvct_held_pattern")
_qk_watcher: ContextVar[Callable | None] = ContextVar("pvct_qk_watcher", default=None)


def _frozen_qk_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention function with queries and keys detached (shown live, before
    the detach, to a :func:`watching_qk` callback)."""
    watcher = _qk_watcher.get()
    if watcher is not None:
        watcher(module, query, key, kwargs)
    return _inner_attention.get()(module, query.detach(), key.detach(), value, attention_mask,
                                  **kwargs)


def watching_qk(callback: Callable) -> AbstractContextManager:
    """Inside the block, every frozen attention calls ``callback(module, query, key, kwargs)``
    with its live queries ``[B, heads, P, d]`` and keys ``[B, kv_heads, P, d]`` (after every
    transform: projections, q/k norms, rotary) and the attention function's keyword arguments
    (``scaling``, ``softcap``, ...), before it detaches them."""
    return in_context(_qk_watcher, callback)


def _held_pattern_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention function, except that each query position the held pattern
    ``[1, heads, n, n]`` covers mixes the live values by the held weights (positions past
    ``n``, generated tokens, attend as the model does)."""
    output, weights = _inner_attention.get()(module, query, key, value, attention_mask,
                                             **kwargs)
    pattern = _held_pattern.get()
    if pattern.shape[1] != query.shape[1]:
        raise InputError(f"the held attention pattern has {pattern.shape[1]} heads, the "
                         f"attention {query.shape[1]}")
    n = min(pattern.shape[-2], query.shape[-2])
    values = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)  # grouped kv
    held = torch.matmul(pattern[..., :n, :n].to(values.dtype), values[:, :, :n])
    return torch.cat([held.transpose(1, 2).to(output.dtype), output[:, n:]], dim=1), weights


_FUNCTIONS = {FROZEN_QK: _frozen_qk_attention, HELD_PATTERN: _held_pattern_attention}


@contextmanager
def _attention_function(attention: torch.nn.Module,
                        pattern: torch.Tensor | None = None) -> Iterator[None]:
    """Inside the block, ``attention``'s forward computes its pattern from detached q and k, or
    (given ``pattern`` ``[1, heads, n, n]``) mixes values by it at its first ``n`` query
    positions: our registered function, which calls the model's own (eager, sdpa, ...)."""
    # transformers loads when an attention is frozen, not with the registry's built-ins
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    for name, function in _FUNCTIONS.items():
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, function)
    config = attention.config
    original = config._attn_implementation
    if original in (None, "eager", *_FUNCTIONS):
        inner = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
        if inner is None:
            raise UnsupportedModelError(f"{type(attention).__name__} has no "
                                        "eager_attention_forward")
    else:
        inner = ALL_ATTENTION_FUNCTIONS[original]
    name = FROZEN_QK if pattern is None else HELD_PATTERN
    with in_context(_inner_attention, inner), in_context(_held_pattern, pattern), \
            thread_view(config, _attn_implementation_internal=name):  # this thread's alone
        yield


def attention_patterns(model: torch.nn.Module | BoundModel,
                       input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention pattern on ``input_ids``, ``[batch, heads, P, P]`` each: the
    softmax weights of the model's eager attention, read in one plain forward during which the
    model runs eager (its own implementation, e.g. sdpa, is put back afterwards; other threads'
    forwards meanwhile run the model's own)."""
    bound = bind(model)
    model, layers = bound.model, range(bound.n_layers)
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation_internal")}
    found: dict[int, torch.Tensor | None] = {}

    def read(layer: int):
        def keep(_value: torch.Tensor, call: Call) -> None:
            output = call.output
            found[layer] = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        return keep

    with ExitStack() as eager:
        for config in configs.values():
            eager.enter_context(thread_view(config, _attn_implementation_internal="eager"))
        with applying(model, [Edit(bound.at("attn", i), read(i), last=True) for i in layers]), \
                torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    missing = [layer for layer in layers if found.get(layer) is None]
    if missing:
        raise UnsupportedModelError(f"{bound.model_type}'s attention at layers "
                                    f"{missing} returned no pattern in eager mode")
    return [found[layer].detach().clone() for layer in layers]


_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


class FrozenAttention(CausalTraceIntervention):
    """Freeze an attention module's pattern (see module docstring): for the gradient only
    (no settings), or with ``pattern`` ``[1, heads, n, n]`` held in the forward too
    (``pattern_from="clean"`` when it is the clean run's, :func:`attention_patterns`, so a
    spec can name it)."""

    registered_name = "frozen_attention"
    tensor_fields = ("pattern",)

    def _setup(self, pattern: torch.Tensor | None = None,
               pattern_from: str | None = None) -> None:
        if pattern_from not in (None, "clean"):
            raise InputError(f"pattern_from must be None or 'clean', got {pattern_from!r}")
        if pattern is not None and pattern.dim() != 4:
            raise InputError(f"a held pattern is [1, heads, n, n], got {tuple(pattern.shape)}")
        self._set_tensor("pattern", pattern)
        self._config = {} if pattern_from is None else {"pattern_from": pattern_from}

    # -- spec entry: the held pattern only; the gradient-only freeze is attribution's
    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False, "properties": {
            "type": True,
            "pattern": {"const": "clean",
                        "description": "Hold every query position of the prompt at the clean "
                                       "run's attention pattern (values stay live)."},
            "layers": {"$ref": "#/$defs/layers", "default": "all"}}}

    @classmethod
    def check_spec(cls, entry: dict, spec: dict, path: str) -> None:
        if "pattern" not in entry:
            raise SpecError(path, "frozen_attention without a pattern (the gradient-only "
                                  "freeze) is part of the attribution method's local "
                                  "replacement model; use an 'attribution' block (or the "
                                  "Python API), or give \"pattern\": \"clean\" to hold the "
                                  "clean run's attention patterns")

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        layers = ctx.layers(entry.get("layers", "all"), ctx.path(index, "layers"))
        return [Site(index, ctx.adapter.site("attn_output", layer), layer,
                     where=ctx.path(index)) for layer in layers]

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        if "attention_patterns" not in ctx.cache:  # one clean forward for every layer
            ctx.cache["attention_patterns"] = attention_patterns(
                ctx.model, ctx.prompt.input_ids.to(ctx.bound.device))
        return cls(pattern=ctx.cache["attention_patterns"][site.layer], pattern_from="clean")

    def to_spec(self, site: Site) -> dict[str, Any]:
        if self.pattern is None or self._config.get("pattern_from") != "clean":
            raise InputError("only a frozen_attention holding the clean run's pattern "
                             "(pattern_from='clean') is a spec entry")
        return {"type": self.registered_name, "pattern": "clean", "layers": [site.layer]}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        call = announced_call(self.registered_name, "recomputes attention from its inputs")
        module, args, call_kwargs = call.module, call.args, call.kwargs
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
        with _attention_function(module, self.pattern):
            out = module.forward(*args, **call_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if out.shape != base.shape:
            raise InputError(
                f"frozen_attention needs the attention's whole output {tuple(out.shape)}, got "
                f"{tuple(base.shape)}: give it unit_locations=None")
        if self.pattern is not None:
            return out.to(base.dtype)
        return base.detach() + (out - out.detach()).to(base.dtype)
