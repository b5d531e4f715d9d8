"""Figures of a :class:`~pyvene_causaltrace.dataset.results.DatasetResult` (matplotlib, Agg)."""

from __future__ import annotations

import numpy as np

_KIND_CMAPS = {"residual": "Purples", "mlp": "Greens", "attn": "Reds"}


def _figure(n_panels: int, width: float, height: float):
    import matplotlib  # matplotlib loads only when a figure is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # matplotlib loads only when a figure is drawn

    fig, axes = plt.subplots(1, n_panels, figsize=(width * n_panels, height), squeeze=False)
    return plt, fig, axes[0]


def plot_role_heatmaps(result, path: str | None = None):
    """One heatmap per kind: rows are roles (those some fact has), columns layers; a row's peak is
    outlined when it reaches a tenth of the panel's largest value (flat rows have no site)."""
    plt, fig, axes = _figure(len(result.kinds), 5.0, 3.2)
    for ax, kind in zip(axes, result.kinds, strict=True):
        rows = [r for r, _ in enumerate(result.roles) if result.n_facts[kind][r] > 0]
        grid = np.array([result.aie[kind][r] for r in rows], dtype=float)
        image = ax.imshow(grid, aspect="auto", cmap=_KIND_CMAPS.get(kind, "Blues"),
                          interpolation="nearest")
        ax.set_yticks(range(len(rows)), [result.roles[r] for r in rows], fontsize=7)
        ax.set_xlabel("layer")
        n = result.effects[kind]["n_facts"]
        ax.set_title(f"{kind}: AIE over {n} facts", fontsize=9)
        top = np.nanmax(grid) if not np.isnan(grid).all() else 0.0
        for i, row in enumerate(grid):
            if not np.isnan(row).all() and np.nanmax(row) >= 0.1 * top > 0:
                j = int(np.nanargmax(row))
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=0.8,
                                           color="black"))
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=150)
        plt.close(fig)
    return fig


def plot_role_curves(result, path: str | None = None,
                     roles: tuple[str, ...] = ("Last subject token", "Last token")):
    """AIE against layer for ``roles``, a panel per kind, bands = the bootstrap interval."""
    plt, fig, axes = _figure(len(result.kinds), 4.2, 3.0)
    layers = np.arange(result.n_layers)
    for ax, kind in zip(axes, result.kinds, strict=True):
        for role in roles:
            r = result.roles.index(role)
            if result.n_facts[kind][r] == 0:
                continue
            ax.plot(layers, result.aie[kind][r], label=role)
            ax.fill_between(layers, result.ci_low[kind][r], result.ci_high[kind][r], alpha=0.25)
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("AIE (P gap)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=150)
        plt.close(fig)
    return fig
