"""How :class:`~.tracer.Tracer` traces one prompt, as one typed, frozen object.

    from pyvene_causaltrace.tracing import TraceSettings, Tracer, trace
    settings = TraceSettings(seeds=20, scale="auto", memory_budget_mb=8192)
    tracer = Tracer(model, tokenizer, prompt, subject, answer=" Paris", settings=settings)
    result = trace(model, tokenizer, prompt, subject, kind="mlp", settings=settings)

:class:`TraceSettings` holds every setting of ``Tracer(...)`` and ``trace(...)`` that is not an
input (the prompt, subject and its ``occurrence``, the answer, the trace ``kind``) or a choice
about display (``progress``). Its fields' defaults are those of ``Tracer``'s and ``trace``'s
keywords, the ``trace`` command's flags and trace specs: all of them read the values from
:mod:`pyvene_causaltrace.defaults` (where the command line's parser reads them without importing
torch), and none writes the value again. A :class:`TraceSettings` is checked when it is made
(``__post_init__``): one that exists holds settings a trace accepts (a seed count that cannot
fit the memory budget is refused by the tracer, once the model is known).
"""

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

__all__ = ["TraceSettings", "check_window", "seed_count"]


def seed_count(seeds: int | Sequence[int]) -> int:
    """How many seeds ``seeds`` names (a count is not expanded into a list: ``10**8`` seeds
    would fill memory); a list is checked by
    :func:`~pyvene_causaltrace.interventions.noise.seed_list` (distinct integers)."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if seeds <= 0:
            raise InputError(f"seeds must be a positive count or a non-empty list, got {seeds}")
        return seeds
    return len(seed_list(seeds))


def check_window(window: object) -> int:
    """``window`` as an ``int`` if it is a positive integer (a NumPy one too: layers per
    window), else :class:`~..errors.InputError`."""
    if isinstance(window, bool) or not isinstance(window, Integral) or window <= 0:
        raise InputError(f"window (--window) must be a positive integer, got {window!r}")
    return int(window)


@dataclass(frozen=True)
class TraceSettings(Settings):
    """The settings of one prompt's trace (module docstring); ``Tracer(...,
    settings=TraceSettings(...))`` or the same names as keywords.

    Noise: ``seeds`` is a count ``n`` (seeds ``0..n-1``) or a list of distinct seeds;
    ``scale`` is in units of sigma (ROME's 3), or ``"auto"``: the smallest of ``scales`` whose
    worst seed leaves P(answer) below 5% of its clean value; ``sigma`` is the noise unit
    (``"rome"``: the std of the subject's input embeddings, ``"embedding_matrix"``, or a
    number); ``distribution`` is ``"gaussian"`` or ``"uniform"``.

    Restores: ``window`` layers per window of the windowed kinds (``mlp``, ``attn``; ROME's
    10), the default of :meth:`~.tracer.Tracer.trace` and :meth:`~.tracer.Tracer.controls`.

    Engine: rows per forward are chosen to fit ``memory_budget_mb``; ``reuse_prefix`` starts
    each row at its restored position (earlier positions' keys and values from the corrupted
    run) and ``replay_layers`` at its restored layer (the blocks below return the corrupted
    run's outputs): both exact, turned off only to compare.

    Refused when made (:class:`~..errors.InputError`): a seed count below 1, an empty list or
    one that repeats a seed, a scale that is not a finite positive number or ``"auto"``, a
    sigma that is neither a method nor a finite positive number, a distribution other than
    ``"gaussian"``/``"uniform"``, a window that is not a positive integer, a memory budget that
    is not a finite positive number."""

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
        object.__setattr__(self, "window", check_window(self.window))
        positive_number(self.memory_budget_mb, "memory_budget_mb (--budget-mb)")

    @property
    def n_seeds(self) -> int:
        """How many seeds (:func:`seed_count`)."""
        return seed_count(self.seeds)
