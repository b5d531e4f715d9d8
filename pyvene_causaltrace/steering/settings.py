"""How :func:`~.run.intervene_features` steers: :class:`SteeringSettings`, every setting of
``intervene_features()`` but its inputs and ``progress``."""

from __future__ import annotations

from dataclasses import dataclass

from .._settings import Settings
from ..arguments import MemoryMB, NonNegativeInt, PositiveInt
from ..defaults import (
    BOS,
    STEER_FREEZE_ATTENTION,
    STEER_HOLD_ERRORS,
    STEER_MAX_NEW_TOKENS,
    STEER_TOP_K,
)
from ..prompts import check_bos_mode

__all__ = ["SteeringSettings"]


@dataclass(frozen=True)
class SteeringSettings(Settings):
    """The settings of one steering run; ``settings=`` or the same names as keywords
    (defaults: :mod:`~pyvene_causaltrace.defaults`).

    ``max_new_tokens``: greedy tokens generated with the interventions, and as many without
    (0: logits only). ``hold_errors``: transcoder errors at the prompt held at the clean run's
    (False: live, as circuit-tracer's with ``constrained_layers`` unset).
    ``freeze_attention``: prompt attention patterns held at the clean run's. ``top_k``: top
    tokens per run. ``memory_mb``: what one generation step may hold (``None``: the device's).
    ``bos``: one of :data:`~..prompts.BOS_MODES`. A value its annotation does not admit is
    refused when made (:class:`~..errors.InputError`)."""

    max_new_tokens: NonNegativeInt = STEER_MAX_NEW_TOKENS
    hold_errors: bool = STEER_HOLD_ERRORS
    freeze_attention: bool = STEER_FREEZE_ATTENTION
    top_k: PositiveInt = STEER_TOP_K
    memory_mb: MemoryMB | None = None
    bos: str = BOS

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bos_mode(self.bos)
