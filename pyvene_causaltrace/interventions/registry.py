"""Name → intervention class registry.

Specs name interventions by string; this table turns it into a pyvene ``Intervention``
subclass. Other packages add types by :func:`register_intervention` or an entry point in the
group ``pyvene_causaltrace.interventions`` (loaded on the first lookup); the command line
imports the modules named by ``--plugins`` and ``$PVCT_PLUGINS`` (:func:`load_plugins`).

    @register_intervention("my_steer")
    class MySteer(pv.Intervention): ...
    get_intervention("my_steer")            # -> MySteer
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable
from importlib.metadata import entry_points

from ..arguments import checked
from ..errors import InputError, PluginError, UnknownInterventionError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pyvene_causaltrace.interventions"
#: Environment variable naming plugin modules, comma-separated (as ``--plugins``).
PLUGINS_ENV = "PVCT_PLUGINS"

_REGISTRY: dict[str, type] = {}
_entry_points_loaded = False


def plugin_modules(*values: str | Iterable[str] | None) -> list[str]:
    """Module names from comma-separated strings or lists of them, in order, without repeats
    or blanks."""
    parts = [part for value in values if value is not None
             for part in ([value] if isinstance(value, str) else value)]
    return list(dict.fromkeys(name.strip() for part in parts for name in part.split(",")
                              if name.strip()))


def load_plugins(modules: str | Iterable[str] | None = None, *, env: bool = True,
                 source: str = "--plugins") -> list[str]:
    """Import the plugin modules ``modules`` (``"pkg.steer,other"`` or a list) and, with
    ``env``, those in ``$PVCT_PLUGINS`` first; each registers its types when imported (with
    :func:`register_intervention`). Returns the names imported. A module that fails to import
    raises :class:`PluginError` naming it and where it was named (``source`` or the variable).
    """
    named = [(name, PLUGINS_ENV) for name in plugin_modules(os.environ.get(PLUGINS_ENV)
                                                            if env else None)]
    named += [(name, source) for name in plugin_modules(modules)]
    done: list[str] = []
    for name, where in named:
        if name in done:
            continue
        try:
            importlib.import_module(name)
        except Exception as error:  # any failure of a user's module is theirs to fix
            raise PluginError(f"{where}: cannot import plugin module {name!r}: "
                              f"{type(error).__name__}: {error}", name=name) from error
        done.append(name)
    return done


@checked
def register_intervention(name: str, cls: type | None = None, *, replace: bool = False):
    """Register ``cls`` under ``name``; usable as a decorator when ``cls`` is omitted.

    Refuses a name already taken by another class unless ``replace=True``. ``cls`` must
    subclass ``pyvene.Intervention`` so that it runs inside a plain ``pv.IntervenableModel``.
    """

    def add(klass: type) -> type:
        # torch loads on registering, not on import
        from ..pyvene_boundary.quiet_import import import_pyvene

        pv = import_pyvene()
        if not (isinstance(klass, type) and issubclass(klass, pv.Intervention)):
            raise TypeError(f"{klass!r} is not a pyvene Intervention subclass")
        if name in _REGISTRY and _REGISTRY[name] is not klass and not replace:
            raise InputError(
                f"an intervention named {name!r} is already registered "
                f"({_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__})")
        _REGISTRY[name] = klass
        return klass

    return add if cls is None else add(cls)


def _register_builtins() -> None:
    # Checked against the registry itself, not a flag: a test that swaps the registry dict
    # for a copy must not leave the real one empty.
    if "noise_add" in _REGISTRY:
        return
    # the built-in types import pyvene: the registry module stays light for the lazy top level
    from . import clt_splice, feature_ablate, frozen, leaf, lorsa_splice, noise, restore

    for cls in (noise.NoiseAdd, restore.CleanRestore, restore.WindowRestore, restore.Freeze,
                frozen.FrozenLayerNorm, frozen.FrozenAttention, clt_splice.CLTSplice,
                feature_ablate.FeatureAblate, leaf.GradientLeaf, lorsa_splice.LorsaSplice):
        register_intervention(cls.registered_name, cls)


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


@checked
def get_intervention(name: str) -> type:
    """The class registered under ``name``; the error lists the known names."""
    _register_builtins()
    _load_entry_points()
    if name in _REGISTRY:
        return _REGISTRY[name]
    raise UnknownInterventionError(
        f"unknown intervention type {name!r}; registered: {', '.join(list_interventions())}")


def list_interventions() -> list[str]:
    """Registered names, sorted."""
    _register_builtins()
    _load_entry_points()
    return sorted(_REGISTRY)
