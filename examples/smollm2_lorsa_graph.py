"""A graph with attention features on SmolLM2 (issue 56 item 3's figures in benchmarks/RESULTS.md):
the first transcoder (``make attribute``) and the quick Lorsa fit
(``examples/fit_smollm2_lorsa.py --layers 2 5 8``) from their cache folders, one prompt,
``attribute(..., attention=lorsa)``, the kinds' direct effects, the top Lorsa heads, QK tracing of
the kept Lorsa nodes, and the graph JSON (``out/lorsa_graph.json``).

    python examples/smollm2_lorsa_graph.py                 # the layers 2, 5, 8 fit
    python examples/smollm2_lorsa_graph.py ~/.cache/pyvene_causaltrace/lorsas/smollm2-135m-lorsa-k32-L23

The layer-23 Lorsa's graph, written out and read for one head: examples/smollm2_lorsa_role.py.
"""
# ruff: noqa: E501, E702
import sys
import time
from pathlib import Path

from pyvene_causaltrace import attribute, load_model, load_transcoder
from pyvene_causaltrace.attribution.export import check_graph_json
from pyvene_causaltrace.attribution.lorsa_qk import trace_lorsa_qk
from pyvene_causaltrace.transcoders.lorsa import load_lorsa

model, tok = load_model("smollm2-135m")
clt = load_transcoder("~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16")
lorsa = load_lorsa(sys.argv[1] if len(sys.argv) > 1 else "~/.cache/pyvene_causaltrace/lorsas/smollm2-135m-lorsa-k32")
t = time.perf_counter()
g = attribute(model, tok, clt, "The Eiffel Tower is in the city of", " Paris", attention=lorsa, max_feature_nodes=400)
sec = time.perf_counter() - t
nodes = g.nodes()
kinds = nodes["kind"].value_counts().to_dict()
expl = nodes[nodes.explored]["kind"].value_counts().to_dict()
dec = g.decomposition()
print("seconds", round(sec, 1), "kinds", kinds, "explored", expl)
print("closure target", g.closure.relative, "max row closure", float(g.row_closures().max()))
print("max_logit_change", g.metadata["max_logit_change"])
lor = nodes[nodes.kind.isin(["lorsa", "lorsa error"])]
print("direct by kind", nodes.groupby("kind")["direct"].sum().to_dict())
print("top lorsa by influence:\n", nodes[nodes.kind == "lorsa"].sort_values("influence", ascending=False).head(5)[["label", "activation", "direct", "influence"]].to_string())
t = time.perf_counter()
res = trace_lorsa_qk(model, clt, lorsa, g, top_k=5)
print("qk traced", len(res), "seconds", round(time.perf_counter() - t, 1))
if res:
    r = res[0]; print("first", g.label(r["node"]), "score", r["score"], "q", [(g.label(c) if c >= 0 else "const", round(v, 3)) for c, v in r["q_marginal"][:3]], "k", [(g.label(c) if c >= 0 else "const", round(v, 3)) for c, v in r["k_marginal"][:3]])
p = g.to_json(str(Path("out").mkdir(exist_ok=True) or Path("out/lorsa_graph.json"))); check_graph_json(p)
print("json nodes", len(p["nodes"]), "types", sorted({n["feature_type"] for n in p["nodes"]}), "qk results", len(p.get("qk_tracing_results", {})), "qk_only", len(p.get("qk_only_nodes", [])))
