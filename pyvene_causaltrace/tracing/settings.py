"""How :class:`~.tracer.Tracer` traces one prompt, as one typed, frozen object:
:class:`TraceSettings`, every setting of ``Tracer(...)`` and ``trace(...)`` but the inputs
(prompt, subject, ``occurrence``, answer, ``kind``) and ``progress``. Defaults come from
:mod:`pyvene_causaltrace.defaults`, shared with the command line and specs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

from .._settings import Settings
from ..defaults import (
    DISTRIBUTION,
    NOISE_SCALE,
    NOISE_SCALES,
    REPLAY_LAYERS,
    REUSE_PREFIX,
    SIGMA,
    TRACE_MEMORY_MB,
    TRACE_SEEDS,
    WINDOW,
)
from ..errors import InputError
from ..finite import positive_number
from ..interventions.noise import DISTRIBUTIONS, check_sigma, seed_list

__all__ = ["TraceSettings", "seed_count"]


def seed_count(seeds: int | Sequence[int]) -> int:
    """How many seeds ``seeds`` names (a count is not expanded into a list: ``10**8`` seeds
    would fill memory); a list is checked by
    :func:`~pyvene_causaltrace.interventions.noise.seed_list` (distinct integers)."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if seeds <= 0:
            raise InputError(f"seeds must be a positive count or a non-empty list, got {seeds}")
        return seeds
    return len(seed_list(seeds))


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
