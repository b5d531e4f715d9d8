"""The cross-check figure: the graph's and the trace's cells side by side, on the same axes,
and the features' predicted against measured effects (matplotlib loads only when drawing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_CMAPS = {"graph": "Blues", "residual": "Purples", "mlp": "Greens"}


def _heatmap(ax, grid: np.ndarray, tokens: list[str], subject: tuple[int, int], title: str,
             cmap: str, label: str, fig) -> None:
    image = ax.pcolor(grid.T, cmap=cmap)
    ax.invert_yaxis()
    start, stop = subject
    ax.set_yticks([t + 0.5 for t in range(len(tokens))])
    ax.set_yticklabels([repr(tok) + (" *" if start <= t < stop else "")
                        for t, tok in enumerate(tokens)], fontsize=7)
    n_layers = grid.shape[0]
    step = max(1, n_layers // 10)
    ax.set_xticks([layer + 0.5 for layer in range(0, n_layers, step)])
    ax.set_xticklabels(list(range(0, n_layers, step)), fontsize=7)
    ax.set_xlabel("layer")
    ax.set_title(title, fontsize=8)
    fig.colorbar(image, ax=ax).set_label(label, fontsize=7)


def plot_cross_check(result, path: str | Path | None = None):
    """Top row: the graph's influence share per cell (features + errors), then each trace's
    indirect effect, same axes; bottom: predicted vs measured effect of each checked feature
    on the target, one panel per mode, sign disagreements in red. Saved to ``path`` if
    given; returns the figure."""
    import matplotlib  # matplotlib loads only when a figure is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # matplotlib loads only when a figure is drawn

    kinds = list(result.trace_grids)
    modes = list(result.feature_stats)
    n_top = 1 + len(kinds)
    height = len(result.tokens) * 0.3 + 1.6
    rows = 2 if modes else 1
    fig = plt.figure(figsize=(4.6 * n_top, height + (3.6 if modes else 0)), dpi=130)
    grid_spec = fig.add_gridspec(rows, max(n_top, len(modes)),
                                 height_ratios=[height, 3.6][:rows])
    subject = tuple(result.subject_range)
    ax = fig.add_subplot(grid_spec[0, 0])
    _heatmap(ax, np.asarray(result.graph_grids["all"]), result.tokens, subject,
             "graph: influence share of features + error", _CMAPS["graph"], "influence share", fig)
    for i, kind in enumerate(kinds):
        stats = result.sites[kind]["all"]
        window = result.windows.get(kind)
        what = kind if not window or kind == "residual" else f"{kind} (window {window})"
        ax = fig.add_subplot(grid_spec[0, i + 1])
        rho = stats["spearman"]
        rho = "n/a" if rho is None or rho != rho else f"{rho:+.2f}"
        _heatmap(ax, np.asarray(result.trace_grids[kind]), result.tokens, subject,
                 f"trace: {what} indirect effect\nSpearman with graph {rho}, top-"
                 f"{stats['top_k']} overlap {stats['top_k_overlap']:.2f}",
                 _CMAPS.get(kind, "Purples"), f"restored - corrupt P({result.answer!r})", fig)
    for j, mode in enumerate(modes):
        ax = fig.add_subplot(grid_spec[1, j])
        predicted = np.array([f["predicted_mean"] for f in result.features])
        measured = np.array([f["modes"][mode]["measured_mean"] for f in result.features])
        flagged = np.array([f["modes"][mode].get("sign_disagrees", False)
                            for f in result.features], dtype=bool)
        ax.scatter(predicted[~flagged], measured[~flagged], s=14, color="tab:blue",
                   label="same sign")
        if flagged.any():
            ax.scatter(predicted[flagged], measured[flagged], s=18, color="tab:red",
                       label="sign disagrees")
        span = float(max(np.abs(predicted).max(), np.abs(measured).max(), 1e-12))
        ax.plot([-span, span], [-span, span], color="grey", lw=0.8, ls="--")
        ax.axhline(0, color="lightgrey", lw=0.6)
        ax.axvline(0, color="lightgrey", lw=0.6)
        stats = result.feature_stats[mode]
        r = stats["pearson"]
        r = "n/a" if r is None or r != r else f"{r:+.2f}"
        ax.set_title(f"top {len(predicted)} features, {mode} model: Pearson {r}", fontsize=8)
        ax.set_xlabel("attribution: activation change x total effect", fontsize=7)
        ax.set_ylabel("patch: change in the target", fontsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, bbox_inches="tight")
    return fig
