"""Pictures of traces (matplotlib is imported inside the functions: importing the result types
that draw with them stays light)."""

from __future__ import annotations

_CMAPS = {"residual": "Purples", "mlp": "Greens", "attn": "Reds",
          "severed-mlp": "Purples", "severed-attn": "Purples"}


def _axes(ax, width: float, height: float):
    """``(figure, ax)``: ``ax``'s, or a new ``width`` x ``height`` figure (Agg unless a backend
    is set)."""
    if ax is not None:
        return ax.figure, ax
    import matplotlib  # matplotlib loads only when a figure is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # matplotlib loads only when a figure is drawn

    return plt.subplots(figsize=(width, height), dpi=150)


def plot_trace(result, path: str | None = None, value: str = "prob", ax=None):
    """ROME-style heatmap of a :class:`~.results.TraceResult`: tokens down, layers across,
    subject tokens marked ``*``; ``value="prob"`` colours from the mean corrupted probability up,
    ``"recovery"`` from 0. Saves to ``path`` if given; returns the figure."""
    grid = result.grid(value).T  # [position, layer]
    floor = float(result.corrupt_probs.mean()) if value == "prob" else 0.0
    fig, ax = _axes(ax, max(4.0, result.n_layers * 0.22 + 2), len(result.tokens) * 0.32 + 1.2)
    image = ax.pcolor(grid, cmap=_CMAPS.get(result.kind, "Purples"), vmin=floor)
    ax.invert_yaxis()
    start, stop = result.subject_range
    ax.set_yticks([t + 0.5 for t in range(len(result.tokens))])
    ax.set_yticklabels([repr(tok) + (" *" if start <= t < stop else "")
                        for t, tok in enumerate(result.tokens)])
    step = max(1, result.n_layers // 10)
    ax.set_xticks([layer + 0.5 for layer in range(0, result.n_layers, step)])
    ax.set_xticklabels(list(range(0, result.n_layers, step)))
    what = {"residual": "single restored layer", "severed-mlp": "restored layer (MLPs severed)",
            "severed-attn": "restored layer (attention severed)"}.get(
        result.kind, f"centre of {result.window}-layer {result.kind} window")
    ax.set_xlabel(what)
    ax.set_title(f"{result.kind}: clean P({result.answer!r}) = {result.clean_prob:.3f}, "
                 f"corrupted {result.corrupt_probs.mean():.3f}", fontsize=9)
    bar = fig.colorbar(image, ax=ax)
    bar.set_label(f"mean restored P({result.answer!r})" if value == "prob" else "mean recovery")
    if path is not None:
        fig.savefig(path, bbox_inches="tight")
    return fig


def plot_head_trace(result, path: str | None = None, value: str = "ie", ax=None):
    """Heat map of a :class:`~.results.HeadTraceResult`: layers down, heads across, the mean
    over seeds of ``value`` (``"ie"``, ``"recovery"`` or ``"prob"``). Saves to ``path`` if given;
    returns the figure."""
    grid = result.grid(value)  # [layer, head]
    fig, ax = _axes(ax, max(4.0, result.n_heads * 0.45 + 2), len(result.layers) * 0.32 + 1.4)
    if value == "prob":
        image = ax.pcolor(grid, cmap="Reds", vmin=float(result.corrupt_probs.mean()))
    else:
        limit = float(abs(grid).max()) or 1.0
        image = ax.pcolor(grid, cmap="RdBu_r", vmin=-limit, vmax=limit)
    ax.invert_yaxis()
    ax.set_yticks([i + 0.5 for i in range(len(result.layers))])
    ax.set_yticklabels([str(layer) for layer in result.layers])
    ax.set_xticks([h + 0.5 for h in range(result.n_heads)])
    ax.set_xticklabels([str(h) for h in range(result.n_heads)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"heads restored at {result.tokens[result.position]!r}: clean "
                 f"P({result.answer!r}) = {result.clean_prob:.3f}, corrupted "
                 f"{result.corrupt_probs.mean():.3f}", fontsize=9)
    bar = fig.colorbar(image, ax=ax)
    bar.set_label({"ie": "mean indirect effect", "recovery": "mean recovery",
                   "prob": f"mean restored P({result.answer!r})"}[value])
    if path is not None:
        fig.savefig(path, bbox_inches="tight")
    return fig
