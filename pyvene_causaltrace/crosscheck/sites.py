"""Where the graph and the trace put the fact: per (layer, position) cell, side by side.

The graph's side of a cell is the influence of the nodes of that MLP sublayer there (its
transcoder features and error node); the trace's is the indirect effect (``restored -
corrupt``, mean over seeds) of restoring the residual stream or MLP output there. They answer
different questions, so they are compared by rank, over the cells a restore can change (from
the subject's first token on: :func:`reachable_cells`); the heat maps show every cell."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from ..arguments import checked
from ..errors import InputError

if TYPE_CHECKING:  # annotations only (an import cycle otherwise)
    from ..attribution.graph import AttributionGraph

#: Graph grids: the MLP sublayer's features, its error, or both.
SITE_PARTS = ("all", "features", "errors")


@checked
def site_influence(graph: AttributionGraph, part: str = "all", *,
                   share: bool = False) -> np.ndarray:
    """``[n_layers, n_pos]`` float64: the influence of ``graph``'s nodes at each (layer,
    position) — its features (``"features"``), its error node (``"errors"``) or both
    (``"all"``). ``share``: divided by the influence of every source node (features, errors,
    steering and tokens), so grids of different prompts can be averaged."""
    if part not in SITE_PARTS:
        raise InputError(f"part must be one of {', '.join(SITE_PARTS)}, got {part!r}")
    lay, n_pos = graph.layout, graph.n_pos
    influence = graph.influence().double()
    grid = torch.zeros(graph.n_layers * n_pos, dtype=torch.float64)
    if part in ("all", "features"):
        cell = graph.feature_layer.long() * n_pos + graph.feature_position.long()
        grid.index_add_(0, cell, influence[:lay.n_features])
    if part in ("all", "errors"):
        grid += influence[lay.errors]
    if share:
        total = float(influence[:lay.logits.start].sum())
        grid = grid / total if total > 0 else grid
    return grid.view(graph.n_layers, n_pos).numpy()


def window_sum(grid: np.ndarray, layers_of: Sequence[Sequence[int]]) -> np.ndarray:
    """``grid`` summed, for each layer ``l``, over the layers ``layers_of[l]`` (the layers a
    windowed trace restores when centred on ``l``), so both sides cover the same sublayers."""
    return np.stack([grid[list(layers)].sum(0) for layers in layers_of])


@checked
def reachable_cells(n_layers: int, n_pos: int, subject_start: int) -> np.ndarray:
    """``[n_layers, n_pos]`` bool: the cells a restore can change, from the subject's first
    token on (before it, the noised run equals the clean one)."""
    mask = np.zeros((n_layers, n_pos), dtype=bool)
    mask[:, subject_start:] = True
    return mask


@checked
def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two equal-length arrays (average ranks for ties; NaN
    when either is constant)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise InputError(f"spearman of {a.shape} and {b.shape} values")
    if len(a) < 2:
        return float("nan")
    return float(pd.Series(a).corr(pd.Series(b), method="spearman"))


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's correlation (NaN when either is constant or there are fewer than 2)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def top_cells(grid: np.ndarray, k: int, mask: np.ndarray | None = None) -> list[tuple[int, int]]:
    """The ``k`` cells of largest value (among ``mask``), largest first, as (layer, position);
    ties broken by cell order."""
    values = np.where(mask, grid, -np.inf) if mask is not None else grid
    flat = np.argsort(-values.ravel(), kind="stable")
    n = int(mask.sum()) if mask is not None else values.size
    return [tuple(int(i) for i in np.unravel_index(int(j), grid.shape)) for j in flat[:min(k, n)]]


def top_k_overlap(top_a: list[tuple[int, int]], top_b: list[tuple[int, int]]) -> float:
    """Share of one grid's top cells ``top_a`` that are among the other's ``top_b`` (each
    :func:`top_cells`); NaN when ``top_a`` is empty."""
    if not top_a:
        return float("nan")
    return len(set(top_a) & set(top_b)) / len(top_a)


@checked
def compare_grids(graph_grid: np.ndarray, trace_grid: np.ndarray, mask: np.ndarray,
                  k: int) -> dict:
    """Spearman and Pearson over the ``mask`` cells, and the top-``k`` overlap; each side's
    top-``k`` cells."""
    if graph_grid.shape != trace_grid.shape:
        raise InputError(f"the graph's grid is {graph_grid.shape}, the trace's "
                         f"{trace_grid.shape}: not the same prompt and model")
    graph_top, trace_top = top_cells(graph_grid, k, mask), top_cells(trace_grid, k, mask)
    return {"spearman": spearman(graph_grid[mask], trace_grid[mask]),
            "pearson": pearson(graph_grid[mask], trace_grid[mask]),
            "top_k": k, "top_k_overlap": top_k_overlap(graph_top, trace_top),
            "graph_top": [list(c) for c in graph_top],
            "trace_top": [list(c) for c in trace_top],
            "n_cells": int(mask.sum())}
