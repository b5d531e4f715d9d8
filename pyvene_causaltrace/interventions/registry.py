"""Name → intervention class registry.

Specs name interventions by string; this table turns the string into a pyvene
``Intervention`` subclass. Third-party packages add types either by calling
:func:`register_intervention` or through an entry point in the group
``pyvene_causaltrace.interventions`` (loaded on the first lookup).

    @register_intervention("my_steer")
    class MySteer(pv.Intervention): ...
    get_intervention("my_steer")            # -> MySteer
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pyvene_causaltrace.interventions"

_REGISTRY: dict[str, type] = {}
_entry_points_loaded = False

#: Names kept for types that later milestones add; looking them up says where they come from.
RESERVED: dict[str, str] = {}


class UnknownInterventionError(KeyError):
    """No intervention type is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def register_intervention(name: str, cls: type | None = None, *, replace: bool = False):
    """Register ``cls`` under ``name``; usable as a decorator when ``cls`` is omitted.

    Refuses duplicate names unless ``replace=True`` and reserved names. ``cls`` must subclass
    ``pyvene.Intervention`` so that it runs inside a plain ``pv.IntervenableModel``.
    """

    def add(klass: type) -> type:
        from ..pyvene_compat import import_pyvene

        pv = import_pyvene()
        if not (isinstance(klass, type) and issubclass(klass, pv.Intervention)):
            raise TypeError(f"{klass!r} is not a pyvene Intervention subclass")
        if name in RESERVED:
            raise ValueError(f"{name!r} is reserved: {RESERVED[name]}")
        if name in _REGISTRY and _REGISTRY[name] is not klass and not replace:
            raise ValueError(
                f"an intervention named {name!r} is already registered "
                f"({_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__})"
            )
        _REGISTRY[name] = klass
        return klass

    return add if cls is None else add(cls)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_intervention(entry.name, entry.load())
        except Exception as error:  # a broken plugin must not break the built-ins
            logger.warning("skipping intervention entry point %r: %s", entry.name, error)


def get_intervention(name: str) -> type:
    """The class registered under ``name``; the error lists the known names."""
    from . import _register_builtins

    _register_builtins()
    _load_entry_points()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in RESERVED:
        raise NotImplementedError(f"intervention {name!r} is not available yet: {RESERVED[name]}")
    raise UnknownInterventionError(
        f"unknown intervention type {name!r}; registered: {', '.join(list_interventions())}"
    )


def list_interventions() -> list[str]:
    """Registered names, sorted."""
    from . import _register_builtins

    _register_builtins()
    _load_entry_points()
    return sorted(_REGISTRY)
