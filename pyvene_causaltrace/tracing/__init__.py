"""Causal tracing: noise scale, the batched engine, traces of one prompt and their results.

    from pyvene_causaltrace.tracing import Tracer, trace
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Tracer": ".trace", "trace": ".trace", "tracer_from_spec": ".trace",
    "ControlReport": ".trace", "TraceResult": ".results", "SpecRunResult": ".results",
    "KINDS": ".engine", "TraceEngine": ".engine", "sweep_noise_scale": ".noise_scale",
    "NoiseScaleSweep": ".noise_scale", "token_role": ".roles", "ROLES": ".roles",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
