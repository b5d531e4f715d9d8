"""The dense reference for reading a graph: the square ``[N, N]`` adjacency and the
influence / pruning / scores functions the package had before its sparse row store (float64
cumulative sums in thresholds, as the sparse path). Small graphs only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyvene_causaltrace.attribution.reading import Layout


def square(graph) -> torch.Tensor:
    """``[N, N]`` adjacency over all nodes (rows = targets; nodes without a row empty)."""
    n = graph.layout.n_nodes
    full = torch.zeros(n, n, dtype=graph.rows.blocks[0].values.dtype)
    rows = graph.rows.dense(torch.arange(graph.rows.n_rows))
    full[graph.rows.nodes, :graph.layout.logits.start] = rows
    return full


def edge_mask(pruned) -> torch.Tensor:
    """Dense ``[N, N]`` boolean mask of a sparse :class:`~pyvene_causaltrace.attribution.reading.
    PruneResult`'s kept edges (rows = targets), to compare with the dense reference's."""
    n = len(pruned.node_mask)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[pruned.edge_target, pruned.edge_source] = True
    return mask


def normalize_matrix(matrix: torch.Tensor) -> torch.Tensor:
    """``|A|`` with each row divided by its sum (rows of zeros stay zero)."""
    normalized = matrix.abs()
    return normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)


def compute_influence(normalized: torch.Tensor, weights: torch.Tensor,
                      max_iter: int = 1000) -> torch.Tensor:
    """``weights @ (A + A^2 + ...)``; raises if the series has not ended after ``max_iter``
    terms (a cycle: not an attribution graph)."""
    current = weights @ normalized
    influence = current.clone()
    for _ in range(max_iter):
        if not current.any():
            return influence
        current = current @ normalized
        influence += current
    raise RuntimeError(f"influence did not converge after {max_iter} iterations")


def logit_weights(layout: Layout, probabilities: torch.Tensor | None = None) -> torch.Tensor:
    """Weights on the logit nodes (their probabilities; 1 for a single target)."""
    weights = torch.zeros(layout.n_nodes)
    weights[layout.logits] = 1.0 if probabilities is None else probabilities
    return weights


def node_influence(adjacency: torch.Tensor, layout: Layout,
                   probabilities: torch.Tensor | None = None) -> torch.Tensor:
    """Every node's total (direct and indirect) influence on the weighted logits."""
    weights = logit_weights(layout, probabilities).to(adjacency.dtype)
    return compute_influence(normalize_matrix(adjacency), weights)


def threshold_for(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The smallest score among the top scores that together carry ``fraction`` of the total
    (clamped to the last nonzero score, so ``fraction=1`` never keeps zeros)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"a threshold is a fraction in [0, 1], got {fraction}")
    ordered = torch.sort(scores.flatten(), descending=True).values
    total = ordered.double().sum()
    if total <= 0:
        return torch.tensor(float("inf"))
    last_nonzero = int((ordered > 0).sum()) - 1
    if fraction >= 1.0:
        return ordered[last_nonzero]
    cumulative = torch.cumsum(ordered.double(), 0) / total
    index = int(torch.searchsorted(cumulative, torch.tensor([fraction], dtype=cumulative.dtype)))
    return ordered[min(index, last_nonzero)]


@dataclass
class PruneResult:
    """Boolean node and edge masks, and each node's cumulative influence share (circuit-tracer's
    exported ``influence``: smaller = more important)."""

    node_mask: torch.Tensor
    edge_mask: torch.Tensor
    cumulative_scores: torch.Tensor


def prune(adjacency: torch.Tensor, layout: Layout, node_threshold: float = 0.8,
          edge_threshold: float = 0.98,
          probabilities: torch.Tensor | None = None) -> PruneResult:
    """Prune as circuit-tracer's ``prune_graph`` does (module docstring)."""
    weights = logit_weights(layout, probabilities).to(adjacency.dtype)
    influence = compute_influence(normalize_matrix(adjacency), weights)
    node_mask = influence >= threshold_for(influence, node_threshold)
    node_mask[layout.tokens.start:] = True  # tokens and logits always stay
    pruned = adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_matrix(pruned)
    edge_scores = normalized * (compute_influence(normalized, weights) + weights)[:, None]
    kept = edge_scores[node_mask][:, node_mask]
    edge_mask = edge_scores >= threshold_for(kept, edge_threshold)
    edge_mask &= node_mask[:, None] & node_mask[None, :]
    edge_mask &= edge_scores > 0
    n_inner = layout.tokens.start  # features and errors
    while True:
        before = node_mask.clone()
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[:n_inner] &= edge_mask[:, :n_inner].any(0)  # must feed something kept
        node_mask[:layout.n_features] &= edge_mask[:layout.n_features].any(1)  # and be fed
        if torch.equal(before, node_mask):
            break
    order = torch.sort(influence, descending=True)
    cumulative = torch.empty_like(influence)
    total = order.values.sum().clamp(min=1e-30)
    cumulative[order.indices] = torch.cumsum(order.values, 0) / total
    return PruneResult(node_mask, edge_mask, cumulative)


def graph_scores(adjacency: torch.Tensor, layout: Layout,
                 probabilities: torch.Tensor | None = None) -> dict[str, float]:
    """circuit-tracer's replacement and completeness scores of the unpruned graph."""
    weights = logit_weights(layout, probabilities).to(adjacency.dtype)
    normalized = normalize_matrix(adjacency)
    influence = compute_influence(normalized, weights)
    token = influence[layout.tokens].sum()
    error = influence[layout.errors].sum()
    non_error = 1 - normalized[:, layout.errors].sum(dim=-1)
    output = influence + weights
    return {"replacement": float(token / (token + error).clamp(min=1e-30)),
            "completeness": float((non_error * output).sum() / output.sum())}
