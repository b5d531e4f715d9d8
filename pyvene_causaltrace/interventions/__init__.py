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
``feature_ablate``     :class:`~.feature_ablate.FeatureAblate`
``gradient_leaf``      :class:`~.leaf.GradientLeaf`
=====================  ==========================================================
"""

from __future__ import annotations

from .registry import (
    UnknownInterventionError,
    get_intervention,
    list_interventions,
    register_intervention,
)

__all__ = [
    "UnknownInterventionError",
    "get_intervention",
    "list_interventions",
    "register_intervention",
]
