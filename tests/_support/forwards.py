"""What a call puts on a model, seen at every top-level forward: the package's hooks per site
(a module's output or its input), modules whose ``forward`` is replaced, and ``bind()`` calls.
``benchmarks/hooks_per_forward.py`` prints it; ``tests/test_one_applier.py`` asserts it."""

from __future__ import annotations

import sys
from collections import Counter

import torch


def snapshot(model: torch.nn.Module) -> dict:
    """The package's hooks on ``model`` now: per site, in all, and replaced ``forward``s."""
    from pyvene_causaltrace.hooking import is_ours

    per_site: Counter = Counter()
    swapped = 0
    for name, module in model.named_modules():
        for kind, table in (("output", module._forward_hooks),
                            ("input", module._forward_pre_hooks)):
            ours = sum(1 for hook in table.values() if is_ours(hook))
            if ours:
                per_site[f"{name}.{kind}"] = ours
        swapped += "forward" in module.__dict__
    return {"hooks": sum(per_site.values()), "max_per_site": max(per_site.values(), default=0),
            "swapped_forwards": swapped,
            "crowded": sorted(site for site, n in per_site.items() if n > 1)}


def observe(model: torch.nn.Module, call) -> dict:
    """Run ``call()``; a snapshot at every top-level forward of ``model`` (its class's
    ``forward`` wrapped for the call) and the ``bind()`` calls made (a profiler spy on its
    code object: any caller, any import name)."""
    from pyvene_causaltrace import bound as bound_module

    klass = type(model)
    own = klass.forward
    forwards: list[dict] = []

    def forward(self, *args, **kwargs):
        if self is model:
            forwards.append(snapshot(model))
        return own(self, *args, **kwargs)

    codes = {bound_module.bind.__code__: "bind",
             bound_module.BoundModel.__init__.__code__: "BoundModel.__init__"}
    counts: Counter = Counter()

    def spy(frame, event, _arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    klass.forward = forward
    previous = sys.getprofile()
    sys.setprofile(spy)
    try:
        call()
    finally:
        sys.setprofile(previous)
        klass.forward = own
    return {
        "forwards": len(forwards),
        "bind_calls": counts["bind"], "bindings": counts["BoundModel.__init__"],
        "max_hooks_per_site": max((f["max_per_site"] for f in forwards), default=0),
        "hooks_per_forward": [f["hooks"] for f in forwards],
        "swapped_forwards": sorted({f["swapped_forwards"] for f in forwards}),
        "crowded_sites": sorted({s for f in forwards for s in f["crowded"]}),
    }
