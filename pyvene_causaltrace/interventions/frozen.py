"""``frozen_layernorm``: a norm made linear in its input by freezing its scale.

Placed on a norm module's *output*, it leaves the forward value unchanged (bit for bit) and
replaces the gradient with the frozen-scale one — the statistic (RMS or standard deviation) is
treated as a constant, as in circuit tracing's local replacement model:

- ``kind="rms"``: ``d y = w * d x / rms(x)``; ``"rms_offset"`` (Gemma): ``(1 + w) * d x / rms(x)``;
- ``kind="layer"``: ``d y = w * (d x - mean(d x)) / std(x)``.

    pv_model = IntervenableModel([{"component": "model.layers[0].input_layernorm.output",
                                   "intervention": FrozenLayerNorm(kind="rms")}], model)

The norm's input and weights are read from the pyvene hook that calls the intervention (see
:func:`_hooked_module_and_input`), so this type runs only inside an ``IntervenableModel``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .base import CausalTraceIntervention

NORM_KINDS = ("layer", "rms", "rms_offset")


def _hooked_module_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    """The module and first input of the pyvene forward hook that is calling us.

    pyvene hands an intervention only the module's output. Its hook closure
    (``hook_callback(model, args, kwargs, output)`` in pyvene 0.1.x) holds the module and its
    inputs, a few frames up the stack; a norm's input is ``args[0]``.
    """
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        if frame.f_code.co_name == "hook_callback" and "args" in frame.f_locals:
            local = frame.f_locals
            if local.get("output") is not None and local["args"]:
                return local["model"], local["args"][0]
        frame = frame.f_back
    raise RuntimeError(
        "frozen_layernorm must run on a norm module's output inside a pyvene IntervenableModel"
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
        module, x = _hooked_module_and_input()
        if x.shape != base.shape:
            raise ValueError(
                f"frozen_layernorm needs the norm's whole output {tuple(x.shape)}, got "
                f"{tuple(base.shape)}: give it unit_locations=None"
            )
        xf = x.float()
        dx = xf - xf.detach()  # zero in value; carries the gradient to x
        frozen = xf.detach()
        kind = self._config["kind"]
        weight = module.weight.float()
        if kind == "layer":
            dx = dx - dx.mean(-1, keepdim=True)
            scale = torch.sqrt(frozen.var(-1, keepdim=True, unbiased=False) + _eps(module))
        else:
            scale = torch.sqrt(frozen.pow(2).mean(-1, keepdim=True) + _eps(module))
            if kind == "rms_offset":
                weight = 1.0 + weight
        linear = (weight.detach() * dx / scale).to(base.dtype)
        return base.detach() + linear
