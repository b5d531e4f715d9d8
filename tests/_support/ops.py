"""Aten ops dispatched per chunk forward of the trace engine, by origin: the CPU's count of what
would be kernel launches on a GPU. ``benchmarks/trace_launches.py`` prints it;
``tests/test_trace_launches.py`` pins it.

An op's origin is its innermost Python caller in transformers (``model``: the model's modules
and its KV cache) or in the package (``restore``, ``noise``, ``readout``, ``replay``,
``hooks``, ``chunk``: the engine's per-chunk masks and gathers); view ops (slices, reshapes)
launch nothing and are counted apart."""

from __future__ import annotations

import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ORIGINS = {"interventions/restore.py": "restore", "interventions/noise.py": "noise",
           "tracing/metrics.py": "readout", "tracing/replay.py": "replay",
           "tracing/head.py": "model", "applier.py": "hooks", "hooking.py": "hooks",
           "pyvene_boundary/calls.py": "hooks", "tracing/engine.py": "chunk"}
PASS_THROUGH = ("interventions/base.py",)  # helpers: their caller says whose op it is
OURS = ("restore", "noise", "readout", "replay", "hooks", "chunk")


def origin() -> str:
    """Who dispatched the op running now (module docstring)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/transformers/" in name:
            return "model"
        if "/pyvene_causaltrace/" in name:
            tail = name.split("/pyvene_causaltrace/", 1)[1]
            if tail not in PASS_THROUGH:
                return ORIGINS.get(tail, "other")
        frame = frame.f_back
    return "other"


class OpCounter(TorchDispatchMode):
    """``counts[(origin, launch)]``: aten ops inside the block; ``launch``: not a view op."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[(origin(), not func.is_view)] += 1
        return func(*args, **(kwargs or {}))

    def launches(self, origins=None) -> int:
        """Non-view ops, of ``origins`` (default: all)."""
        return sum(n for (who, launch), n in self.counts.items()
                   if launch and (origins is None or who in origins))


def per_chunk(engine, kind, cells) -> list[tuple[object, OpCounter]]:
    """``(chunk, counter)`` for every chunk forward of ``engine.run(kind, cells)``."""
    from pyvene_causaltrace.tracing import engine as engine_module

    found = []
    own = engine_module._RunHooks.forward

    def counted(hooks, chunk, index):
        with OpCounter() as counter:
            out = own(hooks, chunk, index)
        found.append((chunk, counter))
        return out

    engine_module._RunHooks.forward = counted
    try:
        engine.run(kind, cells)
    finally:
        engine_module._RunHooks.forward = own
    return found


def plain_forward(model, ids: torch.Tensor, rows: int) -> OpCounter:
    """The ops of a plain forward of ``rows`` copies of ``ids`` (last position's logits)."""
    with OpCounter() as counter, torch.no_grad():
        model(input_ids=ids.expand(rows, -1), logits_to_keep=1)
    return counter
