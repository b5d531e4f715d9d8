"""Reading a graph: influence, pruning and scores, with circuit-tracer's semantics, from the
sparse rows of a :class:`~.store.RowStore`, never an ``N x N`` matrix. ``A[t, s]`` is source
``s``'s direct effect on target ``t`` (:mod:`.graph`'s node order), nonzero only in stored rows.

- influence: ``w @ (N + N^2 + ...)``, ``N`` = ``|A|`` with rows scaled to sum to 1, ``w`` the
  logit weights; run on the rows x row-nodes part, then spread to every column in one pass; it
  ends within ``n_layers + 2`` terms (the graph is acyclic).
- :func:`prune`: the nodes carrying ``node_threshold`` of cumulative influence (tokens and
  logits always), then the edges carrying ``edge_threshold`` of cumulative edge score
  ``N_kept[t, s] * (influence_kept[t] + w[t])``, then nodes left without edges dropped.
- :func:`graph_scores`: replacement score (input influence / (input + error influence); inputs
  are tokens and steering nodes) and completeness score.

:func:`threshold_for` finds a threshold from a histogram of the scores' float bits, sorting one
bucket (circuit-tracer sorts all ``n^2`` scores, its OOM at ~63k nodes)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..errors import InputError
from .store import RowStore


@dataclass(frozen=True)
class Layout:
    """How many nodes of each kind, in order: features, errors, steering, tokens, logits.

    Steering nodes (the constants of a user's pyvene interventions) are leaves like errors:
    never given a row, pruned like errors (kept only while they feed a kept node)."""

    n_features: int
    n_errors: int
    n_tokens: int
    n_logits: int = 1
    n_steering: int = 0

    @property
    def n_nodes(self) -> int:
        return self.n_features + self.n_errors + self.n_steering + self.n_tokens + self.n_logits

    @property
    def errors(self) -> slice:
        return slice(self.n_features, self.n_features + self.n_errors)

    @property
    def steering(self) -> slice:
        start = self.n_features + self.n_errors
        return slice(start, start + self.n_steering)

    @property
    def tokens(self) -> slice:
        start = self.n_features + self.n_errors + self.n_steering
        return slice(start, start + self.n_tokens)

    @property
    def logits(self) -> slice:
        return slice(self.n_nodes - self.n_logits, self.n_nodes)


def logit_weights(layout: Layout, probabilities: torch.Tensor) -> torch.Tensor:
    """``[n_nodes]`` float64: ``probabilities``, each logit node's weight (its probability; 1
    for a single target), on the logit nodes, 0 elsewhere."""
    weights = torch.zeros(layout.n_nodes, dtype=torch.float64)
    weights[layout.logits] = probabilities.double()
    return weights


# ------------------------------------------------------------------------- influence


def _kept_entries(store: RowStore, keep: torch.Tensor | None):
    """Chunks of ``(row, column, |value|)``, restricted to entries whose row node and column
    are both kept when ``keep`` (a node mask) is given."""
    nodes = store.nodes
    for rows, cols, values in store.chunks():
        weight = values.abs()
        if keep is not None:
            mask = keep[nodes[rows]] & keep[cols]
            rows, cols, weight = rows[mask], cols[mask], weight[mask]
        yield rows, cols, weight


def row_denominators(store: RowStore, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_s |A[r, s]|`` per row over kept entries (all: memoised in the store)."""
    if keep is None:
        return store.abs_sums()
    out = torch.zeros(store.n_rows, dtype=torch.float64)
    for rows, _, weight in _kept_entries(store, keep):
        out.index_add_(0, rows, weight.double())
    return out


