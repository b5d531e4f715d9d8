"""The spec layer asks the registry: each type's own schema, sites and build; plugin types in
exactly the built-ins' shape; every instance writes back the entry that rebuilds it."""

from __future__ import annotations

import json

import pytest
import torch
from _support.data import tool
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace.execute import build_interventions
from pyvene_causaltrace.interventions import get_intervention, list_interventions, registry
from pyvene_causaltrace.interventions.spec_entry import entry_of
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.specs import SCHEMA_PATH, SpecError, entry_schemas, validate_spec

pv = import_pyvene()


def _spec(*entries, **fields):
    return {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
            "interventions": list(entries), **fields}


def test_shipped_schema_is_written_from_the_registered_types(tmp_path):
    """spec.schema.json's per-type branches are each type's spec_schema() (regenerate with
    python tools/write_schema.py)."""
    shipped = json.loads(SCHEMA_PATH.read_text())
    assert shipped["$defs"]["intervention"] == json.loads(json.dumps(entry_schemas()))
    copy = tmp_path / "spec.schema.json"
    copy.write_text(SCHEMA_PATH.read_text())
    tool("write_schema").write_schema(copy)
    assert json.loads(copy.read_text()) == shipped  # the tool writes the shipped file


def test_every_registered_type_works_in_a_spec_or_is_refused_with_its_reason(tokenizer):
    model = make_tiny_model("llama")
    for name in list_interventions():
        entry = entry_of(get_intervention(name))
        if entry.spec_refusal:
            with pytest.raises(SpecError, match=r"\$\.interventions\[0\]\.type: .*attribution"):
                validate_spec(_spec({"type": name}))
            continue
        assert entry.spec_schema()["properties"]["type"] is True, name
    noise = {"type": "noise_add", "seeds": [0, 1], "sigma": 0.5}
    plan = build_interventions(_spec(
        noise, {"type": "clean_restore", "layers": [1], "positions": "last"},
        {"type": "window_restore", "sublayer": "attn", "center": 1, "window": 2,
         "positions": [2]},
        {"type": "freeze", "component": "mlp_output", "positions": "last"},
        {"type": "frozen_layernorm", "norms": ["pre_mlp", "final"], "layers": [0]}),
        model, tokenizer)
    kinds = [made.registered_name for _, made in plan.interventions]
    assert kinds == ["noise_add", "clean_restore", "window_restore", "window_restore",
                     "freeze", "freeze", "freeze", "frozen_layernorm", "frozen_layernorm"]


def test_each_instance_writes_back_the_entry_that_rebuilds_it(tokenizer):
    model = make_tiny_model("qwen3")
    plan = build_interventions(_spec(
        {"type": "noise_add", "seeds": 2, "sigma": 0.5},
        {"type": "clean_restore", "component": "attn_output", "layers": "all",
         "positions": "subject"},
        {"type": "freeze", "component": "resid_mid", "layers": [2], "positions": [1, 3]},
        {"type": "frozen_layernorm", "layers": [1]}), model, tokenizer)
    entries = plan.to_spec()
    noise, rest = entries[0], entries[1:]
    for (component, made), entry in zip(plan.interventions[1:], rest, strict=True):
        again = build_interventions(_spec(noise, entry), model, tokenizer)
        [(component2, made2)] = again.interventions[1:]
        assert component2 == component and made2.config() == made.config()
        for key, value in made.state_dict().items():
            assert torch.equal(value, made2.state_dict()[key]), (entry, key)
    assert build_interventions(_spec(noise), model, tokenizer).interventions[0][1].config() == \
        plan.interventions[0][1].config()


def test_plugin_types_have_the_builtins_shape(tokenizer, monkeypatch):
    """A registered plain pyvene type (pyvene's own ZeroIntervention) takes component and
    layers as the built-ins do, and acts at every position (other positions are refused)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register_intervention("zero", pv.ZeroIntervention)
    model = make_tiny_model("llama")
    plan = build_interventions(_spec({"type": "zero", "component": "mlp_output",
                                      "layers": [0, 2]}), model, tokenizer)
    assert [(c, type(m).__name__) for c, m in plan.interventions] == [
        ("model.layers[0].mlp.output", "ZeroIntervention"),
        ("model.layers[2].mlp.output", "ZeroIntervention")]
    with pytest.raises(SpecError, match=r"\$\.interventions\[0\]\.positions"):
        validate_spec(_spec({"type": "zero", "component": "mlp_output", "layers": [0],
                             "positions": "last"}))


def test_cross_entry_rules_come_from_the_types():
    noise = {"type": "noise_add", "seeds": 1}
    with pytest.raises(SpecError, match=r"\$\.interventions\[1\]: a spec has at most one "
                                        "noise_add"):
        validate_spec(_spec(noise, noise))
    with pytest.raises(SpecError, match="feature_ablate acts inside a clt_splice"):
        validate_spec(_spec({"type": "feature_ablate", "clt_layer": 0, "features": [1]}))
    with pytest.raises(SpecError, match=r"\$\.interventions\[0\]\.scale: 'auto' is for trace"):
        validate_spec(_spec({"type": "noise_add", "seeds": 1, "scale": "auto"}))
