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
:func:`_hooked_call`), so they run only inside an ``IntervenableModel``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from .base import CausalTraceIntervention

NORM_KINDS = ("layer", "rms", "rms_offset")


def _hooked_call() -> tuple[torch.nn.Module, tuple, dict]:
    """The module, positional and keyword inputs of the pyvene forward hook calling us.

    pyvene hands an intervention only the module's output. Its hook closure
    (``hook_callback(model, args, kwargs, output)`` in pyvene 0.1.x) holds the module and its
    inputs, a few frames up the stack.
    """
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        if frame.f_code.co_name == "hook_callback" and "args" in frame.f_locals:
            local = frame.f_locals
            if local.get("output") is not None:
                return local["model"], tuple(local["args"]), dict(local.get("kwargs") or {})
        frame = frame.f_back
    raise RuntimeError(
        "frozen_layernorm / frozen_attention must run on a module's output inside a pyvene "
        "IntervenableModel"
    )


def _eps(module: torch.nn.Module) -> float:
    for name in ("eps", "variance_epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise AttributeError(f"{type(module).__name__} has no eps / variance_epsilon")


class FrozenLayerNorm(CausalTraceIntervention):
    """Freeze a LayerNorm/RMSNorm's scale (see module docstring); ``kind`` in ``NORM_KINDS``."""

    registered_name = "frozen_layernorm"

    def __init__(self, kind: str | None = None, **pyvene_kwargs: Any) -> None:
        super().__init__(**({} if kind is None else {"kind": kind}), **pyvene_kwargs)

    def _setup(self, kind: str) -> None:
        if kind not in NORM_KINDS:
            raise ValueError(f"kind must be one of {NORM_KINDS}, got {kind!r}")
        self._config = {"kind": kind}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        module, args, kwargs = _hooked_call()
        x = args[0] if args else next(iter(kwargs.values()))
        if x.shape != base.shape:
            raise ValueError(
                f"frozen_layernorm needs the norm's whole output {tuple(x.shape)}, got "
                f"{tuple(base.shape)}: give it unit_locations=None"
            )
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        dx = xf - xf.detach()  # zero in value; carries the gradient to x
        frozen = xf.detach()
        kind = self._config["kind"]
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
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if FROZEN_QK not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(FROZEN_QK, _frozen_qk_attention)


@contextmanager
def frozen_qk(attention: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``attention``'s forward computes its pattern from detached q and k."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _register_frozen_qk()
    config = attention.config
    original = config._attn_implementation
    if original in (None, "eager", FROZEN_QK):
        inner = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
        if inner is None:
            raise TypeError(f"{type(attention).__name__} has no eager_attention_forward")
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

    def __init__(self, **pyvene_kwargs: Any) -> None:
        super().__init__(**pyvene_kwargs)

    def _setup(self) -> None:
        self._config = {}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        module, args, call_kwargs = _hooked_call()
        for name in _CACHE_KWARGS:
            cache = call_kwargs.get(name)
            if cache is None:
                continue
            # The original call already wrote this layer's keys. Recomputing without the cache
            # is exact when it held nothing else (a plain forward); not when earlier tokens
            # are cached (generation).
            layer = getattr(module, "layer_idx", 0)
            if int(cache.get_seq_length(layer)) != base.shape[1]:
                raise ValueError("frozen_attention cannot recompute attention over cached "
                                 "tokens: run the whole sequence with use_cache=False")
            call_kwargs[name] = None
        with frozen_qk(module):
            out = module.forward(*args, **call_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if out.shape != base.shape:
            raise ValueError(
                f"frozen_attention needs the attention's whole output {tuple(out.shape)}, got "
                f"{tuple(base.shape)}: give it unit_locations=None")
        return base.detach() + (out - out.detach()).to(base.dtype)
