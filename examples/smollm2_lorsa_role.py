"""One attention feature's role in a SmolLM2 graph with Lorsa (examples/results/lorsa.md).

    python examples/first_graph.py                                         # the transcoder
    python examples/fit_smollm2_lorsa.py --layers 23 --texts 192 --steps 300   # the Lorsa
    python examples/smollm2_lorsa_role.py                                  # 2-10 min, 2 busy cores

The graph of " Paris" after "The Eiffel Tower is in the city of" through the first transcoder
(``smollm2-135m-skip-plt-256-top16``) with the Lorsa's OV heads as feature nodes
(``attribute(..., attention=lorsa)``), then, for the Lorsa node of largest influence at the last
position (or ``--node``):

- its QK head's attention from the last position (the Lorsa's QK heads are the model's, so the
  pattern is the model's head's), and QK tracing of its score to the key it attends to most;
- its OV side: its direct effect on the graph's target, the tokens its output direction
  promotes through the unembedding (final norm's gain, statistic left out), and the explored
  features it feeds (its column in their rows);
- interventions on the real model, the Lorsa spliced at its layer with the clean run's error
  held (unablated the forward is the model's own): the head zeroed at every position
  (``heads_off``), at the last position only, set to 2x and 4x there; the same zeroing of
  ``--random`` heads active at the last position with activations nearest to its (log ratio);
  the model's own attention head (the Lorsa head's QK head) zeroed at the last position;
- the same head on seven other prompts (``OTHER_PROMPTS``): its activation at the last position
  and P(answer) with it zeroed.

Writes ``examples/results/lorsa/`` (``graph.json`` for the viewer, ``nodes.csv`` of the pruned
graph's nodes, ``summary.json`` with every figure the page quotes).
"""
# ruff: noqa: E501

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from pyvene_causaltrace import attribute, load_model, load_transcoder
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.attribution.graph_replay import graph_run
from pyvene_causaltrace.attribution.lorsa_qk import lorsa_qk_tracing, trace_lorsa_qk
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.interventions.lorsa_splice import (
    clean_lorsa_errors,
    lorsa_splice_representations,
)
from pyvene_causaltrace.runtime import intervened
from pyvene_causaltrace.transcoders.lorsa import load_lorsa, lorsa_states

ROOT = Path(__file__).resolve().parents[1]
PROMPT, ANSWER = "The Eiffel Tower is in the city of", " Paris"
CACHE = "~/.cache/pyvene_causaltrace"
#: Other prompts for the chosen head: French places, other countries' cities, French not a place.
OTHER_PROMPTS = (("The Louvre is in the city of", " Paris"),
                 ("Notre-Dame Cathedral is in the city of", " Paris"),
                 ("Mont Saint-Michel is in the region of", " Normandy"),
                 ("The Colosseum is in the city of", " Rome"),
                 ("The Brandenburg Gate is in the city of", " Berlin"),
                 ("Big Ben is in the city of", " London"),
                 ("The mother tongue of Danielle Darrieux is", " French"))


