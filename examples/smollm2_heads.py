"""Attention inside the SmolLM2-135M graphs: which heads move the subject to the last position,
what their scores are made of, checked exact on the real model.

    python examples/first_graph.py          # once: fits smollm2-135m-skip-plt-256-top16
    python examples/smollm2_heads.py        # ~2 min per fact on 2 cores

For each fact: the graph of the answer (demeaned logit), then

- the head loadings of every edge into the logit, every layer
  (:func:`~pyvene_causaltrace.attribution.head_loadings`); per head, the part of the
  subject's edges (every source node at a subject position) that crosses it;
- an independent check on the real model: at the leading head's layer, each head's part equals
  the logit row recomputed with every other head's output cut (detached at the output
  projection), minus the row with all of them cut;
- the QK terms (:func:`~pyvene_causaltrace.attribution.qk_attribution`) of the three leading
  heads at the last position (query) and the subject's last token (key): the largest node-pair
  terms and marginals, and how exactly they sum to the score;
- the per-head trace beside the loadings (``cross_check``'s heads section): with the subject
  noised (10 seeds, ``scale="auto"``), each head's clean output alone restored at the last
  position, and Spearman over the heads between that indirect effect and the head's part of
  the subject's edges.

Writes ``examples/results/heads/<fact>/`` (``heads.json``: the split of the 20 largest subject
edges; ``qk.json``; ``heads.png``; ``head_trace.json``) and
``examples/results/heads/summary.md``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from smollm2_traces import FACTS

from pyvene_causaltrace import Tracer, load_model
from pyvene_causaltrace.attribution import (
    attribute,
    head_loadings,
    qk_attribution,
    run_local_replacement,
)
from pyvene_causaltrace.attribution.edges import target_row
from pyvene_causaltrace.attribution.graph_replay import graph_target
from pyvene_causaltrace.crosscheck.heads import head_section
from pyvene_causaltrace.models import cache_dir, get_adapter, get_module
from pyvene_causaltrace.prompts import tokenize_prompt
from pyvene_causaltrace.transcoders import load_transcoder

OUT = Path(__file__).parent / "results" / "heads"
TRANSCODER = "smollm2-135m-skip-plt-256-top16"


def cut_row(model, transcoder, graph, layer, heads, n_heads):
    """The logit row with the outputs of ``heads`` of ``layer`` detached where they enter the
    output projection: the independent reference."""
    module = get_module(model, get_adapter(model).module_path("attn_out", layer))

    def cut(_module, args):
        z = args[0]
        if not z.requires_grad:
            return None
        width = z.shape[-1] // n_heads
        pieces = [z[..., h * width:(h + 1) * width] for h in range(n_heads)]
        return (torch.cat([p.detach() if h in heads else p for h, p in enumerate(pieces)], -1),
                *args[1:])

    handle = module.register_forward_pre_hook(cut)
    try:
        run = run_local_replacement(model, transcoder, torch.tensor([graph.input_ids]),
                                    from_position=graph.from_position)
        row, _, _ = target_row(run, graph_target(graph, 0))
    finally:
        handle.remove()
    return row.detach().double()


def one_fact(model, tokenizer, transcoder, name, prompt, subject, answer) -> dict:
    start = time.perf_counter()
    graph = attribute(model, tokenizer, transcoder, prompt, answer)
    graph_s = time.perf_counter() - start
    start = time.perf_counter()
    loadings = head_loadings(model, transcoder, graph)
    loadings_s = time.perf_counter() - start
    lo, hi = tokenize_prompt(tokenizer, prompt, subject).subject_range
    positions = list(range(lo, hi))
    sources = [s for s in range(len(loadings.edges))
               if graph.coordinates(s, graph.node_kind(s))[1] in positions]
    subject_parts = loadings.parts[:, :, sources].double().sum(-1)  # [layers, heads]
    subject_edges = float(loadings.edges[sources].double().sum())
    order = subject_parts.flatten().abs().argsort(descending=True)
    n_heads = loadings.n_heads
    leading = [(int(i) // n_heads, int(i) % n_heads) for i in order[:5]]
    # the independent check at the leading head's layer
    layer = leading[0][0]
    scale = float(loadings.edges.abs().max())
    bypass = cut_row(model, transcoder, graph, layer, set(range(n_heads)), n_heads)
    worst = float((loadings.bypass[layer].double() - bypass).abs().max())
    for h in range(n_heads):
        alone = cut_row(model, transcoder, graph, layer, set(range(n_heads)) - {h}, n_heads)
        worst = max(worst, float((loadings.parts[layer, h].double() - (alone - bypass))
                                 .abs().max()))
    key_pos = max(positions)
    qks = []
    for layer_h, head in leading[:3]:
        start = time.perf_counter()
        qk = qk_attribution(model, transcoder, graph, layer_h, head, -1, key_pos)
        qks.append((qk, time.perf_counter() - start))
    start = time.perf_counter()
    tracer = Tracer(model, tokenizer, prompt, subject, answer=answer, seeds=10, scale="auto")
    heads = head_section(graph, tracer, transcoder)
    trace_s = time.perf_counter() - start
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "head_trace.json").write_text(json.dumps(heads, indent=1))
    largest = sorted(sources, key=lambda s: -abs(float(loadings.edges[s])))[:20]
    loadings.to_json(folder / "heads.json", sources=largest)  # the 20 largest subject edges
    (folder / "qk.json").write_text(json.dumps([qk.to_dict(10) for qk, _ in qks], indent=1))
    best = max(sources, key=lambda s: abs(float(loadings.edges[s])))
    loadings.plot(best, folder / "heads.png")
    return {"name": name, "prompt": prompt, "answer": answer, "graph": graph,
            "graph_s": graph_s, "loadings_s": loadings_s, "subject": positions,
            "subject_edges": subject_edges, "subject_parts": subject_parts,
            "leading": leading, "check_layer": layer, "check_worst": worst / scale,
            "qks": qks, "best": best, "loadings": loadings, "heads": heads,
            "trace_s": trace_s}


def qk_scale(qk) -> float:
    """The sum of the terms' magnitudes: what float rounding is relative to."""
    return float(qk.term_matrix().abs().sum())


