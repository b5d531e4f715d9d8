"""Our types inside plain pyvene: next to pyvene's own interventions, through pyvene's
save/load in a fresh process, and leaving the user's model working afterwards."""

from __future__ import annotations

import re

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from reference import add_at, edit_output, recipe_noise, reload_in_fresh_process

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.capture import capture
from pyvene_causaltrace.execute import run_spec
from pyvene_causaltrace.interventions.frozen import FrozenAttention, FrozenLayerNorm
from pyvene_causaltrace.interventions.leaf import GradientLeaf
from pyvene_causaltrace.interventions.noise import NoiseAdd
from pyvene_causaltrace.interventions.restore import CleanRestore, Freeze, WindowRestore
from pyvene_causaltrace.models import get_adapter, get_module
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

pv = import_pyvene()
SEQ = 6


def _ids(model, seed=0, rows=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, model.config.vocab_size, (rows, SEQ), generator=g)


def _noise_and_edit_by_hand(model, ids, seed, noised, block, edit):
    """Logits with recipe noise (scale 3, sigma 0.4) at ``noised`` and ``edit`` on ``block``,
    with plain hooks."""
    adapter = get_adapter(model)
    delta = recipe_noise(seed, len(noised), bind(model).d_model, 3.0, 0.4)
    with edit_output(model, adapter.embed, add_at(delta, noised)), \
            edit_output(model, block, edit), torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "qwen3"])
@pytest.mark.numerics
def test_with_vanilla_intervention_equals_both_by_hand(arch):
    model = make_tiny_model(arch)
    adapter = get_adapter(model)
    block = adapter.module_path("block", 2)
    base, source = _ids(model, 0), _ids(model, 1)
    pv_model = intervenable_model_class()([  # own positions: ours (pyvene's refuses them)
        {"component": adapter.embed + ".output",
         "intervention": NoiseAdd(seeds=[7], positions=[1, 2], scale=3.0, sigma=0.4)},
        {"component": block + ".output", "intervention_type": pv.VanillaIntervention},
    ], model)
    with torch.no_grad():
        _, out = pv_model(
            base={"input_ids": base}, sources=[None, {"input_ids": source}],
            unit_locations={"sources->base": ([None, [[3, 4]]], [None, [[3, 4]]])},
        )
    donor = capture(model, {"input_ids": source}, [block + ".output"])[block + ".output"]

    def swap(output):
        output = output.clone()
        output[:, [3, 4]] = donor[:, [3, 4]]
        return output

    expected = _noise_and_edit_by_hand(model, base, 7, [1, 2], block, swap)
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=0)


@pytest.mark.numerics
def test_with_rotated_space_intervention_equals_both_by_hand():
    model = make_tiny_model("llama")
    adapter = get_adapter(model)
    base, source = _ids(model, 0), _ids(model, 1)
    pv_model = intervenable_model_class()([  # own positions: ours (pyvene's refuses them)
        {"component": adapter.embed + ".output",
         "intervention": NoiseAdd(seeds=[2], positions=[0, 1], scale=3.0, sigma=0.4)},
        {"layer": 1, "component": "block_output", "intervention_type":
         pv.RotatedSpaceIntervention},
    ], model)
    rotated = list(pv_model.interventions.values())[1]
    rotated.set_interchange_dim(8)
    with torch.no_grad():
        _, out = pv_model(
            base={"input_ids": base}, sources=[None, {"input_ids": source}],
            unit_locations={"sources->base": ([None, [[5]]], [None, [[5]]])},
        )
        rotation = rotated.rotate_layer.weight.detach()
    block = adapter.module_path("block", 1)
    donor = capture(model, {"input_ids": source}, [block + ".output"])[block + ".output"]

    def rotate_swap(output):
        output = output.clone()
        b, s = output[:, 5] @ rotation, donor[:, 5] @ rotation
        b[:, :8] = s[:, :8]
        output[:, 5] = b @ rotation.T
        return output

    expected = _noise_and_edit_by_hand(model, base, 2, [0, 1], block, rotate_swap)
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=0)


