"""Registered pyvene intervention types, one family a module (the table of names and classes:
docs/interventions.md); the registry: :mod:`.registry`."""

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