def write_summary(rows) -> None:
    lines = ["# Attention inside the SmolLM2-135M graphs", "",
             f"Made by `python examples/smollm2_heads.py` with the per-layer skip transcoder "
             f"`{TRANSCODER}` (`python examples/first_graph.py`). Target: the answer's logit "
             "minus the mean of the top-10 logits. Head parts are of the logit's edges; "
             "\"subject\" sums the edges of every source node at a subject position.", ""]
    for r in rows:
        graph, parts = r["graph"], r["subject_parts"]
        lines += [f"## {r['prompt']!r} → {r['answer']!r}", "",
                  f"Graph {r['graph_s']:.0f} s ({graph.n_features} active features); head "
                  f"loadings of the logit's {len(r['loadings'].edges)} edges at all "
                  f"{len(r['loadings'].layers)} layers × {r['loadings'].n_heads} heads: "
                  f"{r['loadings_s']:.1f} s. Subject positions {r['subject']}: their edges "
                  f"sum to {r['subject_edges']:+.3f}.", "",
                  "| layer | head | subject edges through it | share of the subject's edges |",
                  "|---|---|---|---|"]
        for layer, head in r["leading"]:
            value = float(parts[layer, head])
            lines.append(f"| {layer} | {head} | {value:+.3f} | "
                         f"{value / r['subject_edges']:+.1%} |")
        lines += ["", f"Independent check at layer {r['check_layer']}: each head's part vs the "
                  "row recomputed with the other heads cut, and the bypass vs all heads cut: "
                  f"largest difference {r['check_worst']:.1e} of the row's largest edge.", "",
                  f"Largest subject edge: {graph.label(r['best'])} "
                  f"({float(r['loadings'].edges[r['best']]):+.3f}); its split by layer and "
                  "head: `heads.png`.", ""]
        heads = r["heads"]
        effects = torch.tensor(heads["effects"])
        top = effects.flatten().argsort(descending=True)[:5]
        stats = heads["stats"]
        lines += [f"Per-head trace ({r['trace_s']:.0f} s, loadings included): each head's clean "
                  "output alone restored at the last position, the subject noised. Largest "
                  "mean indirect effects: " + ", ".join(
                      f"L{int(i) // heads['n_heads']} H{int(i) % heads['n_heads']} "
                      f"{float(effects.flatten()[i]):+.3f}" for i in top)
                  + f". Spearman over all {stats['subject']['n_heads']} heads, head part of the "
                  f"subject's edges vs indirect effect: {stats['subject']['spearman']:+.2f} "
                  f"(all edges: {stats['all']['spearman']:+.2f}); "
                  "per head of the leading layers: " + ", ".join(
                      f"L{layer} {float(effects[layer, head]):+.3f}"
                      f" (H{head})" for layer, head in r["leading"][:3]) + ".", ""]
        for qk, seconds in r["qks"]:
            lines += [f"**L{qk.layer} H{qk.head}**, query @{qk.query_pos} "
                      f"{graph.tokens[qk.query_pos]!r}, key @{qk.key_pos} "
                      f"{graph.tokens[qk.key_pos]!r}: score {qk.score:+.3f} = the sum of "
                      f"{len(qk.query_nodes)} × {len(qk.key_nodes)} terms (residual "
                      f"{qk.residual:+.1e}, {abs(qk.residual) / qk_scale(qk):.1e} of the "
                      f"terms' absolute sum; {seconds:.1f} s)", "",
                      "| query node | key node | term |", "|---|---|---|"]
            for _, t in qk.top_terms(5).iterrows():
                lines.append(f"| {t['query']} | {t['key']} | {t['term']:+.3f} |")
            keys = qk.key_marginals().head(3)
            lines += ["", "Key side, summed over the query side: " + "; ".join(
                f"{row['label']} {row['marginal']:+.3f}" for _, row in keys.iterrows()), ""]
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    model, tokenizer = load_model("smollm2-135m")
    transcoder = load_transcoder(str(cache_dir() / "transcoders" / TRANSCODER))
    rows = []
    for name, prompt, subject, answer in FACTS[:2]:
        rows.append(one_fact(model, tokenizer, transcoder, name, prompt, subject, answer))
        print(f"== {name}: leading heads {rows[-1]['leading']}, check "
              f"{rows[-1]['check_worst']:.1e}", flush=True)
    write_summary(rows)


if __name__ == "__main__":
    main()
