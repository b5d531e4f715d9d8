"""Registered pyvene intervention types.

=====================  ==========================================================
name                   class
=====================  ==========================================================
``noise_add``          :class:`~.noise.NoiseAdd`
``clean_restore``      :class:`~.restore.CleanRestore`
``window_restore``     :class:`~.restore.WindowRestore`
``freeze``             :class:`~.restore.Freeze`
``frozen_layernorm``   :class:`~.frozen.FrozenLayerNorm`
``frozen_attention``   :class:`~.frozen.FrozenAttention`
``clt_splice``         :class:`~.clt_splice.CLTSplice`
``feature_ablate``     :class:`~.clt_splice.FeatureAblate`
``gradient_leaf``      :class:`~.leaf.GradientLeaf`
=====================  ==========================================================
"""

from __future__ import annotations

from .registry import (
    RESERVED,
    UnknownInterventionError,
    get_intervention,
    list_interventions,
    register_intervention,
)


def _register_builtins() -> None:
    # Checked against the registry itself, not a flag: a test that swaps the registry dict
    # for a copy must not leave the real one empty.
    from . import registry

    if "noise_add" in registry._REGISTRY:
        return
    from .clt_splice import CLTSplice, FeatureAblate
    from .frozen import FrozenAttention, FrozenLayerNorm
    from .leaf import GradientLeaf
    from .noise import NoiseAdd
    from .restore import CleanRestore, Freeze, WindowRestore

    for cls in (NoiseAdd, CleanRestore, WindowRestore, Freeze, FrozenLayerNorm,
                FrozenAttention, CLTSplice, FeatureAblate, GradientLeaf):
        register_intervention(cls.registered_name, cls)


__all__ = [
    "RESERVED",
    "UnknownInterventionError",
    "get_intervention",
    "list_interventions",
    "register_intervention",
]
