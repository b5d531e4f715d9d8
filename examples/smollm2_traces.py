"""Causal traces of four facts SmolLM2-135M knows: residual, MLP-window and attention-window
grids (10 seeds, noise scale chosen by the sweep), the severed traces, and the controls.

    python examples/smollm2_traces.py            # ~6 min on 2 CPU cores

Writes ``examples/results/<fact>/trace_<kind>.{json,png}`` and ``examples/results/summary.md``.
"""

from __future__ import annotations

from pathlib import Path

from pyvene_causaltrace import load_model
from pyvene_causaltrace.tracing.tracer import Tracer

FACTS = [
    ("eiffel", "The Eiffel Tower is in the city of", "The Eiffel Tower", " Paris"),
    ("trento", "Trento is located in the country of", "Trento", " Italy"),
    ("danish_pastry", "Danish pastry was created in the country of", "Danish pastry", " Denmark"),
    ("indira_gandhi_airport", "Indira Gandhi International Airport is located in the country of",
     "Indira Gandhi International Airport", " India"),
]
KINDS = ("residual", "mlp", "attn", "severed-mlp", "severed-attn")
OUT = Path(__file__).parent / "results"


def main() -> None:
    model, tokenizer = load_model("smollm2-135m")
    lines = ["# SmolLM2-135M causal traces", "",
             "Made by `python examples/smollm2_traces.py` (10 seeds, `scale='auto'`, window 10).",
             ""]
    for name, prompt, subject, answer in FACTS:
        tracer = Tracer(model, tokenizer, prompt, subject, answer=answer, seeds=10, scale="auto")
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        lines += [f"## {prompt!r} -> {answer!r}", "", "```", tracer.sweep.summary(), ""]
        for kind in KINDS:
            result = tracer.trace(kind)
            result.plot(str(folder / f"trace_{kind}.png"))
            (folder / f"trace_{kind}.json").write_text(result.to_json())
            lines += [result.summary(), result.table(every=3), ""]
            print(result.summary(), flush=True)
        lines += [tracer.controls().summary(), "```", ""]
        lines += [f"![{kind}]({name}/trace_{kind}.png)" for kind in KINDS[:3]] + [""]
    (OUT / "summary.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
