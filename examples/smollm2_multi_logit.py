"""Multi-logit attribution graphs of the four SmolLM2-135M facts, as circuit-tracer builds them:
a logit node per salient next token (at most 10, until their probabilities reach 0.95), each
weighted by its probability; beside the single-answer graph of the same prompt, and the same
graph with circuit-tracer's BOS convention.

    python examples/fit_smollm2_clt.py --features 256 --steps 400   # once
    python examples/smollm2_multi_logit.py                           # a few minutes on 2 cores

Writes ``examples/results/multi_logit/<fact>/graph.json`` (opens in ``pyvene-causaltrace
serve examples/results/multi_logit`` and on Neuronpedia), ``summary.json`` and ``README.md``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from smollm2_traces import FACTS

from pyvene_causaltrace import load_model
from pyvene_causaltrace.atomic import write_text
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.fitting import transcoder_dir
from pyvene_causaltrace.transcoders import load_from_disk

CLT = transcoder_dir()  # the first transcoder: make attribute (or pyvene-causaltrace fit)
OUT = Path(__file__).parent / "results" / "multi_logit"


def _top_features(graph, n: int = 10) -> set[int]:
    influence = graph.influence()[:graph.n_features]
    return set(influence.argsort(descending=True)[:n].tolist())


def main() -> None:
    model, tokenizer = load_model("smollm2-135m")
    clt = load_from_disk(str(CLT))
    summary, rows = {}, []
    for name, prompt, _, answer in FACTS:
        start = time.perf_counter()
        graph = attribute(model, tokenizer, clt, prompt, max_n_logits=10,
                          desired_logit_prob=0.95)
        seconds = time.perf_counter() - start
        single = attribute(model, tokenizer, clt, prompt, answer)
        dropped = attribute(model, tokenizer, clt, prompt, max_n_logits=10,
                            desired_logit_prob=0.95, bos_errors="drop")
        lay = graph.layout
        logit_rows = graph.rows.row_of_node(lay.n_nodes)[lay.logits]
        pruned, pruned_drop = graph.prune(), dropped.prune()
        top, top_single = _top_features(graph), _top_features(single)
        entry = {
            "prompt": prompt, "answer": answer, "seconds": round(seconds, 1),
            "logits": [{"token": t["text"], "prob": round(t["prob"], 4)} for t in graph.targets],
            "probability_covered": round(sum(t["prob"] for t in graph.targets), 4),
            "logit_row_closure_max": float(graph.row_closures()[logit_rows].max()),
            "feature_row_closure_max": graph.feature_closure(),
            "active_features": graph.n_features,
            "pruned_nodes": pruned.n_nodes, "pruned_edges": pruned.n_edges,
            "scores": graph.scores(),
            "top10_features_shared_with_single_answer_graph": len(top & top_single),
            "bos_drop": {"pruned_nodes": pruned_drop.n_nodes,
                         "features_in_or_out": int((pruned.node_mask[:graph.n_features]
                                                    ^ pruned_drop.node_mask[:graph.n_features])
                                                   .sum()),
                         "max_row_closure": float(dropped.row_closures().max())},
        }
        summary[name] = entry
        directory = OUT / name
        directory.mkdir(parents=True, exist_ok=True)
        graph.to_json(directory / "graph.json", slug=f"{name}-multi-logit")
        tokens = ", ".join(f"{t['token']!r} {t['prob']:.3f}" for t in entry["logits"][:5])
        rows.append(f"| {name} | {len(entry['logits'])} ({entry['probability_covered']:.2f}) "
                    f"| {tokens} | {entry['logit_row_closure_max']:.1e} | "
                    f"{entry['pruned_nodes']} / {entry['pruned_edges']} | "
                    f"{entry['top10_features_shared_with_single_answer_graph']}/10 | "
                    f"{entry['bos_drop']['features_in_or_out']} | {seconds:.0f} |")
        print(rows[-1], flush=True)
    write_text(json.dumps(summary, indent=2), OUT / "summary.json")
    readme = [
        "# Multi-logit graphs on SmolLM2-135M", "",
        "Made by `python examples/smollm2_multi_logit.py` with the CLT of "
        "`examples/fit_smollm2_clt.py` (256 features/layer). Without an answer, `attribute` "
        "builds circuit-tracer's salient logits: a node and a row per most probable next token "
        "(at most 10, until 0.95 of the probability), each demeaned by the top-10 mean and "
        "weighted by its probability in influence and pruning. Each graph.json opens in "
        "`pyvene-causaltrace serve examples/results/multi_logit`.", "",
        "(The committed README adds which CLT fit was used and a short reading.)", "",
        "| fact | logit nodes (P covered) | top logits (P) | worst logit-row closure | "
        "pruned nodes / edges | top-10 features shared with the single-answer graph | "
        "features in/out of the pruned graph with bos_errors='drop' | s |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        "Closure is relative to the scale of what each row sums (tolerance 1e-4). `torch` "
        f"{torch.__version__}, 2 CPU cores.", ""]
    write_text("\n".join(readme), OUT / "README.md")


if __name__ == "__main__":
    main()
