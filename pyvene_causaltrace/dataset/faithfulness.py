"""Trace faithfulness over a dataset: each fact's curves (:mod:`..tracing.faithfulness`) as one
row per (fact, kind) in ``faithfulness.jsonl``, and their average per kind and token role with
percentile bootstrap intervals over facts (:func:`.aggregate.bootstrap_interval`, as the AIE).

Per kind: the sufficiency and necessity curves at each size (percent of the fact's cells: the
same sizes for every fact, so the points line up), their CPR and CMD, and the random rankings'
means; per role (:data:`.aggregate.ROLE_ORDER`): the share of each size's top cells at
positions of that role (0 for every role at a size of 0 cells)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..arguments import checked
from ..errors import InputError
from ..tracing.faithfulness import TraceFaithfulness
from ..tracing.roles import token_role
from .aggregate import ROLE_ORDER, bootstrap_interval
from .store import FAITHFULNESS, read_jsonl

#: The per-fact scores averaged (each a number per fact).
SCORES = ("cpr", "cmd", "necessity_cpr", "necessity_cmd", "random_cpr", "random_necessity_cpr")


def faithfulness_row(index: int, fact: str, curve: TraceFaithfulness) -> dict:
    """One fact's row: its curves at the ``sizes`` points, scores, and the share of each
    point's top cells per role."""
    area = [i for i, a in enumerate(curve.in_area) if a]
    n_pos = len(curve.tokens)
    roles = [token_role(cell % n_pos, curve.subject_range, n_pos) for cell in curve.ranking]
    shares = [[roles[:curve.counts[i]].count(role) / max(curve.counts[i], 1)
               for i in area] for role in ROLE_ORDER]
    summary = curve.summary()
    return {"index": index, "fact": fact, "kind": curve.kind, "n_cells": curve.n_cells,
            "sizes": curve.settings["sizes"], "counts": [curve.counts[i] for i in area],
            "sufficiency": [curve.sufficiency[i] for i in area],
            "necessity": [curve.necessity[i] for i in area],
            "random_sufficiency": np.mean(curve.random_sufficiency, 0)[area].tolist(),
            "random_necessity": np.mean(curve.random_necessity, 0)[area].tolist(),
            "roles": shares, "forwards": curve.forwards, "seconds": curve.seconds,
            **{key: float(summary[key]) for key in SCORES}}


