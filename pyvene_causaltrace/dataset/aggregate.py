"""Average indirect effects over facts, by ROME's token roles, with bootstrap intervals.

``IE[l, t] = restored[l, t] - corrupt`` per fact, kind and seed (a probability gap, as in
ROME); a role's curve is its mean over the role's positions
(:func:`~pyvene_causaltrace.tracing.roles.role_positions`), then over seeds; the AIE is the mean
over the facts with the role, with a percentile bootstrap interval. The total effect is
``clean - corrupt`` per fact. Values are kept by (fact, kind, seed) and combined in sorted
order, so a merged or resumed run gives exactly an uninterrupted one's numbers; a key given
twice must agree. Only per-fact role curves are held, never grids; a bootstrap that cannot fit
this machine's memory is refused before it allocates (:func:`check_boot_fits`)."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from ..arguments import checked
from ..errors import InputError, MemoryCapError
from ..memory import device_bytes
from ..tracing.roles import BEFORE_SUBJECT, ROLES, role_positions
from .results import DatasetResult

ROLE_ORDER = (BEFORE_SUBJECT, *ROLES)


def _nanmean(values: np.ndarray) -> np.ndarray:
    """Mean over the first axis ignoring NaN; NaN (no warning) where every value is NaN."""
    present = ~np.isnan(values)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(present, values, 0.0).sum(0) / present.sum(0)


@checked
def role_curves(restored: np.ndarray | list, corrupt: float,
                subject_range: Sequence[int]) -> np.ndarray:
    """``[roles, layers]`` mean IE per role (NaN for a role with no position)."""
    ie = np.asarray(restored, dtype=np.float64) - corrupt
    buckets = role_positions(tuple(subject_range), ie.shape[1])
    out = np.full((len(ROLE_ORDER), ie.shape[0]), np.nan)
    for r, role in enumerate(ROLE_ORDER):
        if buckets[role]:
            out[r] = ie[:, buckets[role]].mean(1)
    return out


@checked
def bootstrap_interval(values: np.ndarray, *, n_boot: int, level: float = 0.95,
                       seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap over the first axis of ``values [F, ...]`` (NaN = missing) of the
    mean; returns ``(low, high)`` shaped ``values.shape[1:]``, NaN where fewer than two values
    are present (one value resamples only to itself: a zero-width interval, not a certainty)."""
    n = values.shape[0]
    flat = values.reshape(n, -1)
    present = ~np.isnan(flat)
    filled = np.where(present, flat, 0.0)
    rng = np.random.default_rng(seed)
    weights = np.zeros((n_boot, n))
    draws = rng.integers(0, n, size=(n_boot, n))
    np.add.at(weights, (np.arange(n_boot)[:, None], draws), 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        boots = (weights @ filled) / (weights @ present)
    tail = (1 - level) / 2
    with warnings.catch_warnings():  # a role no fact has: NaN, said once by n_facts == 0
        warnings.simplefilter("ignore", RuntimeWarning)
        low = np.nanquantile(boots, tail, axis=0)
        high = np.nanquantile(boots, 1 - tail, axis=0)
    single = present.sum(0) < 2
    low, high = np.where(single, np.nan, low), np.where(single, np.nan, high)
    return low.reshape(values.shape[1:]), high.reshape(values.shape[1:])


def bootstrap_bytes(n_boot: int, n_facts: int, n_values: int) -> int:
    """Bytes a percentile bootstrap of ``n_values`` means over ``n_facts`` holds at once:
    resample weights and draws, the resampled means and the quantiles' working copies."""
    return 8 * n_boot * (2 * n_facts + 4 * n_values)


def check_boot_fits(n_boot: int, n_facts: int, n_values: int) -> None:
    """Refuse, before allocating, a bootstrap that cannot fit this machine's memory."""
    need, have = bootstrap_bytes(n_boot, n_facts, n_values), device_bytes()
    if need > have:
        most = max(1, have // max(1, bootstrap_bytes(1, n_facts, n_values)))
        raise MemoryCapError(
            f"n_boot (--boot) {n_boot}: the bootstrap over {n_facts} fact(s) would hold "
            f"{_size(need)}, more than this machine's {_size(have)}; use at most {most} "
            "resamples (1000 is the usual)")


def _size(n_bytes: float) -> str:
    power = min(4, int(math.log(max(n_bytes, 1), 1024)))
    return f"{n_bytes / 1024 ** power:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[power]}"


@checked
def aggregate_rows(rows: Iterable[dict], *, kinds: Sequence[str], manifest: dict | None = None,
                   screen: Sequence[dict] = (), n_boot: int,
                   level: float = 0.95) -> DatasetResult:
    """A :class:`DatasetResult` from result rows (any order; duplicates must agree)."""
    # (fact index, kind) -> seed -> (role curves, clean P, corrupted P)
    seen: dict[tuple[int, str], dict[int, tuple[np.ndarray, float, float]]] = {}
    n_layers = None
    for row in rows:
        curve = role_curves(row["restored"], row["corrupt"], row["subject_range"])
        n_layers = curve.shape[1] if n_layers is None else n_layers
        if curve.shape[1] != n_layers:
            raise InputError(f"fact {row['fact']}: {curve.shape[1]} layers, expected {n_layers}")
        by_seed = seen.setdefault((int(row["index"]), row["kind"]), {})
        value = (curve, row["clean"], row["corrupt"])
        before = by_seed.setdefault(int(row["seed"]), value)
        if before is not value and not (np.array_equal(before[0], curve, equal_nan=True)
                                         and before[1:] == value[1:]):
            raise InputError(f"fact {row['fact']}, kind {row['kind']}, seed {row['seed']} has "
                             "two rows with different values")
    if n_layers is None:
        raise InputError("no result rows to aggregate")
    facts_per_kind = Counter(kind for _, kind in seen)
    check_boot_fits(n_boot, max(facts_per_kind.values()), len(ROLE_ORDER) * n_layers)

    aie, low, high, n_facts, totals = {}, {}, {}, {}, {}
    for kind in kinds:
        facts = sorted(index for index, k in seen if k == kind)
        if not facts:
            continue
        by_seed = [[seen[(f, kind)][s] for s in sorted(seen[(f, kind)])] for f in facts]
        per_fact = np.stack([np.mean([c for c, _, _ in seeds], axis=0)
                             for seeds in by_seed])  # [F, R, L]
        clean = np.array([seeds[0][1] for seeds in by_seed])  # one clean run per fact
        corrupt = np.array([np.mean([r for _, _, r in seeds]) for seeds in by_seed])
        te = clean - corrupt
        aie[kind] = _nanmean(per_fact)
        low[kind], high[kind] = bootstrap_interval(per_fact, n_boot=n_boot, level=level)
        n_facts[kind] = (~np.isnan(per_fact[:, :, 0])).sum(0).tolist()
        te_low, te_high = bootstrap_interval(te[:, None], n_boot=n_boot, level=level)
        totals[kind] = {"n_facts": len(facts), "total_effect": float(te.mean()),
                        "total_effect_ci": [float(te_low[0]), float(te_high[0])],
                        "clean_prob": float(clean.mean()), "corrupt_prob": float(corrupt.mean())}
    reasons = Counter((line.get("reason") or "kept").split(":")[0] for line in screen)
    return DatasetResult(
        kinds=[k for k in kinds if k in aie], roles=list(ROLE_ORDER), n_layers=int(n_layers),
        aie={k: v.tolist() for k, v in aie.items()},
        ci_low={k: v.tolist() for k, v in low.items()},
        ci_high={k: v.tolist() for k, v in high.items()},
        n_facts=n_facts, effects=totals, level=level, n_boot=n_boot,
        screen=dict(sorted(reasons.items())), manifest=dict(manifest or {}))
