"""Figures of a :class:`~pyvene_causaltrace.dataset.results.DatasetResult` (matplotlib, Agg)."""

from __future__ import annotations

import numpy as np

_KIND_CMAPS = {"residual": "Purples", "mlp": "Greens", "attn": "Reds"}
_GRAPH_CMAP = "Oranges"


def _figure(n_panels: int, width: float, height: float):
    import matplotlib  # matplotlib loads only when a figure is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # matplotlib loads only when a figure is drawn

    fig, axes = plt.subplots(1, n_panels, figsize=(width * n_panels, height), squeeze=False)
    return plt, fig, axes[0]


def _panels(result) -> list[tuple[str, list[int], np.ndarray, str, str]]:
    """The heat maps to draw: (title, role rows, grid [rows, layers], colour map, what the
    colour is), one per kind, then the graphs' "all" influence share when there are graphs."""
    panels = []
    for kind in result.kinds:
        rows = [r for r, _ in enumerate(result.roles) if result.n_facts[kind][r] > 0]
        grid = np.array([result.aie[kind][r] for r in rows], dtype=float)
        n = result.effects[kind]["n_facts"]
        panels.append((f"{kind}: AIE over {n} facts", rows, grid,
                       _KIND_CMAPS.get(kind, "Blues"), "AIE"))
    graphs = result.graphs
    if graphs is not None:
        rows = [r for r, _ in enumerate(result.roles) if graphs["n_role_facts"][r] > 0]
        grid = np.array([graphs["influence"]["all"][r] for r in rows], dtype=float)
        panels.append((f"graph: influence share over {graphs['n_facts']} facts", rows, grid,
                       _GRAPH_CMAP, "share"))
    return panels


def plot_role_heatmaps(result, path: str | None = None):
    """One heatmap per kind: rows are roles (those some fact has), columns layers; a row's peak is
    outlined when it reaches a tenth of the panel's largest value (flat rows have no site). With
    graphs, a last panel of the same shape: the graphs' influence share (MLP features and
    errors) by role and layer."""
    panels = _panels(result)
    plt, fig, axes = _figure(len(panels), 5.0, 3.2)
    for ax, (title, rows, grid, cmap, label) in zip(axes, panels, strict=True):
        image = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_yticks(range(len(rows)), [result.roles[r] for r in rows], fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=9)
        top = np.nanmax(grid) if not np.isnan(grid).all() else 0.0
        for i, row in enumerate(grid):
            if not np.isnan(row).all() and np.nanmax(row) >= 0.1 * top > 0:
                j = int(np.nanargmax(row))
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=0.8,
                                           color="black"))
        fig.colorbar(image, ax=ax, fraction=0.04, label=label)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=150)
        plt.close(fig)
    return fig


def plot_role_curves(result, path: str | None = None,
                     roles: tuple[str, ...] = ("Last subject token", "Last token")):
    """AIE against layer for ``roles``, a panel per kind, bands = the bootstrap interval; with
    graphs, a last panel of the graphs' influence share for the same roles."""
    # (title, y label, mean, low and high [role][layer], facts per role) per panel
    panels = [(kind, "AIE (P gap)", result.aie[kind], result.ci_low[kind], result.ci_high[kind],
               result.n_facts[kind]) for kind in result.kinds]
    graphs = result.graphs
    if graphs is not None:
        panels.append((f"graph: MLP features + errors, {graphs['n_facts']} facts",
                       "influence share", graphs["influence"]["all"], graphs["ci_low"]["all"],
                       graphs["ci_high"]["all"], graphs["n_role_facts"]))
    plt, fig, axes = _figure(len(panels), 4.2, 3.0)
    layers = np.arange(result.n_layers)
    for ax, (title, label, mean, low, high, n_facts) in zip(axes, panels, strict=True):
        for role in roles:
            r = result.roles.index(role)
            if n_facts[r] != 0:
                ax.plot(layers, mean[r], label=role)
                ax.fill_between(layers, low[r], high[r], alpha=0.25)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=150)
        plt.close(fig)
    return fig
