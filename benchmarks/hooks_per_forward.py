"""What one public call puts on the model: hooks per site per forward, swapped ``forward``s
and ``bind()`` calls — for ``trace()``, ``trace_heads()`` and ``attribute()`` on a tiny Llama.

    python benchmarks/hooks_per_forward.py [--json out.json]

At every top-level forward of the model (``tests/_support/forwards.py``) the script reads each
submodule's hook tables: how many of the package's hooks
(:func:`~pyvene_causaltrace.hooking.is_ours`) sit on one site — a module's output (forward
hooks) or its input (pre-hooks) — and how many modules have their ``forward`` replaced.
``bind()`` calls are counted by a profiler spy on its code object (any caller, any import
name). ``tests/test_one_applier.py`` asserts the same counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]


def workloads():
    from _support.models import PROMPT, SUBJECT, make_tiny_model, make_tokenizer
    from clt_fixtures import random_clt_tensors, write_clt

    from pyvene_causaltrace import Tracer, trace
    from pyvene_causaltrace.attribution import attribute
    from pyvene_causaltrace.transcoders import load_from_disk

    tokenizer = make_tokenizer()
    model = make_tiny_model("llama", init=0.2)
    tmp = Path(tempfile.mkdtemp())
    clt = load_from_disk(str(write_clt(tmp / "clt", random_clt_tensors(3, 32, 48,
                                                                         threshold=0.1))))
    yield "trace() residual, tiny llama", model, lambda: trace(
        model, tokenizer, PROMPT, SUBJECT, seeds=2, progress=False)
    yield "trace() mlp, tiny llama", model, lambda: trace(
        model, tokenizer, PROMPT, SUBJECT, seeds=2, kind="mlp", progress=False)
    yield "trace_heads(), tiny llama", model, lambda: Tracer(
        model, tokenizer, PROMPT, SUBJECT, seeds=2).trace_heads(progress=False)
    yield "attribute(), tiny llama", model, lambda: attribute(model, tokenizer, clt, PROMPT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    found = {}
    from _support.forwards import observe

    for name, model, call in workloads():
        call()  # warm-up: lazy imports
        found[name] = observe(model, call)
        print(f"{name}: {json.dumps(found[name])}")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
