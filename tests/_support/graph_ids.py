"""Exported node ids of a whole graph, for the tests' checks on small graphs."""

from __future__ import annotations

from pyvene_causaltrace.attribution.export import node_id


def node_ids(graph) -> list[str]:
    """Every node's exported id, in node order (small graphs)."""
    return [node_id(graph, i) for i in range(graph.layout.n_nodes)]
