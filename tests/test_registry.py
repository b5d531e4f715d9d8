"""The name -> class registry."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from pyvene_causaltrace.interventions import (
    UnknownInterventionError,
    get_intervention,
    list_interventions,
    register_intervention,
    registry,
)
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

pv = import_pyvene()
BUILTINS = {"noise_add", "clean_restore", "window_restore", "freeze", "frozen_layernorm",
            "clt_splice", "feature_ablate"}


def test_builtins_are_registered_pyvene_interventions():
    assert BUILTINS <= set(list_interventions())
    for name in BUILTINS:
        cls = get_intervention(name)
        assert issubclass(cls, pv.Intervention) and cls.registered_name == name


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownInterventionError) as error:
        get_intervention("noise_ad")
    assert "noise_add" in str(error.value) and "clean_restore" in str(error.value)


def test_third_party_registration_and_duplicates(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_intervention("my_vanilla")
    class MyVanilla(pv.VanillaIntervention):
        pass

    assert get_intervention("my_vanilla") is MyVanilla
    with pytest.raises(ValueError, match="already registered"):
        register_intervention("my_vanilla", pv.VanillaIntervention)
    register_intervention("my_vanilla", pv.VanillaIntervention, replace=True)
    assert get_intervention("my_vanilla") is pv.VanillaIntervention
    with pytest.raises(TypeError, match="not a pyvene Intervention"):
        register_intervention("not_one", dict)


def test_entry_points_are_loaded_on_first_lookup(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    points = [EntryPoint("plugin_zero", "pyvene:ZeroIntervention", registry.ENTRY_POINT_GROUP),
              EntryPoint("plugin_broken", "no_such_module:Thing", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: points)
    assert get_intervention("plugin_zero") is pv.ZeroIntervention
    assert "plugin_broken" not in list_interventions()
