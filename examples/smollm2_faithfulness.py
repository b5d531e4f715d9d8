"""How far to trust a graph on the real model: MIB's f(k) (nodes and edges, CPR/CMD against the
random band) and the feature-budget curve of the Eiffel Tower graph (SmolLM2-135M-Instruct and
the first transcoder, ``make attribute``'s: skip per-layer set, 256 TopK-16 features a layer).

    python examples/smollm2_faithfulness.py        # writes examples/results/faithfulness/*.json,
                                                   # its two PNGs, and prints the tables

The page reading these numbers is examples/results/faithfulness.md; the timings printed are
wall seconds of each curve (2 shared CPU cores: upper bounds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pyvene_causaltrace import load_model, load_transcoder
from pyvene_causaltrace.atomic import write_text
from pyvene_causaltrace.attribution import attribute, budget_curve, faithfulness
from pyvene_causaltrace.fitting import transcoder_dir

PROMPT, ANSWER = "The Eiffel Tower is in the city of", " Paris"
COUNTERFACTUAL, FOIL = "The Colosseum is in the city of", " Rome"  # as many tokens
OUT = Path(__file__).parent / "results" / "faithfulness"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--draws", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    clt = load_transcoder(str(transcoder_dir()))
    started = time.perf_counter()
    graph = attribute(model, tokenizer, clt, PROMPT, ANSWER)
    graph_seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"prompt": PROMPT, "answer": ANSWER, "counterfactual": COUNTERFACTUAL,
              "foil": FOIL, "transcoder": str(transcoder_dir().name),
              "n_features": graph.n_features, "graph_seconds": graph_seconds,
              "torch_threads": torch.get_num_threads(), "curves": {}}
    runs = {
        "nodes": lambda: faithfulness(model, tokenizer, clt, graph, COUNTERFACTUAL, foil=FOIL,
                                      draws=args.draws),
        "edges": lambda: faithfulness(model, tokenizer, clt, graph, COUNTERFACTUAL, foil=FOIL,
                                      level="edges", draws=args.draws),
        "nodes_zero_prob": lambda: faithfulness(model, tokenizer, clt, graph, ablation="zero",
                                                metric="prob", draws=args.draws),
        "budget_zero": lambda: budget_curve(model, tokenizer, clt, graph, ablation="zero",
                                            draws=args.draws),
        "budget_counterfactual": lambda: budget_curve(model, tokenizer, clt, graph,
                                                      COUNTERFACTUAL, draws=args.draws),
    }
    for name, run in runs.items():
        curve = run()
        curve.to_json(args.out / f"{name}.json")
        print(f"== {name}: {curve.forwards} forwards, {curve.seconds:.1f} s")
        print(curve.to_dataframe().to_string(index=False))
        if hasattr(curve, "cpr"):
            print(f"CPR {curve.cpr:.4f} CMD {curve.cmd:.4f}; random CPR "
                  f"{[round(c, 4) for c in curve.random_cpr]}")
        record["curves"][name] = {"forwards": curve.forwards, "seconds": curve.seconds}
        if name in ("nodes", "budget_zero"):
            curve.plot(args.out / f"{name}.png")
    write_text(json.dumps(record, indent=1), args.out / "run.json")


if __name__ == "__main__":
    main()
