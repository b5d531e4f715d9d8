"""pyvene hands an intervention only the module's output; :func:`pyvene_call` gives the hooked
module, its inputs and the call's unit_locations — from the closure of pyvene's hook in our
IntervenableModel, from pyvene's hook frame in a plain one. If a pyvene release moves them, this
test says so by name (frozen_layernorm, frozen_attention and positions during generate depend on
it)."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from _support.models import make_tiny_model

from pyvene_causaltrace.models import get_module
from pyvene_causaltrace.pyvene_compat import (
    import_pyvene,
    intervenable_model_class,
    pyvene_call,
)

pv = import_pyvene()
CHANGED = (f"pyvene {version('pyvene')} changed the hook frame that calls an intervention "
           "(pyvene_compat.pyvene_call reads hook_callback(model, args, kwargs, output) in "
           "_intervention_setter, with unit_locations_base, key_i and key in scope, as of "
           "0.1.8): ")


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
    with torch.no_grad():  # a plain one bare (no preserve_hooks): pyvene_call reads its frames
        pv_model(base={"input_ids": ids}, unit_locations=unit_locations)
    if len(recorder.calls) != 1:
        pytest.fail(CHANGED + f"the intervention ran {len(recorder.calls)} times, not once")
    call, handed = recorder.calls[0]
    if call is None:
        pytest.fail(CHANGED + "pyvene_call() found no such frame above the intervention")
    return model, pv_model, call, handed


@pytest.mark.parametrize("ours", [False, True])
def test_pyvene_call_finds_the_module_its_inputs_and_the_locations(ours):
    model, pv_model, call, handed = _run(ours, "model.layers[1].mlp.output",
                                         {"base": [[[1, 2]]]})
    mlp = get_module(model, "model.layers[1].mlp")
    assert call.module is mlp, CHANGED + f"the frame's module is {type(call.module).__name__}"
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


def test_our_intervenable_model_announces_the_call_and_reads_no_frame(monkeypatch):
    """In our IntervenableModel the wrapper around pyvene's hook gives pyvene_call what the
    frame would: the frames are read only for a user's plain pv.IntervenableModel."""
    import pyvene_causaltrace.pyvene_compat as compat

    def no_frames():
        raise AssertionError("pyvene_call read the frames inside our IntervenableModel")

    monkeypatch.setattr(compat, "_call_from_frames", no_frames)
    for component, locations, where in (("model.layers[1].mlp.output", {"base": [[[1, 2]]]},
                                         "model.layers[1].mlp"),
                                        ("model.layers[1].input", None, "model.layers[1]")):
        model, pv_model, call, _ = _run(True, component, locations)
        assert call.module is get_module(model, where) and call.owner is pv_model
        assert call.key in pv_model.interventions
