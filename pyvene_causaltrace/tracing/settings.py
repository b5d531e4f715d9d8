"""How :class:`~.tracer.Tracer` traces one prompt, as one typed, frozen object:
:class:`TraceSettings`, every setting of ``Tracer(...)`` and ``trace(...)`` but the inputs
(prompt, subject, ``occurrence``, answer, ``kind``) and ``progress``. Defaults come from
:mod:`pyvene_causaltrace.defaults`, shared with the command line and specs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Literal

from .._settings import Settings
from ..arguments import PositiveInt, Seed
from ..defaults import (
    DISTRIBUTION,
    NOISE_SCALE,
    NOISE_SCALES,
    REPLAY_LAYERS,
    REUSE_PREFIX,
    SIGMA,
    TRACE_FAITH_CELLS,
    TRACE_FAITH_DRAWS,
    TRACE_FAITH_ROWS,
    TRACE_FAITH_SEED,
    TRACE_FAITH_SIZES,
    TRACE_FAITH_TOP,
    TRACE_MEMORY_MB,
    TRACE_SEEDS,
    WINDOW,
)
from ..errors import InputError
from ..finite import positive_number
from ..interventions.noise import DISTRIBUTIONS, check_sigma, seed_list

__all__ = ["TraceFaithfulnessSettings", "TraceSettings", "seed_count"]


def seed_count(seeds: int | Sequence[int]) -> int:
    """How many seeds ``seeds`` names (a count is not expanded into a list: ``10**8`` seeds
    would fill memory); a list is checked by
    :func:`~pyvene_causaltrace.interventions.noise.seed_list` (distinct integers)."""
    if isinstance(seeds, int) and not isinstance(seeds, bool) and seeds > 0:
        return seeds
    return len(seed_list(seeds))  # refuses a count below 1 as it refuses a bad list


@dataclass(frozen=True)
class TraceSettings(Settings):
    """The settings of one prompt's trace; ``Tracer(..., settings=TraceSettings(...))`` or the
    same names as keywords.

    ``seeds``: a count ``n`` (seeds ``0..n-1``) or a list of distinct seeds. ``scale``: noise in
    units of sigma (ROME's 3), or ``"auto"``: the smallest of ``scales`` whose worst seed leaves
    P(answer) below 5% of its clean value. ``sigma``: ``"rome"`` (std of the subject's input
    embeddings), ``"embedding_matrix"`` or a number. ``distribution``: ``"gaussian"`` or
    ``"uniform"``. ``window``: layers per window of ``mlp`` / ``attn`` traces and of the controls
    (ROME's 10). ``memory_budget_mb``: rows per forward fit it. ``reuse_prefix`` /
    ``replay_layers``: exact shortcuts (:mod:`.engine`), off only to compare. Anything else is
    refused when made (:class:`~..errors.InputError`)."""

    seeds: int | Sequence[int] = TRACE_SEEDS
    scale: float | str = NOISE_SCALE
    scales: Sequence[float] = NOISE_SCALES
    sigma: str | float = SIGMA
    distribution: str = DISTRIBUTION
    window: int = WINDOW
    memory_budget_mb: float = TRACE_MEMORY_MB
    reuse_prefix: bool = REUSE_PREFIX
    replay_layers: bool = REPLAY_LAYERS

    def __post_init__(self) -> None:
        super().__post_init__()
        seed_count(self.seeds)  # a count is checked without building its list
        if self.scale != "auto":
            positive_number(self.scale, "scale (or 'auto')")
        check_sigma(self.sigma)
        if self.distribution not in DISTRIBUTIONS:
            raise InputError(f"distribution must be one of {DISTRIBUTIONS}, got "
                             f"{self.distribution!r}")
        window = self.window  # layers per window: a positive integer (a NumPy one too)
        if isinstance(window, bool) or not isinstance(window, Integral) or window <= 0:
            raise InputError(f"window (--window) must be a positive integer, got {window!r}")
        object.__setattr__(self, "window", int(window))
        positive_number(self.memory_budget_mb, "memory_budget_mb (--budget-mb)")

    @property
    def n_seeds(self) -> int:
        """How many seeds (:func:`seed_count`)."""
        return seed_count(self.seeds)


@dataclass(frozen=True)
class TraceFaithfulnessSettings(Settings):
    """How a trace's faithfulness is measured (:mod:`.faithfulness`): ``sizes`` in percent of
    the trace's cells, each in (0, 100], increasing (a circuit of ``int(size / 100 * cells)``
    cells, MIB's rounding; CPR and CMD integrate over them); ``top``: small numbers of top cells
    reported beside them (increasing, positive; those above the cells dropped); ``draws``
    random rankings (seeded by ``seed``) as the floor; ``rows_per_forward``: rows (seed x
    circuit x mode) per forward; ``cells``: ``"all"`` the trace's cells, or ``"subject"`` only
    those at the noised subject's positions (a residual trace's last-position cells late in the
    model restore the whole effect by construction: ``"subject"`` asks about the subject site
    alone)."""

    sizes: tuple[float, ...] = TRACE_FAITH_SIZES
    top: tuple[int, ...] = TRACE_FAITH_TOP
    draws: PositiveInt = TRACE_FAITH_DRAWS
    seed: Seed = TRACE_FAITH_SEED
    rows_per_forward: PositiveInt = TRACE_FAITH_ROWS
    cells: Literal["all", "subject"] = TRACE_FAITH_CELLS

    def __post_init__(self) -> None:
        super().__post_init__()
        sizes, top = tuple(self.sizes), tuple(self.top)
        if not sizes or any(not 0 < s <= 100 for s in sizes):
            raise InputError(f"sizes must be percentages in (0, 100], got {list(sizes)}")
        if len(sizes) < 2:  # one point has no area: CPR 0 and CMD 0, a "perfect" CMD
            raise InputError(f"sizes: CPR and CMD integrate between sizes; give two or more, "
                             f"got {list(sizes)}")
        if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise InputError(f"sizes must increase, got {list(sizes)}")
        # (their items' types: checked, NumPy integers made int, by super().__post_init__)
        if any(k <= 0 for k in top) or any(b <= a for a, b in zip(top, top[1:], strict=False)):
            raise InputError(f"top must be increasing positive cell counts, got {list(top)}")
        object.__setattr__(self, "sizes", tuple(float(s) for s in sizes))
        object.__setattr__(self, "top", top)
