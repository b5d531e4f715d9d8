"""How :func:`~.check.cross_check` compares a graph with its trace: :class:`CrossCheckSettings`,
every setting of ``cross_check()`` but its inputs and ``progress`` (the noise is the tracer's).

    check = cross_check(graph, tracer, transcoder, settings=CrossCheckSettings(top_n=10))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._settings import Settings
from ..arguments import NonNegativeInt, PositiveInt
from ..defaults import (
    CROSS_CHECK_FEATURES,
    CROSS_CHECK_HEADS,
    CROSS_CHECK_KINDS,
    CROSS_CHECK_MODES,
    CROSS_CHECK_TOP_K,
    CROSS_CHECK_WINDOW,
)
from ..errors import InputError
from .features import MODES

__all__ = ["SITE_KINDS", "CrossCheckSettings"]

#: Trace kinds a graph can be compared with: the graph has no attention nodes.
SITE_KINDS = ("residual", "mlp")


def _members(name: str, values: Sequence[str], allowed: Sequence[str], why: str) -> tuple:
    """``values`` as a tuple of distinct members of ``allowed`` (at least one)."""
    values = tuple(values)
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        raise InputError(f"{name} must list some of {', '.join(allowed)}{why}, got "
                         f"{list(values)!r}")
    if len(set(values)) != len(values):
        raise InputError(f"{name} repeat: {list(values)!r}")
    return values


@dataclass(frozen=True)
class CrossCheckSettings(Settings):
    """The settings of one cross-check; ``settings=`` or the same names as keywords (defaults:
    :mod:`~pyvene_causaltrace.defaults`).

    ``kinds``: the traces compared (:data:`SITE_KINDS`). ``window``: layers an MLP restore spans
    (with more than one the graph's cells are summed alike). ``top_k``: cells in the top-``k``
    overlap. ``top_n``: features checked, by influence (0: none). ``modes``: where their patches are
    measured, ``"spliced"`` and/or ``"replacement"`` (attention and norms held: the prediction is
    exact up to threshold crossings). ``heads``: the layers whose heads are compared (``True``
    all, ``False`` none; each costs a forward, a backward and ``heads x seeds`` restores). Refused
    when made (:class:`~..errors.InputError`): a value its annotation does not admit, an unknown,
    missing or repeated kind or mode."""

    kinds: Sequence[str] = CROSS_CHECK_KINDS
    window: PositiveInt = CROSS_CHECK_WINDOW
    top_k: PositiveInt = CROSS_CHECK_TOP_K
    top_n: NonNegativeInt = CROSS_CHECK_FEATURES
    modes: Sequence[str] = CROSS_CHECK_MODES
    heads: bool | int | Sequence[int] = CROSS_CHECK_HEADS

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "kinds", _members(
            "kinds", self.kinds, SITE_KINDS, " (the graph has no attention nodes)"))
        object.__setattr__(self, "modes", _members("modes", self.modes, MODES, ""))
        if not isinstance(self.heads, bool | int):
            object.__setattr__(self, "heads", tuple(self.heads))
