"""A static picture of the pruned attribution graph (matplotlib is imported inside): positions
across, layers up (tokens at the bottom, the target logit at the top), features as circles,
errors as squares, steering nodes as diamonds, edges by |weight| (blue positive, red negative).
The ``max_nodes`` most influential feature and error nodes are drawn (with every token and the
target), and the strongest ``max_edges`` edges among them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from .settings import ReadingSettings


def subplots(*args, **kwargs):
    """``plt.subplots(...)`` with the Agg backend chosen first (matplotlib loads here, only when
    a figure is drawn)."""
    import matplotlib  # matplotlib loads only when a figure is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # after the backend is chosen

    return plt.subplots(*args, **kwargs)


def finish(fig, path: str | Path | None, **savefig):
    """``fig`` laid out tight, and saved to ``path`` when given (``savefig``: its options)."""
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, **savefig)
    return fig


def _positions(graph, keep) -> dict[int, tuple[float, float]]:
    cells: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in keep:
        kind = graph.node_kind(i)
        layer, pos, _, _ = graph.coordinates(i, kind)
        row = {"token": -1, "logit": graph.n_layers}.get(kind, layer)
        cells[(row, pos)].append(i)
    xy = {}
    for (row, pos), members in cells.items():
        width = min(0.8, 0.12 * (len(members) - 1))
        for j, i in enumerate(sorted(members)):
            offset = 0.0 if len(members) == 1 else -width / 2 + width * j / (len(members) - 1)
            xy[i] = (pos + offset, row)
    return xy


def plot_graph(graph, path: str | Path | None = None,
               node_threshold: float = ReadingSettings.node_threshold,
               edge_threshold: float = ReadingSettings.edge_threshold, max_nodes: int = 60,
               max_edges: int = 300, *, settings: ReadingSettings | None = None):
    """Figure of ``graph`` pruned at the thresholds (or ``settings``, a
    :class:`~.settings.ReadingSettings`; module docstring); saved to ``path`` when given.
    Returns the figure."""
    pruned = graph.prune(settings=ReadingSettings.merged(
        settings, node_threshold=node_threshold, edge_threshold=edge_threshold))
    lay = graph.layout
    influence = graph.influence()
    inner = pruned.node_mask.clone()
    inner[lay.tokens.start:] = False
    ranked = (influence * inner).argsort(descending=True)[:int(inner.sum())][:max_nodes]
    shown = torch.zeros_like(inner)
    shown[ranked] = True
    shown[lay.tokens.start:] = True
    drawn = shown[pruned.edge_target] & shown[pruned.edge_source]
    target, source = pruned.edge_target[drawn], pruned.edge_source[drawn]
    weights = pruned.edge_weight[drawn]
    order = weights.abs().argsort(descending=True)[:max_edges]
    keep = sorted(set(target[order].tolist()) | set(source[order].tolist())
                  | set(range(lay.tokens.start, lay.n_nodes)))
    xy = _positions(graph, keep)
    fig, ax = subplots(figsize=(max(6.0, graph.n_pos * 1.1),
                                    max(5.0, graph.n_layers * 0.3 + 2)), dpi=100)
    top = float(weights.abs().max()) if len(weights) else 1.0
    for k in reversed(order.tolist()):
        t, s, w = int(target[k]), int(source[k]), float(weights[k])
        (x0, y0), (x1, y1) = xy[s], xy[t]
        strength = abs(w) / top
        ax.plot([x0, x1], [y0, y1], color="tab:blue" if w > 0 else "tab:red",
                linewidth=0.3 + 2.5 * strength, alpha=0.15 + 0.75 * strength, zorder=1)
    style = {"feature": ("o", "tab:orange"), "error": ("s", "0.55"),
             "lorsa": ("o", "tab:cyan"), "lorsa error": ("s", "0.75"),
             "steering": ("D", "tab:purple"), "token": ("^", "black"),
             "logit": ("*", "tab:green")}
    for kind, (marker, colour) in style.items():
        points = [xy[i] for i in keep if graph.node_kind(i) == kind]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, marker=marker, s=60 if kind == "logit" else 22, c=colour,
                       label=kind, zorder=2, edgecolors="none")
    ax.set_xticks(range(graph.n_pos))
    ax.set_xticklabels([repr(t) for t in graph.tokens], rotation=45, ha="right", fontsize=8)
    layers = range(0, graph.n_layers, max(1, graph.n_layers // 8))
    ax.set_yticks([-1, *layers, graph.n_layers], ["emb", *map(str, layers), "logit"])
    ax.set_ylabel("layer")
    more = f" (+{graph.n_logits - 1} more logits)" if graph.n_logits > 1 else ""
    ax.set_title(f"{graph.prompt!r} -> {graph.answer!r}{more}: pruned graph "
                 f"{pruned.n_nodes} nodes, {pruned.n_edges} edges; "
                 f"drawn {len(keep)} nodes, {len(order)} edges", fontsize=9)
    ax.legend(loc="upper left", fontsize=7, frameon=False)
    return finish(fig, path)
