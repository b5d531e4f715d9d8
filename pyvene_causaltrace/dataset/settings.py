"""How :func:`~.run.trace_dataset` traces a dataset: :class:`DatasetSettings`, every setting of
``trace_dataset()`` but its inputs (records, transcoder and its
:class:`~.graphs.GraphSettings`), outputs (``out``, ``shard``) and ``progress``, checked when
made, before any model loads. Defaults come from :mod:`pyvene_causaltrace.defaults`.

    settings = DatasetSettings(kinds=("residual", "mlp"), seeds=5, limit=200)
    result = trace_dataset(model, tokenizer, records, out="runs/known", settings=settings)"""

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
    """The settings of one dataset run; ``trace_dataset(..., settings=DatasetSettings(...))`` or
    the same names as keywords.

    ``kinds``: the trace kinds (at least one, none twice); ``seeds``, ``sigma``, ``window``,
    ``memory_budget_mb`` as in :class:`~..tracing.settings.TraceSettings`, which checks them
    (``"rome"``: one sigma over the kept subjects); ``scale``: one fixed scale for every fact;
    ``known``: ``"argmax"`` traces only facts whose clean prediction is the target, ``"none"``
    every well-formed one; ``limit``: facts traced (``None``: all); ``n_boot``: bootstrap
    resamples. Anything else is refused when made (:class:`~..errors.InputError`)."""

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
            try:
                get_kind(kind)
            except InputError as error:  # named as the setting it is (the CLI: its flag)
                raise InputError(f"kinds: {error}") from None
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
