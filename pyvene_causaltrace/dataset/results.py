"""The result of a dataset run: AIE by token role x layer per kind, with intervals, and (in a
run with graphs) the attribution graphs' influence by token role x layer beside it.

Its JSON (``aggregate.json``) is described by ``aggregate.schema.json`` (JSON Schema 2020-12,
shipped with the package: :func:`aggregate_schema`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from ..arguments import checked
from ..strict_json import loads
from ..tracing.results import finite_or_none, package_versions
from .plots import plot_role_curves, plot_role_heatmaps

__all__ = ["DatasetResult", "aggregate_schema"]


def aggregate_schema() -> dict:
    """The JSON Schema of :meth:`DatasetResult.to_json` (``aggregate.json``)."""
    return json.loads(files("pyvene_causaltrace.dataset").joinpath("aggregate.schema.json")
                      .read_text())


@dataclass(frozen=True)
class DatasetResult:
    """Average indirect effects over facts (:mod:`~pyvene_causaltrace.dataset.aggregate`).

    ``aie[kind][role][layer]`` with ``ci_low``/``ci_high`` at ``level``; ``n_facts[kind][role]``;
    ``effects[kind]``: the average total effect (with interval), clean and corrupted P(answer);
    ``screen``: kept and skipped records by reason; ``manifest``: the run's settings; ``graphs``:
    ``None`` without attribution graphs, else :func:`~.graph_aggregate.aggregate_graphs`'."""

    kinds: list[str]
    roles: list[str]
    n_layers: int
    aie: dict[str, list[list[float]]]
    ci_low: dict[str, list[list[float]]]
    ci_high: dict[str, list[list[float]]]
    n_facts: dict[str, list[int]]
    effects: dict[str, dict[str, Any]]
    level: float
    n_boot: int
    screen: dict[str, int]
    manifest: dict[str, Any]
    versions: dict[str, str] = field(default_factory=package_versions)
    graphs: dict[str, Any] | None = None

    def to_dataframe(self):
        """Long form: kind, role, layer, relative depth, aie, ci_low, ci_high, n_facts. A role
        no fact has (no token before the subject in any prompt, one-token subjects' middle)
        has no rows; :attr:`aie` keeps it as NaN, ``to_json`` as ``null``."""
        return self._long_form(["kind", "role", "layer", "depth", "aie", "ci_low", "ci_high",
                                "n_facts"], self.kinds, self.aie, self.ci_low, self.ci_high,
                               self.n_facts)

    def graph_dataframe(self):
        """Long form of the graphs' influence share: part, role, layer, relative depth,
        influence, ci_low, ci_high, n_facts (empty without graphs; no rows for a role no fact
        has, as in :meth:`to_dataframe`)."""
        g = self.graphs or {"parts": [], "influence": {}, "ci_low": {}, "ci_high": {}}
        return self._long_form(["part", "role", "layer", "depth", "influence", "ci_low",
                                "ci_high", "n_facts"], g["parts"], g["influence"], g["ci_low"],
                               g["ci_high"], {part: g["n_role_facts"] for part in g["parts"]})

    def _long_form(self, columns: list[str], names: list[str], grids: dict, low: dict,
                   high: dict, counts: dict):
        """One row per name, role and layer of the ``[role][layer]`` grids, in ``columns``'
        order; none for a role no fact has (``counts[name][role] == 0``)."""
        import pandas as pd  # pandas loads only when a table is asked for

        depth = max(1, self.n_layers - 1)
        rows = [(name, role, layer, layer / depth, grids[name][r][layer], low[name][r][layer],
                 high[name][r][layer], counts[name][r])
                for name in names for r, role in enumerate(self.roles) if counts[name][r] != 0
                for layer in range(self.n_layers)]
        return pd.DataFrame(rows, columns=columns)

    def peaks(self):
        """Peak layer and AIE per kind and role (relative depth = layer / (layers - 1))."""
        import pandas as pd  # pandas loads only when a table is asked for

        rows = []
        for kind in self.kinds:
            for r, role in enumerate(self.roles):
                curve = np.asarray(self.aie[kind][r], dtype=float)
                if self.n_facts[kind][r] == 0 or np.isnan(curve).all():
                    continue
                layer = int(np.nanargmax(curve))
                rows.append({"kind": kind, "role": role, "peak_layer": layer,
                             "depth": layer / max(1, self.n_layers - 1),
                             "peak_aie": float(curve[layer]),
                             "ci_low": self.ci_low[kind][r][layer],
                             "ci_high": self.ci_high[kind][r][layer],
                             "n_facts": self.n_facts[kind][r]})
        return pd.DataFrame(rows)

    def summary(self) -> str:
        lines = [f"screen: {self.screen}"]
        for kind in self.kinds:
            e = self.effects[kind]
            lines.append(f"[{kind}] {e['n_facts']} facts: clean P {e['clean_prob']:.3f}, "
                         f"corrupted P {e['corrupt_prob']:.3f}, average total effect "
                         f"{e['total_effect']:.3f} ({100 * self.level:.0f}% CI "
                         f"{e['total_effect_ci'][0]:.3f}..{e['total_effect_ci'][1]:.3f})")
        peaks = self.peaks()
        if len(peaks):
            lines.append(peaks.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if self.graphs is not None:
            lines.append(_graph_summary(self.graphs, self.level))
        return "\n".join(lines)

    def to_json(self) -> str:
        """Strict JSON: a role no fact has is ``null`` (NaN in the arrays)."""
        return json.dumps(finite_or_none(asdict(self)), indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> DatasetResult:
        data = loads(text)
        for key in ("aie", "ci_low", "ci_high"):
            data[key] = {kind: np.array(grid, dtype=float).tolist()
                         for kind, grid in data[key].items()}
        graphs = data.get("graphs")
        if graphs is not None:
            for key in ("influence", "ci_low", "ci_high"):
                graphs[key] = {part: np.array(grid, dtype=float).tolist()
                               for part, grid in graphs[key].items()}
        return cls(**data)

    @checked
    def plot(self, path: str | Path | None = None):
        """ROME's Figure 1: a role x layer AIE heatmap per kind, and with graphs a last panel
        of the graphs' influence share by role x layer."""
        return plot_role_heatmaps(self, path)

    @checked
    def plot_curves(self, path: str | Path | None = None,
                    roles: tuple[str, ...] = ("Last subject token", "Last token")):
        """AIE against layer for ``roles``, one panel per kind, interval bands; with graphs a
        last panel of the graphs' influence share for the same roles."""
        return plot_role_curves(self, path, roles)


def _graph_summary(graphs: dict, level: float) -> str:
    """The graphs' lines of :meth:`DatasetResult.summary`."""
    q = graphs["quality"]

    def number(value) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    lines = [f"[graphs] {graphs['n_facts']} facts: {number(q['n_features'])} active features "
             f"({number(q['n_explored'])} explored) on average, closure at most "
             f"{q['closure_max']:.1e}, error share {number(q['error_share'])}, replacement "
             f"{number(q['replacement'])}, completeness {number(q['completeness'])}"]
    for kind, s in graphs["spearman"].items():
        ci = s["ci"]
        lines.append(f"[graphs vs {kind}] Spearman over {s['n_facts']} facts: mean "
                     f"{number(s['mean'])}, median {number(s['median'])} "
                     f"({100 * level:.0f}% CI {number(ci[0])}..{number(ci[1])})"
                     + (f"; undefined for {s['n_undefined']}" if s["n_undefined"] else ""))
    faith = graphs.get("faithfulness")
    if faith is not None:
        cpr, cmd, floor = faith["cpr"], faith["cmd"], faith["random_cpr"]
        lines.append(f"[graphs faithfulness] {faith['n_facts']} facts: CPR mean "
                     f"{number(cpr['mean'])} ({100 * level:.0f}% CI {number(cpr['ci'][0])}.."
                     f"{number(cpr['ci'][1])}), random rankings {number(floor['mean'])}; CMD "
                     f"mean {number(cmd['mean'])} ({number(cmd['ci'][0])}.."
                     f"{number(cmd['ci'][1])})"
                     + (f"; no curve for {faith['n_skipped']}" if faith["n_skipped"] else ""))
    return "\n".join(lines)