@dataclass(frozen=True)
class DatasetFaithfulness:
    """Per kind: ``n_facts``, ``sizes``; ``curves[kind][name]`` (``sufficiency``,
    ``necessity``, ``random_sufficiency``, ``random_necessity``) and ``roles[kind][role]``
    (share of the top cells) each ``{"mean": [point], "low": [point], "high": [point]}``;
    ``scores[kind][score]`` ``{"mean", "low", "high"}`` over facts; ``level``, ``n_boot``;
    ``forwards`` and ``seconds`` summed over facts; ``skipped[kind]``: facts without a curve
    (:class:`~..errors.UndefinedCurveError`, the reason in their row)."""

    kinds: list[str]
    sizes: list[float]
    n_facts: dict[str, int]
    curves: dict[str, dict[str, dict[str, list[float]]]]
    roles: dict[str, dict[str, dict[str, list[float]]]]
    scores: dict[str, dict[str, dict[str, float]]]
    level: float
    n_boot: int
    forwards: int
    seconds: float
    skipped: dict[str, int] = field(default_factory=dict)

    def to_dataframe(self):
        """Long form: ``kind, size_pct, what, mean, low, high`` (``what``: a curve, or
        ``role:<role>``)."""
        import pandas as pd  # pandas loads only when a table is asked for

        rows = []
        for kind in self.kinds:
            named = {**self.curves[kind],
                     **{f"role:{role}": v for role, v in self.roles[kind].items()}}
            for what, value in named.items():
                for i, size in enumerate(self.sizes):
                    rows.append({"kind": kind, "size_pct": size, "what": what,
                                 "mean": value["mean"][i], "low": value["low"][i],
                                 "high": value["high"][i]})
        return pd.DataFrame(rows)

    def summary(self) -> str:
        pct = f"{100 * self.level:g}%"
        lines = [f"trace faithfulness over facts ({pct} bootstrap intervals, {self.n_boot} "
                 f"draws; {self.forwards} forwards, {self.seconds:.0f} s)"]
        for kind in self.kinds:
            s = self.scores[kind]
            lines.append(
                f"{kind} ({self.n_facts[kind]} facts"
                f"{f', no curve for {self.skipped[kind]}' if self.skipped.get(kind) else ''}): "
                "sufficiency CPR "
                f"{s['cpr']['mean']:.3f} [{s['cpr']['low']:.3f}, {s['cpr']['high']:.3f}], "
                f"random {s['random_cpr']['mean']:.3f}; necessity area "
                f"{s['necessity_cpr']['mean']:.3f}, random "
                f"{s['random_necessity_cpr']['mean']:.3f}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> DatasetFaithfulness:
        return cls(**json.loads(text))


def _interval(values: np.ndarray, n_boot: int, level: float) -> dict:
    low, high = bootstrap_interval(values, n_boot=n_boot, level=level)
    mean = values.mean(0)
    if mean.ndim == 0:
        return {"mean": float(mean), "low": float(low), "high": float(high)}
    return {"mean": mean.tolist(), "low": low.tolist(), "high": high.tolist()}


@checked
def aggregate_faithfulness(rows: list[dict], *, n_boot: int,
                           level: float = 0.95) -> DatasetFaithfulness:
    """The per-kind average of ``rows`` (:func:`faithfulness_row`; any order, one per (fact,
    kind): a second must agree)."""
    seen: dict[tuple[int, str], dict] = {}
    skipped: dict[str, int] = {}
    for row in rows:
        if "skipped" in row:  # a fact whose curve is undefined (its reason in the row)
            skipped[row["kind"]] = skipped.get(row["kind"], 0) + 1
            continue
        before = seen.setdefault((int(row["index"]), row["kind"]), row)
        if before is not row and before["sufficiency"] != row["sufficiency"]:
            raise InputError(f"fact {row['fact']}, kind {row['kind']}: two faithfulness rows "
                             "with different values")
    if not seen:
        raise InputError("no faithfulness rows to aggregate (run with faithfulness=)"
                         + (f"; every fact's curve is undefined ({skipped})" if skipped else ""))
    sizes = next(iter(seen.values()))["sizes"]
    if any(row["sizes"] != sizes for row in seen.values()):
        raise InputError("faithfulness rows with different sizes: one run's rows only")
    kinds = sorted({kind for _, kind in seen})
    curves, roles, scores, n_facts = {}, {}, {}, {}
    for kind in kinds:
        mine = [seen[key] for key in sorted(seen) if key[1] == kind]
        n_facts[kind] = len(mine)
        curves[kind] = {name: _interval(np.array([r[name] for r in mine], dtype=np.float64),
                                        n_boot, level)
                        for name in ("sufficiency", "necessity", "random_sufficiency",
                                     "random_necessity")}
        shares = np.array([r["roles"] for r in mine], dtype=np.float64)  # [F, roles, points]
        roles[kind] = {role: _interval(shares[:, i], n_boot, level)
                       for i, role in enumerate(ROLE_ORDER)}
        scores[kind] = {key: _interval(np.array([r[key] for r in mine], dtype=np.float64),
                                       n_boot, level) for key in SCORES}
    every = list(seen.values())
    return DatasetFaithfulness(
        kinds=kinds, sizes=list(sizes), n_facts=n_facts, curves=curves, roles=roles,
        scores=scores, level=level, n_boot=n_boot,
        forwards=sum(int(r["forwards"]) for r in every),
        seconds=float(sum(r["seconds"] for r in every)), skipped=skipped)


@checked
def load_faithfulness(path: str | Path, *, n_boot: int) -> DatasetFaithfulness:
    """The aggregate of the faithfulness rows a run directory holds."""
    return aggregate_faithfulness(list(read_jsonl(Path(path) / FAITHFULNESS)), n_boot=n_boot)
