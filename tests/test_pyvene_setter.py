"""pyvene hands an intervention only the module's output; :func:`pyvene_call` gives the hooked
module, its inputs and the call's unit_locations, announced by ``announcing_setter`` around
pyvene's ``_intervention_setter``, our IntervenableModel's own setter (a user's plain
``pv.IntervenableModel`` announces nothing, and the types that need the call refuse there). If a
pyvene release moves them, this test says so by name (frozen_layernorm, frozen_attention and
positions with unit_locations or during generate depend on it)."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from _support.models import make_tiny_model

from pyvene_causaltrace.models import get_module
from pyvene_causaltrace.pyvene_boundary.calls import pyvene_call
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

pv = import_pyvene()
CHANGED = (f"pyvene {version('pyvene')} changed the hook that calls an intervention "
           "(pyvene_boundary.calls.announcing_setter wraps the hooks that "
           "IntervenableModel._intervention_setter(keys, unit_locations_base, ...) registers "
           "through intervention_hooks[key], one per key, each called as hook(module, args, "
           "kwargs, output), as of 0.1.8): ")


class _Recorder(pv.ConstantSourceIntervention, pv.LocalistRepresentationIntervention):
    """Leaves the output as it is; records what pyvene_call finds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list = []

    def forward(self, base, source=None, subspaces=None, **kwargs):
        self.calls.append((pyvene_call(), base.clone()))
        return base


def _run(ours: bool, component: str, unit_locations):
    model = make_tiny_model("llama")
    recorder = _Recorder()
    reps = [{"component": component, "intervention": recorder}]
    if ours:
        pv_model = intervenable_model_class()(reps, model)
    else:
        pv_model = pv.IntervenableModel(reps, model)
    ids = torch.randint(1, 400, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a plain one bare (no preserve_hooks)
        pv_model(base={"input_ids": ids}, unit_locations=unit_locations)
    if len(recorder.calls) != 1:
        pytest.fail(CHANGED + f"the intervention ran {len(recorder.calls)} times, not once")
    call, handed = recorder.calls[0]
    if call is None:
        pytest.fail(CHANGED + "pyvene_call() was not announced to the intervention")
    return model, pv_model, call, handed


def test_pyvene_call_finds_the_module_its_inputs_and_the_locations():
    model, pv_model, call, handed = _run(True, "model.layers[1].mlp.output",
                                         {"base": [[[1, 2]]]})
    mlp = get_module(model, "model.layers[1].mlp")
    assert call.module is mlp, CHANGED + f"the announced module is {type(call.module).__name__}"
    assert call.unit_locations == [[1, 2]], CHANGED + f"unit_locations {call.unit_locations!r}"
    assert call.owner is pv_model and call.key in pv_model.interventions, CHANGED + "owner/key"
    assert not call.generating
    with torch.no_grad():
        recomputed = call.module(*call.args, **call.kwargs)
    # the inputs found recompute exactly the output pyvene handed (its positions 1 and 2)
    assert torch.equal(recomputed[:, [1, 2]], handed), CHANGED + "args/kwargs are not the inputs"


def test_pyvene_call_at_an_input_site_finds_the_module():
    model, _, call, handed = _run(True, "model.layers[1].input", None)
    assert call.module is get_module(model, "model.layers[1]"), CHANGED + "pre-hook module"
    first = call.args[0] if call.args else next(iter(call.kwargs.values()))
    assert torch.equal(first, handed), CHANGED + "the pre-hook's input"


def test_outside_pyvene_there_is_no_call():
    assert pyvene_call() is None


def test_only_our_model_announces_and_its_register_methods_come_back():
    """A user's plain ``pv.IntervenableModel`` announces nothing (pyvene's class is left as it
    is); ours does, and its ``intervention_hooks`` hold the register methods they held (our
    recording ones, around pyvene's bound methods) again after each call."""
    assert not hasattr(pv.IntervenableModel._intervention_setter, "__wrapped__")
    model, pv_model, call, _ = _run(True, "model.layers[1].mlp.output", None)
    assert call is not None
    for key, method in pv_model.intervention_hooks.items():
        assert method.__self__ is get_module(model, "model.layers[1].mlp"), key
        assert method.register.__func__ is torch.nn.Module.register_forward_hook, key

    recorder = _Recorder()
    bare = pv.IntervenableModel([{"component": "model.layers[1].mlp.output",
                                  "intervention": recorder}], make_tiny_model("llama"))
    with torch.no_grad():
        bare(base={"input_ids": torch.ones(1, 4, dtype=torch.long)})
    assert [found for found, _ in recorder.calls] == [None]
