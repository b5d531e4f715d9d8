"""Causal tracing: noise scale, the batched engine, traces of one prompt and their results.

    from pyvene_causaltrace.tracing import TraceSettings, Tracer, trace
"""

from __future__ import annotations

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "Tracer": ".tracer", "trace": ".tracer", "tracer_from_spec": ".tracer",
    "ControlReport": ".tracer", "TraceSettings": ".settings", "TraceResult": ".results",
    "SpecRunResult": ".results", "HeadTraceResult": ".results",
    "HeadRestorer": ".head_restore",
    "KINDS": ".engine", "TraceEngine": ".engine", "sweep_noise_scale": ".noise_scale",
    "NoiseScaleSweep": ".noise_scale", "token_role": ".roles", "ROLES": ".roles",
    "trace_faithfulness": ".faithfulness", "TraceFaithfulness": ".faithfulness",
    "TraceFaithfulnessSettings": ".settings",
})