@contextmanager
def added(bound, layer: int, delta: torch.Tensor):
    """The attention output of ``layer`` plus ``delta`` ``[P, D]`` (a forward hook)."""
    def hook(module, args, output):
        return (output[0] + delta.to(output[0].dtype), *output[1:])
    handle = bound.module("attn", layer).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def head_zeroed(bound, layer: int, head: int, position: int):
    """The model's attention head ``head`` of ``layer`` cut at ``position`` (its slice of the
    output projection's input zeroed)."""
    dh = bound.head_dim

    def hook(module, args):
        x = args[0].clone()
        x[:, position, head * dh:(head + 1) * dh] = 0
        return (x, *args[1:])
    handle = bound.module("attn", layer).o_proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transcoder", default=f"{CACHE}/transcoders/smollm2-135m-skip-plt-256-top16")
    parser.add_argument("--lorsa", default=f"{CACHE}/lorsas/smollm2-135m-lorsa-k32-L23")
    parser.add_argument("--out", type=Path, default=ROOT / "examples" / "results" / "lorsa")
    parser.add_argument("--node", type=int, help="the Lorsa node read (default: largest influence at the last position)")
    parser.add_argument("--random", type=int, default=20)
    parser.add_argument("--max-feature-nodes", type=int, default=400)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m")
    bound = bind(model)
    clt, lorsa = load_transcoder(args.transcoder), load_lorsa(args.lorsa)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    answer = tok(ANSWER)["input_ids"][0]
    last = ids.shape[1] - 1
    out: dict = {"prompt": PROMPT, "answer": ANSWER, "transcoder": Path(args.transcoder).name,
                 "lorsa": Path(args.lorsa).name, "lorsa_layers": sorted(lorsa.layers)}

    # -- the graph ---------------------------------------------------------------------------
    start = time.perf_counter()
    g = attribute(model, tok, clt, PROMPT, ANSWER, attention=lorsa,
                  max_feature_nodes=args.max_feature_nodes)
    out["graph_seconds"] = round(time.perf_counter() - start, 1)
    nodes = g.nodes()
    infl = nodes.groupby("kind")["influence"].sum()
    out.update({
        "target": {k: v for k, v in g.target.items() if isinstance(v, (str, int, float))},
        "answer_prob": g.answer_prob, "kinds": nodes["kind"].value_counts().to_dict(),
        "explored": nodes[nodes.explored]["kind"].value_counts().to_dict(),
        "closure_target": g.closure.relative, "closure_worst_row": float(g.row_closures().max()),
        "decomposition": g.decomposition(), "scores": g.scores(),
        "direct_by_kind": nodes.groupby("kind")["direct"].sum().to_dict(),
        "influence_share_by_kind": (infl / infl[infl.index != "logit"].sum()).to_dict()})
    lor = nodes[nodes.kind == "lorsa"].sort_values("influence", ascending=False)
    cols = ["node", "label", "activation", "direct", "influence"]
    out["top_lorsa"] = lor.head(10)[cols].to_dict("records")
    out["top_lorsa_last"] = lor[lor.position == last].head(10)[cols].to_dict("records")
    out["top_direct"] = g.direct_attributions(12).to_dict("records")
    node = args.node if args.node is not None else int(lor[lor.position == last].iloc[0]["node"])
    layer, pos, head, act = g.coordinates(node, "lorsa")
    one = lorsa[layer]
    group = one.cfg.group
    qk_head = head // group
    rank = int((lor.node == node).values.nonzero()[0][0]) + 1
    out["chosen"] = {"node": node, "label": g.label(node), "layer": layer, "position": pos,
                     "head": head, "qk_head": qk_head, "activation": act,
                     "direct": float(g.target_row()[node]), "influence": float(g.influence()[node]),
                     "influence_rank_among_lorsa": rank, "explored": bool(g.explored[node])}

    # -- QK: where it attends, and why ---------------------------------------------------------
    states = lorsa_states(model, lorsa, ids)
    x = states["input"][layer][None]
    pattern, _ = one.attention(x)
    row = pattern[0, qk_head, pos]
    top = row.argsort(descending=True)[:4]
    out["attention"] = [{"key": int(k), "token": g.tokens[int(k)], "weight": float(row[k])} for k in top]
    # the activation (before ReLU/TopK) is sum_k pattern[k] * v_k: what each key brings
    v = (x[0].to(one.dtype) @ one.W_V[head] + one.b_V[head]).float()
    parts = row.float() * v
    out["activation_by_key"] = [{"key": k, "token": g.tokens[k], "weight": float(row[k]),
                                 "value": float(v[k]), "part": float(parts[k])}
                                for k in range(pos + 1)]
    out["activation_pre"] = float(parts.sum())
    src = g.row(node)
    order = src.abs().argsort(descending=True)[:10]
    out["inputs"] = [[g.label(int(i)), float(src[i])] for i in order]
    kept = g.prune().node_mask.nonzero().squeeze(-1)
    traced = [int(i) for i in kept if g.node_kind(int(i)) == "lorsa"]
    if node not in traced:
        traced.append(node)
    start = time.perf_counter()
    results = trace_lorsa_qk(model, clt, lorsa, g, traced)
    out["qk_seconds"] = round(time.perf_counter() - start, 1)
    out["qk_traced"] = len(results)
    res = next(r for r in results if r["node"] == node)

    def name(c):
        return "constants" if c < 0 else g.label(c)
    def named(res):
        return {"score": res["score"], "key_position": res["key_position"],
                "key_token": g.tokens[res["key_position"]],
                "q_marginal": [[name(c), v] for c, v in res["q_marginal"]],
                "k_marginal": [[name(c), v] for c, v in res["k_marginal"]],
                "pairs": [[name(a), name(b), v] for a, b, v in res["pairs"]]}
    out["qk"] = named(res)
    # the key that brings most of the activation (the argmax key can be a sink)
    key = max(range(pos + 1), key=lambda k: float(parts[k]))
    run = graph_run(bound, clt, g, lorsa=lorsa)
    out["qk_value_key"] = named(lorsa_qk_tracing(run, lorsa, node, key_pos=key))
    q, k_ = one.queries_keys(x)
    direct_scores = (k_[0, :pos + 1, qk_head] @ q[0, pos, qk_head]).float() / one.cfg.attn_scale
    out["qk_scores_by_key"] = {f"{g.tokens[k]!r} @{k}": float(direct_scores[k]) for k in range(pos + 1)}

    # -- OV: what it writes ----------------------------------------------------------------------
    w_u = model.get_output_embeddings().weight.float()
    gain = model.model.norm.weight.float()
    lens = (w_u @ (one.W_O[head].float() * gain))
    promoted = lens.topk(10)
    out["ov_lens_top"] = [[tok.decode([int(i)]), float(v)] for v, i in zip(*promoted, strict=True)]
    out["ov_lens_answer"] = {"value": float(lens[answer]), "rank": int((lens > lens[answer]).sum()) + 1,
                             "of": int(lens.numel())}
    dense = g.rows.dense(list(range(g.rows.n_rows)))
    targets = g.rows.nodes
    column = dense[:, node]
    order = column.abs().argsort(descending=True)[:10]
    out["feeds"] = [{"target": g.label(int(targets[i])), "edge": float(column[i])}
                    for i in order if column[i] != 0]

    # -- interventions --------------------------------------------------------------------------
    errors = clean_lorsa_errors(model, lorsa, ids)
    acts = one.encode(x)[0]  # [P, n_ov] as the splice encodes (from position 1)
    acts[:1] = 0

    def prob(heads_off=None, delta=None, zero_model_head=None) -> float:
        if zero_model_head is not None:  # the model alone: a splice would overwrite the cut
            with torch.no_grad(), head_zeroed(bound, layer, zero_model_head, pos):
                return float(model(input_ids=ids).logits[0, -1].softmax(-1)[answer])
        reps = lorsa_splice_representations(model, lorsa, layers=[layer], errors={layer: errors[layer]},
                                            heads_off=heads_off)
        with torch.no_grad(), intervened(bound, reps) as m:
            if delta is not None:  # registered after the splice's hooks: added to its output
                with added(bound, layer, delta):
                    logits = m(input_ids=ids).logits
            else:
                logits = m(input_ids=ids).logits
        return float(logits[0, -1].softmax(-1)[answer])

    with torch.no_grad():
        clean = float(model(input_ids=ids).logits[0, -1].softmax(-1)[answer])
    w_o = one.W_O[head].float()

    def at_last(scale: float) -> torch.Tensor:  # the head's output at the last position, times
        delta = torch.zeros(ids.shape[1], w_o.shape[0])
        delta[pos] = scale * act * w_o
        return delta
    iv = {"clean": clean, "spliced_unablated": prob(),
          "zeroed_all_positions": prob([head]),
          "zeroed_all_positions_by_hook": prob(delta=-acts[:, head, None] * w_o),
          "zeroed_last_position": prob(delta=at_last(-1)),
          "steered_2x_last": prob(delta=at_last(1)), "steered_4x_last": prob(delta=at_last(3)),
          "flipped_last": prob(delta=at_last(-2)),
          "positions_active": int(acts[:, head].gt(0).sum()),
          "model_head_zeroed_last": prob(zero_model_head=qk_head),
          "qk_group_zeroed_all_positions": prob(list(range(qk_head * group, (qk_head + 1) * group)))}
    at = acts[pos]
    others = [int(h) for h in at.nonzero().squeeze(-1) if int(h) != head]
    others.sort(key=lambda h: abs(math.log(float(at[h]) / act)))
    picks = others[:args.random]
    rand = [{"head": h, "activation": float(at[h]), "p": prob([h])} for h in picks]
    ps = torch.tensor([r["p"] for r in rand])
    iv["random"] = rand
    iv["random_summary"] = {"n": len(rand), "mean": float(ps.mean()), "min": float(ps.min()),
                            "max": float(ps.max()),
                            "activation_range": [min(r["activation"] for r in rand),
                                                 max(r["activation"] for r in rand)],
                            "rank_of_chosen_drop": int((ps < iv["zeroed_all_positions"]).sum()) + 1}
    top_last = [int(r["node"]) for r in out["top_lorsa_last"][:5]]
    iv["top5_last_zeroed_all_positions"] = prob([g.coordinates(n, "lorsa")[2] for n in top_last])
    out["interventions"] = iv

    # -- the same head on other prompts (no graphs: its activation at the last position, and
    # P(answer) with it zeroed at every position, the clean errors of that prompt held) ---------
    others_out = []
    for prompt, ans in OTHER_PROMPTS:
        o_ids = tok(prompt, return_tensors="pt")["input_ids"]
        o_ans = tok(ans)["input_ids"][0]
        o_x = lorsa_states(model, lorsa, o_ids)["input"][layer][None]
        o_acts = one.encode(o_x)[0]
        o_err = clean_lorsa_errors(model, lorsa, o_ids)
        ps = []
        for off in (None, [head]):
            reps = lorsa_splice_representations(model, lorsa, layers=[layer],
                                                errors={layer: o_err[layer]}, heads_off=off)
            with torch.no_grad(), intervened(bound, reps) as m:
                ps.append(float(m(input_ids=o_ids).logits[0, -1].softmax(-1)[o_ans]))
        others_out.append({"prompt": prompt, "answer": ans, "activation_last": float(o_acts[-1, head]),
                           "rank_last": int((o_acts[-1] > o_acts[-1, head]).sum()) + 1
                           if o_acts[-1, head] > 0 else None,
                           "p": ps[0], "p_zeroed": ps[1]})
    out["other_prompts"] = others_out

    # -- files ------------------------------------------------------------------------------------
    args.out.mkdir(parents=True, exist_ok=True)
    page = g.to_json(args.out / "graph.json")
    check_graph_json(page)
    out["json"] = {"nodes": len(page["nodes"]), "links": len(page["links"]),
                   "qk_tracing_results": len(page.get("qk_tracing_results", {})),
                   "qk_only_nodes": len(page.get("qk_only_nodes", []))}
    nodes[g.prune().node_mask.numpy()].drop(columns=["token_prob"]).to_csv(
        args.out / "nodes.csv", index=False, float_format="%.6g")
    (args.out / "summary.json").write_text(json.dumps(out, indent=2, default=float) + "\n")
    print(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
