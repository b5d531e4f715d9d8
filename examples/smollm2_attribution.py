"""Attribution graphs of four facts SmolLM2-135M knows, through the CLT fitted by
``examples/fit_smollm2_clt.py``, and the seed's closing test on the real model: ablate the
features each graph blames most and compare with ablating as many random active features.

    python examples/fit_smollm2_clt.py --features 256 --steps 400   # once (~16 min)
    python examples/smollm2_attribution.py                           # ~8 min on 2 CPU cores
    python examples/smollm2_attribution.py --from-saved              # ablations only

Writes ``examples/results/attribution/<fact>/{graph.json,graph.png,nodes.csv}`` and
``examples/results/attribution/summary.{md,json}``; the whole graphs go to
``~/.cache/pyvene_causaltrace/graphs/<fact>.pt`` (too large to commit). Features are ranked for
ablation two ways: by influence on the target (unsigned, circuit-tracer's ranking) and by
signed direct effect (largest positive first).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from smollm2_traces import FACTS

from pyvene_causaltrace import load_model
from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.attribution.validate import ablation_test
from pyvene_causaltrace.fitting import transcoder_dir
from pyvene_causaltrace.transcoders import load_from_disk

CLT = transcoder_dir()  # the first transcoder: make attribute (or pyvene-causaltrace fit)
OUT = Path(__file__).parent / "results" / "attribution"
GRAPHS = CLT.parent.parent / "graphs"
SIZES, DRAWS = (5, 10, 20), 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-saved", action="store_true",
                        help="reuse the graphs saved by an earlier run")
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    clt = load_from_disk(str(CLT))
    lines = ["# SmolLM2-135M attribution graphs", "",
             "Made by `python examples/smollm2_attribution.py` with the CLT of "
             "`examples/fit_smollm2_clt.py` (256 features/layer, held-out FVU 0.677). Target: "
             "the answer's logit minus the mean of the top-10 logits. Ablations: in the spliced "
             f"model (CLT + the clean run's error, live attention), {DRAWS} random draws.", ""]
    table = ["| fact | features | closure residual (rel.) | feature rows (rel.) | errors / target "
             "| replacement | completeness | s |", "|---|---|---|---|---|---|---|---|"]
    ablation = ["| fact | P clean | P spliced | n | P top-n ablated, by influence "
                "| P top-n ablated, by direct effect | P random-n (mean, min..max) |",
                "|---|---|---|---|---|---|---|"]
    summary = {}
    for name, prompt, _, answer in FACTS:
        saved = GRAPHS / f"{name}.safetensors"
        start = time.perf_counter()
        if args.from_saved:
            graph = AttributionGraph.load(saved)
        else:
            graph = attribute(model, tokenizer, clt, prompt, answer)
            graph.metadata["wall_seconds"] = time.perf_counter() - start
            GRAPHS.mkdir(parents=True, exist_ok=True)
            graph.save(saved)
        seconds = graph.metadata["wall_seconds"]
        result = ablation_test(model, clt, graph, sizes=SIZES, draws=DRAWS)
        direct = ablation_test(model, clt, graph, sizes=SIZES, draws=1, rank_by="direct")
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        graph.to_json(out / "graph.json", slug=f"smollm2-{name}")
        graph.plot(out / "graph.png")
        graph.nodes().to_csv(out / "nodes.csv", index=False)
        c, parts, scores = graph.closure, graph.decomposition(), graph.scores()
        table.append(f"| {name} | {graph.n_features} | {c.residual:+.1e} ({c.relative:.1e}) | "
                     f"{graph.feature_closure():.1e} | {parts['error_share']:.2f} | "
                     f"{scores['replacement']:.3f} | {scores['completeness']:.3f} | "
                     f"{seconds:.0f} |")
        for n in result.top:
            rand = result.random[n]
            ablation.append(
                f"| {name} | {result.clean_prob:.4f} | {result.spliced_prob:.4f} | {n} | "
                f"{result.top[n]:.4f} | {direct.top[n]:.4f} | {sum(rand) / len(rand):.4f} "
                f"({min(rand):.4f}..{max(rand):.4f}) |")
        summary[name] = {"prompt": prompt, "answer": answer, "seconds": seconds,
                         "closure": c.to_dict(), "feature_closure": graph.feature_closure(),
                         "decomposition": parts, "scores": scores,
                         "top_direct": graph.direct_attributions(10).to_dict("records"),
                         "ablation": result.to_dict(), "ablation_direct": direct.to_dict(),
                         "metadata": graph.metadata}
        print(f"{name}: {graph.n_features} features, closure {c.relative:.1e}, "
              f"{seconds:.0f} s; ablation top-5 {result.top[5]:.4f} vs random "
              f"{sum(result.random[5]) / DRAWS:.4f}", flush=True)
    lines += ["## Closure and scores", "", *table, "", "## Ablation test", "", *ablation, ""]
    (OUT / "summary.md").write_text("\n".join(lines))
    (OUT / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