def influence(store: RowStore, weights: torch.Tensor, keep: torch.Tensor | None = None,
              max_iter: int = 1000) -> torch.Tensor:
    """``weights @ (N + N^2 + ...)`` over all ``len(weights)`` nodes (module docstring); with
    ``keep``, of the graph restricted to the kept nodes. Raises if the series has not ended
    after ``max_iter`` terms (a cycle: not an attribution graph)."""
    n_nodes = len(weights)
    nodes = store.nodes
    scale = 1.0 / row_denominators(store, keep).clamp(min=1e-10)
    row_of_node = store.row_of_node(n_nodes)
    targets, sources, links = [], [], []  # the rows x row-nodes part of N
    for rows, cols, weight in _kept_entries(store, keep):
        source_row = row_of_node[cols]
        inner = source_row >= 0
        targets.append(rows[inner])
        sources.append(source_row[inner])
        links.append(weight[inner].double() * scale[rows[inner]])
    targets, sources = torch.cat(targets or [torch.zeros(0, dtype=torch.long)]), \
        torch.cat(sources or [torch.zeros(0, dtype=torch.long)])
    links = torch.cat(links or [torch.zeros(0, dtype=torch.float64)])
    current = weights.double()[nodes]
    reach = current.clone()  # sum over k >= 0 of the k-th term, on the row nodes
    for _ in range(max_iter):
        current = torch.zeros_like(current).index_add_(0, sources, links * current[targets])
        if not current.any():
            break
        reach += current
    else:
        raise RuntimeError(f"influence did not converge after {max_iter} iterations")
    spread = scale * reach
    out = torch.zeros(n_nodes, dtype=torch.float64)
    for rows, cols, weight in _kept_entries(store, keep):
        out.index_add_(0, cols, weight.double() * spread[rows])
    return out


# ------------------------------------------------------------------------ thresholds

_SHIFT = 12  # histogram buckets: float32 bit patterns >> 12 (relative width ~5e-4)


def threshold_for(chunks: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
                  fraction: float) -> float:
    """The smallest score among the top scores that together carry ``fraction`` of the total,
    as sorting every score and cumulating in float64 would give (clamped to the smallest nonzero
    score: ``fraction=1`` keeps every nonzero one; ``inf`` when all are zero). ``chunks``: the
    nonnegative scores as a tensor, a list of them, or a callable yielding them afresh (called
    twice), so scores need never be held at once."""
    if not 0.0 <= fraction <= 1.0:
        raise InputError(f"a threshold is a fraction in [0, 1], got {fraction}")
    if isinstance(chunks, torch.Tensor):
        chunks = [chunks]
    fresh = chunks if callable(chunks) else (lambda: chunks)
    n_buckets = (0x7F800000 >> _SHIFT) + 1
    sums = torch.zeros(n_buckets, dtype=torch.float64)
    smallest = float("inf")
    for scores in fresh():
        positive = scores.detach().reshape(-1).float()
        positive = positive[positive > 0]
        if positive.numel() == 0:
            continue
        smallest = min(smallest, float(positive.min()))
        keys = positive.view(torch.int32).long() >> _SHIFT
        sums += torch.bincount(keys, weights=positive.double(), minlength=n_buckets)
    total = float(sums.sum())
    if total <= 0:
        return float("inf")
    if fraction >= 1.0:
        return smallest
    goal = fraction * total
    at_or_above = sums.flip(0).cumsum(0).flip(0)  # sum of buckets >= k
    crossing = ((at_or_above >= goal) & (sums > 0)).nonzero()
    if crossing.numel() == 0:
        return smallest
    bucket = int(crossing.max())
    above = float(at_or_above[bucket] - sums[bucket])
    members = []
    for scores in fresh():
        values = scores.detach().reshape(-1).float()
        values = values[values > 0]
        members.append(values[(values.view(torch.int32).long() >> _SHIFT) == bucket])
    ordered = torch.cat(members).sort(descending=True).values
    cumulative = (above + ordered.double().cumsum(0)) / total
    index = int(torch.searchsorted(cumulative, torch.tensor([fraction], dtype=torch.float64)))
    return float(ordered[index]) if index < len(ordered) else smallest


# --------------------------------------------------------------------------- pruning


@dataclass
class PruneResult:
    """The pruned graph: a node mask, the kept edges (target node, source node, signed weight,
    and the edge score pruning ranked them by) and each node's cumulative influence share
    (circuit-tracer's exported ``influence``: smaller = more important)."""

    node_mask: torch.Tensor
    edge_target: torch.Tensor
    edge_source: torch.Tensor
    edge_weight: torch.Tensor
    edge_score: torch.Tensor
    cumulative_scores: torch.Tensor

    @property
    def n_nodes(self) -> int:
        return int(self.node_mask.sum())

    @property
    def n_edges(self) -> int:
        return int(self.edge_target.numel())


