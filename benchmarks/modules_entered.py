"""How many package modules one public call enters, and how often it resolves the architecture
and checks its inputs (issue 40's closing numbers), on a tiny random Llama and CLT.

    PYTHONPATH=. python benchmarks/modules_entered.py [--json OUT]

Traces one ``trace()`` and one ``attribute()`` call with ``sys.setprofile`` (Python calls only)
after a warm-up call of each, and prints per call: the distinct ``pyvene_causaltrace`` modules
entered, the Python calls into the package, and the calls of a few once-only steps (whichever
of them exist at this commit, so it runs before and after the refactor).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from _support.models import PROMPT, SUBJECT, make_tiny_model, make_tokenizer  # noqa: E402
from clt_fixtures import random_clt_tensors, write_clt  # noqa: E402

#: (module suffix, function name) of steps a public call should take once.
ONCE = [("models", "get_adapter"), ("models", "check_inputs"), ("bound", "check_inputs"),
        ("tracing.chunks", "check_seeds_fit"), ("finite", "check_weights"), ("bound", "bind")]


def profile(call):
    modules, calls, steps = Counter(), 0, Counter()

    def hook(frame, event, _arg):
        nonlocal calls
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("pyvene_causaltrace"):
            return
        calls += 1
        modules[name] += 1
        short = name.removeprefix("pyvene_causaltrace.")
        for module, function in ONCE:
            if short == module and frame.f_code.co_name == function:
                steps[f"{module}.{function}"] += 1

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return {"modules": len(modules), "calls": calls, "steps": dict(steps),
            "module_names": sorted(modules)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import pyvene_causaltrace as pvct
    from pyvene_causaltrace.attribution import attribute
    from pyvene_causaltrace.transcoders import load_from_disk

    torch.manual_seed(0)
    model = make_tiny_model("llama", init=0.2)
    tokenizer = make_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        transcoder = load_from_disk(write_clt(Path(tmp) / "clt", random_clt_tensors(
            n_layers=3, d_model=32, d_transcoder=48)))

        def one_trace():
            pvct.trace(model, tokenizer, PROMPT, subject=SUBJECT, kind="residual", seeds=2,
                       progress=False)

        def one_graph():
            attribute(model, tokenizer, transcoder, PROMPT)

        one_trace(), one_graph()  # warm-up: lazy imports and first-use caches
        report = {"package": str(Path(pvct.__file__).parent), "trace": profile(one_trace),
                  "attribute": profile(one_graph)}
    for name in ("trace", "attribute"):
        row = report[name]
        print(f"{name}: {row['modules']} modules, {row['calls']} calls, steps {row['steps']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
