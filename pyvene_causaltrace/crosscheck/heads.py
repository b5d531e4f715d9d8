"""Which heads carry the fact: the graph's head loadings beside the per-head trace.

The graph's side of a head is its loading (:func:`~..attribution.heads.head_loadings`) summed
over the sources at the subject's positions (``subject``) or all (``all``); the trace's, its
indirect effect restored alone at the last position (:meth:`~..tracing.tracer.Tracer.trace_heads`).
Different questions, so compared by rank (:func:`compare_heads`).

    section = head_section(graph, tracer, transcoder, layers=[0, 1, 2])
    section["stats"]["subject"]["spearman"]"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..attribution.heads import head_loadings
from ..tracing.head_restore import check_layers
from ..transcoders.transcoder import Transcoder
from .sites import pearson, spearman

if TYPE_CHECKING:  # annotations only
    from ..attribution.graph import AttributionGraph
    from ..attribution.heads import HeadLoadings
    from ..tracing.tracer import Tracer

#: Loadings summed over the sources at the subject's positions, or over every source.
HEAD_PARTS = ("subject", "all")


def source_positions(graph: AttributionGraph) -> torch.Tensor:
    """``[n_sources]`` long: the prompt position of each source node (features, errors,
    steering, tokens), in the graph's node order."""
    lay = graph.layout
    return torch.tensor([graph.coordinates(i, graph.node_kind(i))[1]
                         for i in range(lay.logits.start)], dtype=torch.long)


def loading_grids(loadings: HeadLoadings, graph: AttributionGraph,
                  subject_range: tuple[int, int]) -> dict[str, np.ndarray]:
    """Per part of :data:`HEAD_PARTS`, ``[len(layers), n_heads]`` float64: each head's part
    of the target's edges, summed over the part's source nodes."""
    start, stop = subject_range
    positions = source_positions(graph)
    subject = (positions >= start) & (positions < stop)
    parts = loadings.parts.double()
    return {"subject": parts[:, :, subject].sum(-1).numpy(), "all": parts.sum(-1).numpy()}


def compare_heads(loading: np.ndarray, effect: np.ndarray) -> dict[str, Any]:
    """Spearman and Pearson over every (layer, head), and Spearman within each layer
    (``per_layer``, in the rows' order), of two ``[layers, heads]`` grids."""
    return {"spearman": spearman(loading, effect), "pearson": pearson(loading, effect),
            "per_layer": [spearman(a, b) for a, b in zip(loading, effect, strict=True)],
            "n_heads": int(loading.size)}


def head_section(graph: AttributionGraph, tracer: Tracer, transcoder: Transcoder,
                 layers: int | Sequence[int] | None = None) -> dict[str, Any]:
    """The ``heads`` section of a cross-check (module docstring): the layers and position,
    the target, the loadings and mean indirect effects ``[layer][head]``, and their
    statistics per part."""
    chosen = check_layers(layers, tracer.engine.n_layers)
    loadings = head_loadings(tracer.bound, transcoder, graph, layers=chosen)
    trace = tracer.trace_heads(chosen, progress=False)
    effects = trace.grid("ie")
    grids = loading_grids(loadings, graph, tuple(tracer.prompt.subject_range))
    return {"layers": chosen, "n_heads": trace.n_heads, "position": trace.position,
            "target": loadings.target_label,
            "loadings": {part: grid.tolist() for part, grid in grids.items()},
            "effects": effects.tolist(),
            "stats": {part: compare_heads(grid, effects) for part, grid in grids.items()}}


__all__ = ["HEAD_PARTS", "compare_heads", "head_section", "loading_grids", "source_positions"]
