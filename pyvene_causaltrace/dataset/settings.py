"""How :func:`~.run.trace_dataset` traces a dataset, as one typed, frozen object.

    from pyvene_causaltrace.dataset import DatasetSettings, trace_dataset
    settings = DatasetSettings(kinds=("residual", "mlp"), seeds=5, limit=200)
    result = trace_dataset(model, tokenizer, records, out="runs/known", settings=settings)

:class:`DatasetSettings` holds every setting of ``trace_dataset()`` that is not an input (the
records, the transcoder and its :class:`~.graphs.GraphSettings`), an output (``out``,
``shard``) or a choice about display (``progress``). Its fields' defaults are those of
``trace_dataset()``'s keywords and the ``dataset`` command's flags: all of them read the values
from :mod:`pyvene_causaltrace.defaults`, and none writes the value again. The settings each
fact's :class:`~..tracing.Tracer` shares with it (seeds, scale, sigma, window, memory budget)
are checked by :class:`~..tracing.settings.TraceSettings` (:meth:`DatasetSettings.trace`). A
:class:`DatasetSettings` is checked when it is made, before any model loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._settings import Settings
from ..defaults import (
    DATASET_KINDS,
    DATASET_SEEDS,
    KNOWN,
    N_BOOT,
    NOISE_SCALE,
    SIGMA,
    TRACE_MEMORY_MB,
    WINDOW,
)
from ..errors import InputError
from ..finite import positive_number
from ..tracing.engine import get_kind
from ..tracing.settings import TraceSettings, seed_count

__all__ = ["KNOWN_RULES", "DatasetSettings"]

#: Which facts a run traces: those whose clean prediction is the target, or every one.
KNOWN_RULES = ("argmax", "none")


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class DatasetSettings(Settings):
    """The settings of one dataset run (module docstring); ``trace_dataset(...,
    settings=DatasetSettings(...))`` or the same names as keywords.

    ``kinds``: the trace kinds (at least one, none twice; a list is kept as a tuple);
    ``seeds``: a count per fact (seeds ``0..n-1``) or a list; ``scale``: one fixed noise scale in
    sigma (not ``"auto"``: every fact shares it); ``sigma``: ``"rome"`` (one sigma over the kept
    subjects), ``"embedding_matrix"`` or a number; ``window``: layers per window;
    ``known``: ``"argmax"`` traces only facts whose clean prediction is the target, ``"none"``
    every well-formed one; ``limit``: facts to trace, after the screen (``None``: all);
    ``memory_budget_mb``: the budget of one batch of restored rows; ``n_boot``: bootstrap
    resamples of the aggregate's intervals.

    Refused when made (:class:`~..errors.InputError`, naming the setting): what
    :class:`~..tracing.settings.TraceSettings` refuses, an unknown or repeated kind, a scale
    that is not a finite positive number, a ``known`` outside :data:`KNOWN_RULES`, a limit or
    resample count that is not a positive integer."""

    kinds: Sequence[str] = DATASET_KINDS
    seeds: int | Sequence[int] = DATASET_SEEDS
    scale: float = NOISE_SCALE
    sigma: str | float = SIGMA
    window: int = WINDOW
    known: str = KNOWN
    limit: int | None = None
    memory_budget_mb: float = TRACE_MEMORY_MB
    n_boot: int = N_BOOT

    def __post_init__(self) -> None:
        super().__post_init__()
        kinds = tuple(self.kinds)
        object.__setattr__(self, "kinds", kinds)
        if not kinds:
            raise InputError("kinds: give at least one trace kind")
        for kind in kinds:
            get_kind(kind)
        if len(set(kinds)) != len(kinds):
            raise InputError(f"kinds repeat: {','.join(kinds)}")
        positive_number(self.scale, "scale (a dataset run needs one fixed noise scale)")
        # seeds, sigma, window and the memory budget, as a trace checks them
        object.__setattr__(self, "window", self.trace().window)
        if self.known not in KNOWN_RULES:
            raise InputError(f"known must be one of {KNOWN_RULES}, got {self.known!r}")
        if self.limit is not None:
            _positive_int(self.limit, "limit")
        _positive_int(self.n_boot, "n_boot (--boot, bootstrap resamples)")

    @property
    def n_seeds(self) -> int:
        """How many seeds each fact is traced with (a count is not expanded into a list)."""
        return seed_count(self.seeds)

    def trace(self, sigma: str | float | None = None) -> TraceSettings:
        """The :class:`~..tracing.settings.TraceSettings` of each fact's tracer (``sigma``:
        the value the run resolved, in place of the method)."""
        return TraceSettings(seeds=self.seeds, scale=self.scale,
                             sigma=self.sigma if sigma is None else sigma, window=self.window,
                             memory_budget_mb=self.memory_budget_mb)
