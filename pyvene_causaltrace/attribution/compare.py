"""How far one graph is from another of the same prompt and targets: a bfloat16 graph from the
float32 one (:mod:`.precision`), or any two runs.

    deviation = graph_deviation(bf16_graph, float32_graph)
    deviation["edges"]["graph"], deviation["top_overlap"], deviation["closure"]

Nodes are matched by what they are, not by index: a feature by (layer, position, id), so a
feature active in one graph only (a pre-activation that rounding moved across its threshold)
is a node of the union whose edges in the other graph are 0 (a Lorsa head is never a
feature); a logit node by its target (the salient logits of a bfloat16 model can come in
another order); errors, steering and tokens by their place, which the same prompt fixes. Edge
errors are relative to the largest ``|edge|`` (per row: the row's, of either graph; over the
graph: the graph's), the measure tests_peer compares circuit-tracer's graphs by."""

from __future__ import annotations

import torch

from ..arguments import PositiveInt, checked
from ..errors import InputError
from .graph import AttributionGraph

__all__ = ["graph_deviation"]


def _keys(graph: AttributionGraph, width: int) -> torch.Tensor:
    """One integer per feature node: ``((lorsa * n_layers + layer) * n_pos + position) * width
    + id`` (``lorsa``: 1 for a Lorsa head, whose coordinates can be a transcoder feature's)."""
    lorsa = (torch.arange(graph.n_features) >= graph.first_lorsa_node).long()
    layer = lorsa * graph.n_layers + graph.feature_layer.long()
    return (layer * graph.n_pos + graph.feature_position.long()) * width + graph.feature_id.long()


def _name(target: dict) -> str:
    """A logit node's identity: its target's name (the kind, or the direction's), token, output
    and position (every salient logit has one name: the token tells them apart)."""
    return "|".join(str(target.get(key)) for key in ("name", "token", "output", "position"))


def _check_same(graph: AttributionGraph, reference: AttributionGraph) -> None:
    """Refuse two graphs of different prompts, targets or non-feature nodes."""
    same = (list(graph.input_ids) == list(reference.input_ids)
            and sorted(map(_name, graph.targets)) == sorted(map(_name, reference.targets))
            and graph.lorsa_layers == reference.lorsa_layers
            and graph.layout.n_nodes - graph.n_features
            == reference.layout.n_nodes - reference.n_features)
    if not same:
        raise InputError("graph and reference must be graphs of the same prompt and targets "
                         "(the same tokens, logit nodes, errors, Lorsa layers and steering "
                         "nodes)")


@checked
def graph_deviation(graph: AttributionGraph, reference: AttributionGraph,
                    top: PositiveInt = 100, chunk: PositiveInt = 1024) -> dict:
    """How ``graph`` deviates from ``reference`` (module docstring).

    ``edges``, between the nodes both graphs have: ``graph``, max ``|Δedge|`` over the largest
    ``|edge|``; ``row_max`` and ``row_median``, the same per row; ``with_unshared``, ``graph``'s
    measure with the feature nodes only one graph has (their edges 0 in the other).
    ``top_overlap``: the share of ``reference``'s ``top`` source nodes by influence that are
    among ``graph``'s. ``target``: each graph's target value and their relative difference.
    ``closure``: each graph's target-row and worst feature-row closure, and its tolerance.
    ``features``: each graph's count and those only one has. ``chunk`` rows are
    made dense at a time (float64), so a long graph's rows are never all dense. Refused
    (:class:`~..errors.InputError`): graphs of different prompts or targets."""
    _check_same(graph, reference)
    width = 1 + max((int(g.feature_id.max()) for g in (graph, reference) if g.n_features),
                    default=0)
    union, inverse = torch.unique(torch.cat([_keys(graph, width), _keys(reference, width)]),
                                  return_inverse=True)
    n_union = len(union)
    maps, names = [], [_name(t) for t in reference.targets]
    for g, features in ((graph, inverse[:graph.n_features]),
                        (reference, inverse[graph.n_features:])):
        rest = n_union + torch.arange(g.layout.n_nodes - g.n_features)
        order = [names.index(_name(t)) for t in g.targets]  # logit nodes: by target
        rest[len(rest) - len(order):] = rest[len(rest) - len(order):][0] + torch.tensor(order)
        maps.append(torch.cat([features, rest]))
    n_nodes = n_union + graph.layout.n_nodes - graph.n_features
    n_columns = n_nodes - graph.layout.n_logits
    row_nodes = torch.unique(torch.cat([m[g.rows.nodes] for g, m in
                                        zip((graph, reference), maps, strict=True)]))
    where = torch.full((n_nodes,), -1, dtype=torch.long)
    where[row_nodes] = torch.arange(len(row_nodes))
    both = torch.zeros(n_nodes, 2, dtype=torch.bool)  # nodes each graph has
    for j, m in enumerate(maps):
        both[m, j] = True
    both = both.all(1)
    rows_both, columns_both = both[row_nodes], both[:n_columns]
    slots = [where[m[g.rows.nodes]] for g, m in zip((graph, reference), maps, strict=True)]
    whole_delta = whole_scale = 0.0
    deltas, scales = [], []
    for start in range(0, len(row_nodes), chunk):  # rows a chunk at a time: no [rows, columns]
        stop = min(start + chunk, len(row_nodes))
        dense = []
        for g, m, slot in zip((graph, reference), maps, slots, strict=True):
            out = torch.zeros(stop - start, n_columns, dtype=torch.float64)
            mine = ((slot >= start) & (slot < stop)).nonzero().reshape(-1)
            out[(slot[mine] - start)[:, None], m[:g.rows.n_columns][None, :]] = (
                g.rows.dense(mine).double())
            dense.append(out)
        a, b = dense
        delta = (a - b).abs()
        whole_delta = max(whole_delta, float(delta.max()))
        whole_scale = max(whole_scale, float(torch.maximum(a.abs().max(), b.abs().max())))
        keep = rows_both[start:stop]
        delta, a, b = (x[keep][:, columns_both] for x in (delta, a, b))
        deltas.append(delta.amax(1))
        scales.append(torch.maximum(a.abs().amax(1), b.abs().amax(1)))
    whole = whole_delta / max(whole_scale, 1e-30)
    delta, scale = torch.cat(deltas), torch.cat(scales)
    has = scale > 0
    per_row = delta[has] / scale[has]
    influence = []
    for g, m in zip((graph, reference), maps, strict=True):
        score = g.influence()[:g.rows.n_columns].double()
        order = score.argsort(descending=True, stable=True)[:top]
        influence.append(set(m[order].tolist()))
    k = min(top, len(influence[1]))
    value = {"graph": graph.closure.target, "reference": reference.closure.target}
    value["relative"] = abs(value["graph"] - value["reference"]) / max(
        abs(value["reference"]), 1e-30)
    return {
        "edges": {"graph": float(delta.max()) / max(float(scale.max()), 1e-30),
                  "row_max": float(per_row.max()) if len(per_row) else 0.0,
                  "row_median": float(per_row.median()) if len(per_row) else 0.0,
                  "rows": int(rows_both.sum()), "with_unshared": whole},
        "top": k,
        "top_overlap": len(influence[0] & influence[1]) / max(k, 1),
        "target": value,
        "closure": {name: {"target_row": g.closure.relative, "feature_rows": g.feature_closure(),
                           "tolerance": g.closure.tolerance}
                    for name, g in (("graph", graph), ("reference", reference))},
        "features": {"graph": graph.n_features, "reference": reference.n_features,
                     "only_in_graph": n_union - reference.n_features,
                     "only_in_reference": n_union - graph.n_features},
    }
