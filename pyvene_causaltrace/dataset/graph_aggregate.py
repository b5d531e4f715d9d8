"""Attribution graphs averaged over facts by ROME's token roles, beside the AIE
(docs/datasets.md, "Attribution graphs beside the traces").

A part's ``graphs.jsonl`` grid ``G[l, p]`` is averaged over each role's positions, then over
facts, with a bootstrap interval as the AIE's. Per fact, ``G_all`` is ranked (Spearman) against
the residual and mlp traces' ``IE`` (:mod:`~pyvene_causaltrace.crosscheck.sites`): ``None``
until the trace is complete, NaN for a constant grid (``n_undefined``). Nothing depends on row
order; a fact given twice must agree; wall time is left out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ..arguments import checked
from ..crosscheck.sites import SITE_PARTS, reachable_cells, spearman, window_sum
from ..errors import InputError
from ..locations import window_layers
from .aggregate import ROLE_ORDER, _nanmean, bootstrap_interval, check_boot_fits, role_curves

__all__ = ["COMPARED_KINDS", "TraceGrids", "aggregate_graphs", "faithfulness_summary"]

#: Trace kinds a graph is ranked against.
COMPARED_KINDS = ("residual", "mlp")


class TraceGrids:
    """Keeps, from result rows passing through :meth:`watch`, the ``IE`` grid of each seed of
    the kinds graphs are compared with, for the facts that have a graph."""

    def __init__(self, indices: Iterable[int], seeds: Sequence[int],
                 kinds: Sequence[str] = COMPARED_KINDS) -> None:
        self.indices = set(indices)
        self.seeds = sorted(int(s) for s in seeds)
        self.kinds = tuple(kinds)
        self._grids: dict[tuple[int, str], dict[int, np.ndarray]] = {}

    def watch(self, rows: Iterable[dict]) -> Iterator[dict]:
        """``rows``, unchanged, keeping the grids on the way."""
        for row in rows:
            index = int(row["index"])
            if row["kind"] in self.kinds and index in self.indices:
                ie = np.asarray(row["restored"], dtype=np.float64) - row["corrupt"]
                self._grids.setdefault((index, row["kind"]), {}).setdefault(int(row["seed"]), ie)
            yield row

    def mean(self, index: int, kind: str) -> np.ndarray | None:
        """``[layers, positions]`` IE averaged over the run's seeds in seed order; ``None``
        until every seed is there."""
        by_seed = self._grids.get((index, kind), {})
        if sorted(by_seed) != self.seeds:
            return None
        return np.mean([by_seed[s] for s in self.seeds], axis=0)


def _unique(rows: Iterable[dict]) -> dict[int, dict]:
    """Graph rows by fact index; a fact given twice must agree (its seconds aside)."""
    by_index: dict[int, dict] = {}
    for row in rows:
        before = by_index.setdefault(int(row["index"]), row)
        if before is not row and {k: v for k, v in before.items() if k != "seconds"} != \
                {k: v for k, v in row.items() if k != "seconds"}:
            raise InputError(f"fact {row['fact']} has two graph rows with different values")
    return by_index


def _summary(values: list[float], n_boot: int, level: float) -> dict:
    """Mean, median and bootstrap interval of the finite ``values`` (``None`` without any)."""
    finite = np.array([v for v in values if np.isfinite(v)], dtype=np.float64)
    if not len(finite):
        return {"n_facts": 0, "n_undefined": len(values), "mean": None, "median": None,
                "ci": [None, None]}
    low, high = bootstrap_interval(finite[:, None], n_boot=n_boot, level=level)
    return {"n_facts": len(finite), "n_undefined": len(values) - len(finite),
            "mean": float(finite.mean()), "median": float(np.median(finite)),
            "ci": [float(low[0]), float(high[0])]}


def _correlations(row: dict, grid: np.ndarray, traces: TraceGrids | None,
                  kinds: Sequence[str], window: int) -> dict[str, float | None]:
    """Per compared kind: Spearman of the graph's grid and the trace's IE (NaN: undefined,
    None: the trace is not complete)."""
    n_layers, n_pos = grid.shape
    mask = reachable_cells(n_layers, n_pos, int(row["subject_range"][0]))
    out: dict[str, float | None] = {}
    for kind in kinds:
        ie = traces.mean(int(row["index"]), kind) if traces is not None else None
        if ie is None:
            out[kind] = None
            continue
        side = grid if kind == "residual" else window_sum(
            grid, [window_layers(layer, window, n_layers) for layer in range(n_layers)])
        if ie.shape != side.shape:
            raise InputError(f"fact {row['fact']}: the graph's grid is {side.shape}, the "
                             f"{kind} trace's {ie.shape}")
        out[kind] = spearman(side[mask], ie[mask])
    return out


@checked
def aggregate_graphs(rows: Iterable[dict], *, n_layers: int, kinds: Sequence[str] = (),
                     traces: TraceGrids | None = None, window: int, n_boot: int,
                     level: float = 0.95) -> dict | None:
    """The ``graphs`` part of a :class:`~.results.DatasetResult` from ``graphs.jsonl`` rows
    (any order), ranked against the ``traces`` of ``kinds`` (those of
    :data:`COMPARED_KINDS` the run traced); ``None`` without rows.

    Keys: ``n_facts``; ``parts``; ``influence[part][role][layer]`` (mean share) with
    ``ci_low``/``ci_high``; ``n_role_facts[role]``; ``spearman[kind]`` (``n_facts``,
    ``n_undefined``, ``mean``, ``median``, ``ci``); ``quality`` (mean active and explored
    features, largest closure residuals, mean error share, replacement and completeness
    scores); ``per_fact`` (index, fact, the Spearman values and those scores); in a run with
    faithfulness curves, ``faithfulness`` (:func:`faithfulness_summary`) and each fact's CPR and
    CMD in ``per_fact``."""
    by_index = _unique(rows)
    if not by_index:
        return None
    kinds = [k for k in COMPARED_KINDS if k in kinds]
    facts = sorted(by_index)
    check_boot_fits(n_boot, len(facts), len(SITE_PARTS) * len(ROLE_ORDER) * n_layers)
    curves: dict[str, list[np.ndarray]] = {part: [] for part in SITE_PARTS}
    rhos: dict[str, list[float]] = {kind: [] for kind in kinds}  # NaN: undefined
    per_fact = []
    for index in facts:
        row = by_index[index]
        grids = {part: np.asarray(row["influence"][part], dtype=np.float64)
                 for part in SITE_PARTS}
        for part, grid in grids.items():
            if grid.ndim != 2 or grid.shape[0] != n_layers:
                raise InputError(f"fact {row['fact']}: a {part} grid of shape {grid.shape}, "
                                 f"expected {n_layers} layers x {len(row['tokens'])} positions")
            curves[part].append(role_curves(grid, 0.0, row["subject_range"]))
        rho = _correlations(row, grids["all"], traces, kinds, window)
        for kind, value in rho.items():
            if value is not None:
                rhos[kind].append(value)
        per_fact.append({
            "index": index, "fact": row["fact"],
            "spearman": {k: None if v is None or not np.isfinite(v) else float(v)
                         for k, v in rho.items()},
            **{key: row.get(key) for key in ("n_features", "n_explored", "closure",
                                             "feature_closure", "error_share", "replacement",
                                             "completeness")},
            **({"faithfulness": _fact_curve(row)} if "faithfulness" in row else {})})
    stacked = {part: np.stack(curves[part]) for part in SITE_PARTS}  # [F, R, L]
    intervals = {part: bootstrap_interval(stacked[part], n_boot=n_boot, level=level)
                 for part in SITE_PARTS}
    return {
        "n_facts": len(facts), "parts": list(SITE_PARTS),
        "influence": {part: _nanmean(stacked[part]).tolist() for part in SITE_PARTS},
        "ci_low": {part: intervals[part][0].tolist() for part in SITE_PARTS},
        "ci_high": {part: intervals[part][1].tolist() for part in SITE_PARTS},
        "n_role_facts": (~np.isnan(stacked["all"][:, :, 0])).sum(0).tolist(),
        "spearman": {kind: _summary(rhos[kind], n_boot, level) for kind in kinds},
        "quality": _quality([by_index[i] for i in facts]),
        "per_fact": per_fact,
        **({"faithfulness": faithfulness_summary(per_fact, n_boot, level)}
           if any("faithfulness" in by_index[i] for i in facts) else {}),
    }


def _fact_curve(row: dict) -> dict:
    """A fact's CPR, CMD, its random rankings' mean CPR and CMD and its counterfactual fact,
    from its row's curve (numbers ``None`` when it has none, ``skipped`` saying why)."""
    curve = row["faithfulness"]
    if curve is None:
        return {"cpr": None, "cmd": None, "random_cpr": None, "random_cmd": None,
                "counterfactual": None, "skipped": str(row.get("faithfulness_skipped"))}
    try:
        values = {key: float(curve[key]) for key in ("cpr", "cmd")}
        values.update({f"random_{key}": float(np.mean(curve[f"random_{key}"]))
                       for key in ("cpr", "cmd")})
    except (KeyError, TypeError, ValueError):
        raise InputError(f"fact {row['fact']}: its faithfulness entry is not a curve (no "
                         "cpr, cmd, random_cpr and random_cmd numbers)") from None
    return {**values, "counterfactual": curve.get("counterfactual"), "skipped": None}


