""":class:`CrossCheckResult`: what :func:`~.check.cross_check` measured, as plain data."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from ..arguments import checked
from ..atomic import write_text
from ..tracing.results import finite_or_none, package_versions
from .plots import plot_cross_check
from .sites import pearson, spearman

#: A sign disagreement is flagged only where both values exceed this share of the largest
#: |value| among the checked features (below it, both are zero up to rounding).
SIGN_FLOOR = 1e-3


def cross_check_schema() -> dict:
    """The JSON Schema of :meth:`CrossCheckResult.to_json` (``cross_check.json``)."""
    return json.loads(files("pyvene_causaltrace.crosscheck").joinpath("cross_check.schema.json")
                      .read_text())


def sign_disagreements(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """``[n]`` bool: prediction and measurement of opposite signs, both above the floor."""
    predicted, measured = np.asarray(predicted), np.asarray(measured)
    if predicted.size == 0:
        return np.zeros(0, dtype=bool)
    floor = SIGN_FLOOR * max(float(np.abs(predicted).max()), float(np.abs(measured).max()))
    return (np.sign(predicted) != np.sign(measured)) & (np.abs(predicted) > floor) \
        & (np.abs(measured) > floor)


def feature_statistics(features: list[dict], mode: str) -> dict[str, Any]:
    """Agreement of prediction and measurement in ``mode`` over the checked features (their
    means over seeds), and the largest gaps over every (feature, seed)."""
    predicted = np.array([f["predicted_mean"] for f in features])
    measured = np.array([f["modes"][mode]["measured_mean"] for f in features])
    every_p = np.array([f["predicted"] for f in features]).ravel()
    every_m = np.array([f["modes"][mode]["measured"] for f in features]).ravel()
    gap = np.abs(every_p - every_m)
    size = np.maximum(np.abs(every_p), np.abs(every_m))
    crossings = np.array([f["modes"][mode]["crossings"] for f in features])
    flags = sign_disagreements(predicted, measured)
    for f, flag in zip(features, flags, strict=True):
        f["modes"][mode]["sign_disagrees"] = bool(flag)
    return {"n_features": len(features), "pearson": pearson(predicted, measured),
            "spearman": spearman(predicted, measured),
            "n_sign_disagree": int(flags.sum()),
            "max_abs_gap": float(gap.max()) if gap.size else 0.0,
            "max_rel_gap": float((gap / np.maximum(size, 1e-30)).max()) if gap.size else 0.0,
            "mean_crossings": float(crossings.mean()) if crossings.size else 0.0,
            "max_abs_gap_without_crossings": float(gap[crossings.ravel() == 0].max())
            if (crossings == 0).any() else None,
            "sum_predicted": float(predicted.sum()), "sum_measured": float(measured.sum())}


@dataclass
class CrossCheckResult:
    """One prompt's graph against its trace (:func:`~.check.cross_check`).

    ``graph_grids[part]``: ``[layer][position]`` influence share of the graph's nodes at each
    cell (:data:`~.sites.SITE_PARTS`). ``trace_grids[kind]``: the trace's mean indirect effect.
    ``sites[kind][part]``: Spearman, Pearson and top-k overlap over the cells from the subject
    on. ``features``: one dict per checked feature (``predicted``/``measured`` per seed,
    ``modes[mode]``, ``sign_disagrees``); ``feature_stats[mode]``: their agreement. ``heads``
    (empty unless asked for): :func:`~.heads.head_section`'s loadings, effects and statistics.
    """

    prompt: str
    tokens: list[str]
    subject_range: tuple[int, int]
    answer: str
    n_layers: int
    seeds: list[int]
    scale: float
    sigma: float
    clean_prob: float
    corrupt_probs: list[float]
    windows: dict[str, int | None]
    graph_grids: dict[str, list[list[float]]]
    trace_grids: dict[str, list[list[float]]]
    sites: dict[str, dict[str, dict[str, Any]]]
    features: list[dict[str, Any]]
    feature_stats: dict[str, dict[str, Any]]
    graph_info: dict[str, Any]
    settings: dict[str, Any]
    heads: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=package_versions)

    # ------------------------------------------------------------------------- tables
    def sites_dataframe(self):
        """One row per (trace kind, graph part): the site statistics."""
        import pandas as pd  # pandas loads only when a table is asked for

        return pd.DataFrame([{"kind": kind, "part": part, **{k: v for k, v in stats.items()
                                                            if not k.endswith("_top")}}
                             for kind, parts in self.sites.items()
                             for part, stats in parts.items()])

    def heads_dataframe(self):
        """One row per checked (layer, head): its loadings (``loading_subject``,
        ``loading_all``) and mean indirect effect (``effect``); empty without heads."""
        import pandas as pd  # pandas loads only when a table is asked for

        if not self.heads:
            return pd.DataFrame(columns=["layer", "head", "loading_subject", "loading_all",
                                         "effect"])
        h = self.heads
        return pd.DataFrame([{"layer": layer, "head": head,
                              **{f"loading_{part}": grid[i][head]
                                 for part, grid in h["loadings"].items()},
                              "effect": h["effects"][i][head]}
                             for i, layer in enumerate(h["layers"])
                             for head in range(h["n_heads"])])

    def to_dataframe(self):
        """One row per (checked feature, mode): where it is, activation change, predicted
        and measured effect on the target (means over seeds), P(answer) change, flag."""
        import pandas as pd  # pandas loads only when a table is asked for

        return pd.DataFrame([{"mode": mode, "label": f["label"], "layer": f["layer"],
                              "position": f["position"], "feature": f["feature"],
                              "influence": f["influence"], "activation": f["activation"],
                              "delta": f["delta_mean"], "total_effect": f["total_effect"],
                              "predicted": f["predicted_mean"], "measured": m["measured_mean"],
                              "prob_change": m["prob_change_mean"],
                              "crossings": float(np.mean(m["crossings"])),
                              "sign_disagrees": m.get("sign_disagrees", False)}
                             for f in self.features for mode, m in f["modes"].items()])

    # ------------------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["subject_range"] = list(self.subject_range)
        return finite_or_none(data)

    @checked
    def to_json(self, path: str | Path | None = None) -> str:
        """The JSON text (``cross_check.schema.json``); written whole to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            write_text(text, path)
        return text

    @classmethod
    def from_json(cls, text: str) -> CrossCheckResult:
        data = json.loads(text)
        data["subject_range"] = tuple(data["subject_range"])
        return cls(**data)

    @checked
    def plot(self, path: str | Path | None = None):
        """Heat maps of the graph's and the trace's cells side by side, and the features'
        predicted against measured effects (:func:`~.plots.plot_cross_check`)."""
        return plot_cross_check(self, path)

    def summary(self) -> str:
        lines = [f"{self.prompt!r} -> {self.answer!r}: clean P {self.clean_prob:.4f}, corrupted "
                 f"{np.mean(self.corrupt_probs):.4f} (mean of {len(self.seeds)} seeds)"]
        for kind, parts in self.sites.items():
            for part, s in parts.items():
                lines.append(f"sites, graph {part:<8} vs {kind:<8} trace: Spearman "
                             f"{_fmt(s['spearman'])}, top-{s['top_k']} overlap "
                             f"{_fmt(s['top_k_overlap'])} over {s['n_cells']} cells")
        for mode, s in self.feature_stats.items():
            lines.append(f"features ({mode}): {s['n_features']} checked; prediction vs patch "
                         f"Pearson {_fmt(s['pearson'])}, Spearman {_fmt(s['spearman'])}; "
                         f"{s['n_sign_disagree']} sign disagreements; largest gap "
                         f"{s['max_abs_gap']:.3g}; {s['mean_crossings']:.1f} features switch "
                         "per patch")
        if self.heads:
            h = self.heads
            for part, s in h["stats"].items():
                per_layer = ", ".join(f"L{layer} {_fmt(value)}" for layer, value
                                      in zip(h["layers"], s["per_layer"], strict=True))
                lines.append(f"heads, loading ({part} sources) vs restore at position "
                             f"{h['position']}: Spearman {_fmt(s['spearman'])} over "
                             f"{s['n_heads']} heads; per layer {per_layer}")
        if self.features and not self.graph_info.get("complete", True):
            lines.append("note: the graph has features without rows: paths through them are "
                         "missing from the predictions")
        return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:+.3f}"