def _every_type(model):
    """One instance of every registered type on a tiny Llama, as representation dicts."""
    adapter = get_adapter(model)
    ids = _ids(model, 0, rows=2)
    clean = capture(model, {"input_ids": ids[:1]},
                    [adapter.module_path("block", 0) + ".output",
                     adapter.module_path("mlp", 1) + ".output"])
    other = capture(model, {"input_ids": _ids(model, 5)},
                    [adapter.module_path("attn", 2) + ".output"])
    return ids, [
        {"component": adapter.embed + ".output",
         "intervention": NoiseAdd(seeds=[1, 2], positions=[[0, 1], [2]], scale=4.0, sigma=0.3,
                                  distribution="uniform")},
        {"component": adapter.module_path("block", 0) + ".output",
         "intervention": CleanRestore(positions=[[1], []],
                                      states=clean[adapter.module_path("block", 0) + ".output"])},
        {"component": adapter.module_path("mlp", 1) + ".output",
         "intervention": WindowRestore(positions=[2, 3],
                                       states=clean[adapter.module_path("mlp", 1) + ".output"],
                                       sublayer="mlp", window_layer=1, center=1, window=3)},
        {"component": adapter.module_path("attn", 2) + ".output",
         "intervention": Freeze(positions=[[4], [5]],
                                states=other[adapter.module_path("attn", 2) + ".output"],
                                run="other")},
        {"component": adapter.module_path("pre_mlp_norm", 2) + ".output",
         "intervention": FrozenLayerNorm(kind=adapter.norm_kind)},
        {"component": adapter.module_path("attn", 1) + ".output",
         "intervention": FrozenAttention()},
        {"component": adapter.module_path("mlp", 0) + ".output",
         "intervention": GradientLeaf()},
    ]


@pytest.mark.process
@pytest.mark.numerics
def test_pyvene_save_then_load_in_a_fresh_process_reproduces_logits(tmp_path):
    model = make_tiny_model("llama")
    ids, representations = _every_type(model)
    pv_model = intervenable_model_class()(representations, model)
    with torch.no_grad():
        changed = pv_model(base={"input_ids": ids})[1].logits - model(input_ids=ids).logits
    assert changed.abs().max() > 1e-3
    names, equal, refusal = reload_in_fresh_process(tmp_path, model, pv_model, ids)
    assert names == ["CleanRestore", "Freeze", "FrozenAttention", "FrozenLayerNorm",
                     "GradientLeaf", "NoiseAdd", "WindowRestore"]
    assert equal
    # pyvene's own load gives its own class, which refuses the first type needing ours
    assert re.fullmatch(r"PyveneModelError: noise_add has its own positions.*load a saved one "
                        r"with pyvene_causaltrace\.IntervenableModel\.load\(\.\.\.\), not "
                        r"pv\.IntervenableModel\.load", refusal), refusal


def test_state_dict_round_trip_restores_config_and_tensors():
    noise = NoiseAdd(seeds=[4, 5], positions=[[1], [0, 2]], scale=2.5, sigma=0.1)
    fresh = NoiseAdd()
    fresh.load_state_dict(noise.state_dict())
    assert fresh.config() == noise.config()
    assert torch.equal(fresh.seeds, noise.seeds) and torch.equal(fresh.positions, noise.positions)
    with pytest.raises(RuntimeError, match="noise_add"):
        CleanRestore().load_state_dict(noise.state_dict())


def test_user_model_still_works_after_our_calls(tokenizer):
    model = make_tiny_model("llama")
    seen = []
    handle = get_module(model, "model.layers.1").register_forward_hook(
        lambda *_: seen.append(1))
    flags = [p.requires_grad for p in model.parameters()]
    spec = {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT, "interventions": [
        {"type": "noise_add", "seeds": 2},
        {"type": "clean_restore", "layers": 1, "positions": "last"},
        {"type": "frozen_layernorm"}]}
    run_spec(spec, model, tokenizer)
    out = model(input_ids=_ids(model), output_hidden_states=True)
    assert out.hidden_states is not None and len(out.hidden_states) == 4
    before = len(seen)
    model(input_ids=_ids(model))
    assert len(seen) == before + 1  # the user's hook survived
    assert [p.requires_grad for p in model.parameters()] == flags
    handle.remove()
    model(input_ids=_ids(model))
    assert len(seen) == before + 1  # and its handle still removes it


@pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                    reason="transformers 4 returns hidden states without forward hooks, so "
                           "pyvene's hook removal cannot break them")
def test_plain_pyvene_breaks_hidden_states_and_preserve_hooks_mends_it():
    """The fact behind IntervenableModel/preserve_hooks, so the test above can fail."""
    from pyvene_causaltrace.pyvene_boundary.intervenable import preserve_hooks

    model = make_tiny_model("llama")
    model(input_ids=_ids(model), output_hidden_states=True)  # transformers installs its hooks
    pv_model = pv.IntervenableModel(
        [{"component": "model.layers[0].output",
          "intervention": CleanRestore(states=torch.zeros(1, SEQ, 32))}], model)
    with preserve_hooks(pv_model):
        pv_model(base={"input_ids": _ids(model)})
    assert len(model(input_ids=_ids(model), output_hidden_states=True).hidden_states) == 4
    pv_model(base={"input_ids": _ids(model)})
    broken = model(input_ids=_ids(model), output_hidden_states=True).hidden_states
    assert not broken
