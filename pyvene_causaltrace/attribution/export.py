"""The circuit-tracer / Neuronpedia graph JSON, so a graph opens in their viewer.

Top level ``metadata``, ``qParams``, ``nodes``, ``links``. Node ids follow circuit-tracer's
current format: feature ``"{layer}_{feature}_{pos}"``, error ``"{layer}_-1_{pos}"`` (the older
``"0_{layer}_{pos}"`` collided with feature ids), token ``"E_{token_id}_{pos}"``, logit
``"{n_layers + 1}_{token_id}_{pos}"``. Only the pruned graph is exported: kept nodes touched by a
kept link, plus every token and the logit; links carry the raw signed edge weight.
"""

from __future__ import annotations

from typing import Any


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def _clean(token: str) -> str:
    return token.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _node(node_id: str, feature: int, layer: str, pos: int, kind: str, js_id: str, *,
          clerp: str = "", influence: float | None = None, activation: float | None = None,
          token_prob: float = 0.0, is_target: bool = False) -> dict[str, Any]:
    return {"node_id": node_id, "feature": feature, "layer": layer, "ctx_idx": pos,
            "feature_type": kind, "token_prob": token_prob, "is_target_logit": is_target,
            "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": js_id, "clerp": clerp,
            "influence": influence, "activation": activation}


def node_ids(graph) -> list[str]:
    """Each node's exported id, in node order."""
    lay, ids = graph.layout, []
    for i in range(lay.n_nodes):
        kind = graph.node_kind(i)
        layer, pos, feature, _ = graph.coordinates(i, kind)
        if kind == "feature":
            ids.append(f"{layer}_{feature}_{pos}")
        elif kind == "error":
            ids.append(f"{layer}_-1_{pos}")
        elif kind == "token":
            ids.append(f"E_{graph.input_ids[pos]}_{pos}")
        else:
            ids.append(f"{graph.n_layers + 1}_{graph.target['token']}_{pos}")
    return ids


def graph_json(graph, slug: str | None = None, node_threshold: float = 0.8,
               edge_threshold: float = 0.98) -> dict[str, Any]:
    """The viewer's JSON for ``graph`` pruned at the two thresholds."""
    from .. import __version__

    pruned = graph.prune(node_threshold, edge_threshold)
    full = graph.square()
    edge = pruned.edge_mask
    touched = edge.any(0) | edge.any(1)
    ids = node_ids(graph)
    lay = graph.layout
    nodes = []
    for i in range(lay.n_nodes):
        kind = graph.node_kind(i)
        if kind in ("feature", "error") and not (pruned.node_mask[i] and touched[i]):
            continue
        layer, pos, feature, activation = graph.coordinates(i, kind)
        influence = float(pruned.cumulative_scores[i])
        if kind == "feature":
            nodes.append(_node(ids[i], _cantor(layer, feature), str(layer), pos,
                               "cross layer transcoder", f"{layer}_{feature}-0",
                               influence=influence, activation=activation))
        elif kind == "error":
            nodes.append(_node(ids[i], -1, str(layer), pos, "mlp reconstruction error",
                               f"{layer}_-1-{pos}", influence=influence))
        elif kind == "token":
            nodes.append(_node(ids[i], pos, "E", pos, "embedding",
                               f"E_{graph.input_ids[pos]}-{pos}", influence=influence))
        else:
            token = graph.target["token"]
            nodes.append(_node(ids[i], token, str(graph.n_layers + 1), pos, "logit",
                               f"L_{token}-{pos}", token_prob=graph.answer_prob, is_target=True,
                               clerp=f'Output "{_clean(graph.answer)}" '
                                     f'(p={graph.answer_prob:.3f})'))
    kept = {node["node_id"] for node in nodes}
    target, source = edge.nonzero(as_tuple=True)
    links = [{"source": ids[s], "target": ids[t], "weight": float(full[t, s])}
             for t, s in zip(target.tolist(), source.tolist(), strict=True)
             if ids[s] in kept and ids[t] in kept]
    metadata = {
        "slug": slug or "pyvene-causaltrace-graph",
        "scan": str(graph.metadata.get("model", "")),
        "transcoder_list": [],
        "prompt_tokens": [_clean(t) for t in graph.tokens],
        "prompt": graph.prompt,
        "node_threshold": node_threshold,
        "schema_version": 1,
        "info": {"generator": {"name": "pyvene-causaltrace", "version": __version__},
                 "transcoder_set": str(graph.metadata.get("clt", ""))},
        "pruning_settings": {"node_threshold": node_threshold, "edge_threshold": edge_threshold},
        "generation_settings": {"target": graph.target["name"]},
    }
    q_params = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
                "sg_pos": ""}
    return {"metadata": metadata, "qParams": q_params, "nodes": nodes, "links": links}
