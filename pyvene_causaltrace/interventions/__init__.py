"""Registered pyvene intervention types.

=====================  ==========================================================
name                   class
=====================  ==========================================================
``noise_add``          :class:`~.noise.NoiseAdd`
``clean_restore``      :class:`~.restore.CleanRestore`
``window_restore``     :class:`~.restore.WindowRestore`
``freeze``             :class:`~.restore.Freeze`
``frozen_layernorm``   :class:`~.frozen.FrozenLayerNorm`
=====================  ==========================================================

``frozen_attention``, ``clt_splice`` and ``feature_ablate`` are reserved for later milestones.
"""

from __future__ import annotations

from .registry import (
    RESERVED,
    UnknownInterventionError,
    get_intervention,
    list_interventions,
    register_intervention,
)

_builtins_registered = False


def _register_builtins() -> None:
    global _builtins_registered
    if _builtins_registered:
        return
    _builtins_registered = True
    from .frozen import FrozenLayerNorm
    from .noise import NoiseAdd
    from .restore import CleanRestore, Freeze, WindowRestore

    for cls in (NoiseAdd, CleanRestore, WindowRestore, Freeze, FrozenLayerNorm):
        register_intervention(cls.registered_name, cls)


__all__ = [
    "RESERVED",
    "UnknownInterventionError",
    "get_intervention",
    "list_interventions",
    "register_intervention",
]