def prune(store: RowStore, layout: Layout, node_threshold: float, edge_threshold: float,
          probabilities: torch.Tensor, node_influence: torch.Tensor) -> PruneResult:
    """Prune as circuit-tracer's ``prune_graph`` does (module docstring; the thresholds'
    defaults are :class:`~.settings.ReadingSettings`'), given the logit nodes' weights
    ``probabilities`` and the unpruned graph's ``node_influence``."""
    weights = logit_weights(layout, probabilities)
    # thresholds are float32 values: compare float32 scores with them
    node_mask = node_influence.float() >= threshold_for(node_influence, node_threshold)
    node_mask[layout.tokens.start:] = True  # tokens and logits always stay
    kept_influence = influence(store, weights, keep=node_mask)
    scale = 1.0 / row_denominators(store, node_mask).clamp(min=1e-10)
    row_weight = scale * (kept_influence + weights)[store.nodes]

    def scores():
        for rows, _, weight in _kept_entries(store, node_mask):
            yield (weight.double() * row_weight[rows]).float()

    cut = threshold_for(scores, edge_threshold)
    nodes = store.nodes
    targets, sources, values, edge_scores = [], [], [], []
    for rows, cols, value in store.chunks():
        score = (value.abs().double() * row_weight[rows]).float()
        keep = node_mask[nodes[rows]] & node_mask[cols] & (score >= cut) & (score > 0)
        targets.append(nodes[rows[keep]])
        sources.append(cols[keep])
        values.append(value[keep])
        edge_scores.append(score[keep])
    target = torch.cat(targets or [torch.zeros(0, dtype=torch.long)])
    source = torch.cat(sources or [torch.zeros(0, dtype=torch.long)])
    weight = torch.cat(values or [torch.zeros(0)])
    edge_score = torch.cat(edge_scores or [torch.zeros(0)])
    n_inner = layout.tokens.start  # features, errors and steering
    while True:
        before = node_mask.clone()
        alive = node_mask[target] & node_mask[source]
        target, source = target[alive], source[alive]
        weight, edge_score = weight[alive], edge_score[alive]
        feeds = torch.zeros_like(node_mask)
        feeds[source] = True
        fed = torch.zeros_like(node_mask)
        fed[target] = True
        node_mask[:n_inner] &= feeds[:n_inner]  # must feed something kept
        node_mask[:layout.n_features] &= fed[:layout.n_features]  # and be fed
        if torch.equal(before, node_mask):
            break
    order = torch.sort(node_influence, descending=True)
    cumulative = torch.empty_like(node_influence)
    total = order.values.sum().clamp(min=1e-30)
    cumulative[order.indices] = torch.cumsum(order.values, 0) / total
    return PruneResult(node_mask, target, source, weight, edge_score, cumulative)


def graph_scores(store: RowStore, layout: Layout, probabilities: torch.Tensor,
                 node_influence: torch.Tensor) -> dict[str, float]:
    """circuit-tracer's replacement and completeness scores of the unpruned graph (arguments as
    :func:`prune`'s)."""
    weights = logit_weights(layout, probabilities)
    token = node_influence[layout.tokens].sum() + node_influence[layout.steering].sum()
    error = node_influence[layout.errors].sum()
    is_error = torch.zeros(layout.n_nodes, dtype=torch.bool)
    is_error[layout.errors] = True
    error_share = torch.zeros(store.n_rows, dtype=torch.float64)
    for rows, cols, weight in _kept_entries(store, None):
        keep = is_error[cols]
        error_share.index_add_(0, rows[keep], weight[keep].double())
    error_share /= row_denominators(store).clamp(min=1e-10)
    output = node_influence + weights
    incomplete = (error_share * output[store.nodes]).sum()
    return {"replacement": float(token / (token + error).clamp(min=1e-30)),
            "completeness": float((output.sum() - incomplete) / output.sum())}