def faithfulness_summary(per_fact: list[dict], n_boot: int, level: float) -> dict:
    """Over the facts with a curve: CPR, CMD and the random rankings' mean CPR and CMD (each
    :func:`_summary`: mean, median, bootstrap interval), how many facts have none, and the
    first reasons."""
    curves = [p["faithfulness"] for p in per_fact if p.get("faithfulness") is not None]
    scored = [c for c in curves if c["cpr"] is not None]
    skipped = [(p["fact"], p["faithfulness"]["skipped"]) for p in per_fact
               if p.get("faithfulness") is not None and p["faithfulness"]["cpr"] is None]
    return {"n_facts": len(scored), "n_skipped": len(skipped),
            "skipped": [{"fact": fact, "reason": why} for fact, why in skipped[:10]],
            **{key: _summary([c[key] for c in scored], n_boot, level)
               for key in ("cpr", "cmd", "random_cpr", "random_cmd")}}


def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [row.get(key) for row in rows]
    values = [float(v) for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(values)) if values else None


def _quality(rows: list[dict]) -> dict:
    """What says how far each graph can be trusted, over facts."""
    return {"n_features": _mean_of(rows, "n_features"),
            "n_explored": _mean_of(rows, "n_explored"),
            "closure_max": max(float(r["closure"]) for r in rows),
            "feature_closure_max": max(float(r.get("feature_closure") or 0.0) for r in rows),
            "error_share": _mean_of(rows, "error_share"),
            "replacement": _mean_of(rows, "replacement"),
            "completeness": _mean_of(rows, "completeness")}
