"""Every pyvene 0.1.8 type that needs no training, at every site kind we name, inside our runs:
``trace``, ``run_spec`` and ``attribute`` on the user's IntervenableModel equal the same edit
made by a plain hook on the bare model (to 1e-6), or are refused clearly. Not the full product
of types and sites (40 cases per path, each a few runs): a covering set in which every type and
every site appears at least once per path, and every way of refusing (a type that needs a
source, NoiseIntervention's positions, head units, an edit at attention's output in a graph)
at least once. Upstream tensors are never written."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from reference import edit_output

from pyvene_causaltrace import attribute, trace
from pyvene_causaltrace.attribution import ClosureError
from pyvene_causaltrace.attribution.attribute import make_target
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.execute import run_spec
from pyvene_causaltrace.models import PyveneModelError, get_module
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.pyvene_boundary.user_edits import applied_interventions
from pyvene_causaltrace.transcoders import load_transcoder

pv = import_pyvene()
HIDDEN, LAYER = 32, 1
CONSTANT = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(11)) * 0.7

#: site kind -> (pyvene component, unit, the module a hand hook edits, pre-hook?)
SITES = {
    "block_input": ("block_input", "pos", f"model.layers[{LAYER}]", True),
    "block_output": ("block_output", "pos", f"model.layers[{LAYER}]", False),
    "attention_output": ("attention_output", "pos", f"model.layers[{LAYER}].self_attn", False),
    "mlp_output": ("mlp_output", "pos", f"model.layers[{LAYER}].mlp", False),
    "head_units": ("head_attention_value_output", "h.pos",
                   f"model.layers[{LAYER}].self_attn.o_proj", True),
}

#: type -> (build the intervention, the same edit by hand, or the refusal's words)
TYPES = {
    "Vanilla": (lambda: pv.VanillaIntervention(), "need a source at call time"),
    "Vanilla(constant source)": (
        lambda: pv.VanillaIntervention(source_representation=CONSTANT, embed_dim=HIDDEN),
        lambda x: CONSTANT.expand_as(x).clone()),
    "Zero": (lambda: pv.ZeroIntervention(embed_dim=HIDDEN), torch.zeros_like),
    "Addition": (lambda: pv.AdditionIntervention(source_representation=CONSTANT,
                                                  embed_dim=HIDDEN),
                 lambda x: x + CONSTANT),
    "Subtraction": (lambda: pv.SubtractionIntervention(source_representation=CONSTANT,
                                                        embed_dim=HIDDEN),
                    lambda x: x - CONSTANT),
    "Collect": (lambda: pv.CollectIntervention(), lambda x: x),
    "NoiseIntervention": (lambda: pv.NoiseIntervention(embed_dim=HIDDEN), "4 positions"),
    "Skip": (lambda: pv.SkipIntervention(), "need a source at call time"),
}

SPEC = {"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT, "interventions": [
    {"type": "noise_add", "seeds": [0, 1], "scale": 3.0, "sigma": 0.5},
    {"type": "clean_restore", "component": "block_output", "layers": [2], "positions": "last"}]}


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", init=0.2)


@pytest.fixture(scope="module")
def clt(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix_clt")
    return load_transcoder(str(write_clt(root / "clt", random_clt_tensors(3, HIDDEN, 16))))


def hand_edit(model, module_path: str, pre: bool, edit):
    """``edit`` on the module's input (pre) or output, returning a new tensor."""
    if not pre:
        return edit_output(model, module_path, edit)
    return _edit_input(model, module_path, edit)


@contextmanager
def _edit_input(model, module_path: str, edit):
    module = get_module(model, module_path)
    handle = module.register_forward_pre_hook(lambda m, args: (edit(args[0]), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def _user_model(model, kind: str, site: str):
    """(the user's IntervenableModel with ``kind`` at ``site``, the hand edit, the words of
    its refusal in our runs or None)."""
    component, unit, module_path, pre = SITES[site]
    build, expected = TYPES[kind]
    pv_model = pv.IntervenableModel([{"layer": LAYER, "component": component, "unit": unit,
                                      "intervention": build()}], model)
    refusal = (expected if isinstance(expected, str)
               else "picks heads through unit_locations" if unit != "pos" else None)
    return pv_model, (lambda: hand_edit(model, module_path, pre, expected)), refusal


def _results(model, tokenizer):
    return (trace(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0).restored_probs,
            run_spec(SPEC, model, tokenizer).intervened_probs)


#: (type, site) cases for trace + run_spec: the refusals first, then the edits that run.
RUN_CASES = [
    ("Vanilla", "block_input"),                    # needs a source at call time
    ("Skip", "mlp_output"),                        # needs a source at call time
    ("NoiseIntervention", "attention_output"),     # its positions
    ("Zero", "head_units"),                        # heads through unit_locations
    ("Vanilla(constant source)", "block_output"),
    ("Zero", "block_input"),                       # a pre-hook site
    ("Addition", "attention_output"),
    ("Subtraction", "mlp_output"),
    ("Collect", "block_output"),                   # the one edit that changes nothing
    ("Subtraction", "block_input"),
]
#: (type, site) cases for attribute: the same refusals at other sites, an edit at attention's
#: output refused by the closure check (Collect there is no edit, and runs), the rest run.
GRAPH_CASES = [
    ("Skip", "block_input"),
    ("Vanilla", "attention_output"),
    ("NoiseIntervention", "mlp_output"),
    ("Addition", "head_units"),
    ("Zero", "attention_output"),                  # ClosureError, naming block_output
    ("Collect", "attention_output"),
    ("Vanilla(constant source)", "mlp_output"),
    ("Zero", "block_output"),
    ("Addition", "block_input"),
    ("Subtraction", "block_output"),
]


@pytest.mark.parametrize("cases", [RUN_CASES, GRAPH_CASES], ids=["runs", "graphs"])
def test_the_cases_cover_every_type_site_and_refusal(cases):
    assert {kind for kind, _ in cases} == set(TYPES)
    assert {site for _, site in cases} == set(SITES)
    refusing = {kind for kind, (_, expected) in TYPES.items() if isinstance(expected, str)}
    assert refusing <= {kind for kind, site in cases if site != "head_units"}
    assert any(kind not in refusing for kind, site in cases if site == "head_units")


@pytest.fixture(scope="module")
def plain_results(model, tokenizer):
    """The bare model's trace and run_spec (what every edit but collecting changes)."""
    return _results(model, tokenizer)


@pytest.mark.parametrize("kind,site", RUN_CASES, ids=[f"{k}-{s}" for k, s in RUN_CASES])
@pytest.mark.numerics
def test_a_users_intervention_in_our_runs_is_the_hand_edit_or_refused(model, tokenizer, kind,
                                                                      site, plain_results):
    pv_model, by_hand, refusal = _user_model(model, kind, site)
    if refusal is not None:
        with pytest.raises(PyveneModelError, match=refusal):
            trace(pv_model, tokenizer, PROMPT, SUBJECT, seeds=2, scale=3.0)
        with pytest.raises(PyveneModelError, match=refusal):
            run_spec(SPEC, pv_model, tokenizer)
        return
    got = _results(pv_model, tokenizer)
    with by_hand():
        want = _results(model, tokenizer)
    for name, a, b in zip(("trace", "run_spec"), got, want, strict=True):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=0, atol=1e-6,
                                   msg=f"{kind} at {site}: {name}")
    plain = plain_results
    changed = not torch.allclose(torch.as_tensor(plain[0]), torch.as_tensor(want[0]), atol=1e-4)
    assert changed == (kind != "Collect")  # every edit but collecting changes the trace


@pytest.mark.parametrize("kind", ["Zero", "Addition", "Subtraction", "Vanilla(constant source)"])
def test_upstream_tensors_are_never_written(model, tokenizer, kind):
    """At a pre-hook site (block l's input is block l-1's output), the tensor block l-1
    returned is unchanged after our runs apply the user's edit."""
    pv_model = pv.IntervenableModel([{"layer": LAYER, "component": "block_input",
                                      "intervention": TYPES[kind][0]()}], model)
    upstream = get_module(model, f"model.layers[{LAYER - 1}]")
    seen = {}

    def keep(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        seen["tensor"], seen["copy"] = hidden, hidden.clone()

    handle = upstream.register_forward_hook(keep)
    try:
        with applied_interventions(bind(pv_model, interventions=True)) as inner, torch.no_grad():
            inner(input_ids=tokenizer(PROMPT, return_tensors="pt")["input_ids"])
    finally:
        handle.remove()
    assert torch.equal(seen["tensor"], seen["copy"])


@pytest.mark.parametrize("kind,site", GRAPH_CASES, ids=[f"{k}-{s}" for k, s in GRAPH_CASES])
@pytest.mark.numerics
def test_a_users_intervention_in_a_graph_is_the_hand_edit_or_refused(model, clt, tokenizer,
                                                                     kind, site):
    """``attribute`` on the user's model: the graph's target and P(answer) are those of the
    bare model with the same edit by hand, and the graph closes (the edit's constant part a
    steering node). An edit at attention's output, which the local replacement model
    recomputes with its pattern frozen (keeping the edited value, not the edit's gradient), is
    refused by the closure check, naming the intervention and where to put it instead."""
    pv_model, by_hand, refusal = _user_model(model, kind, site)
    if refusal is not None:
        with pytest.raises(PyveneModelError, match=refusal):
            attribute(pv_model, tokenizer, clt, PROMPT)
        return
    if site == "attention_output" and kind != "Collect":
        with pytest.raises(ClosureError, match=r"attention_output(.|\n)*block_output"):
            attribute(pv_model, tokenizer, clt, PROMPT)
        return
    graph = attribute(pv_model, tokenizer, clt, PROMPT)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with by_hand(), torch.no_grad():
        logits = model(input_ids=ids).logits
    want = float(make_target(logits, tokenizer, None, kind="demeaned", k=10)(logits))
    assert graph.closure.relative < 1e-4
    # two float32 paths through the model (the graph's, the hand edit's): 1.07e-6 apart on an
    # AMD EPYC, so 1e-5; the edits move the target by far more (the control below)
    tolerance = 1e-5 * max(1.0, abs(want))
    assert abs(graph.closure.target - want) <= tolerance, (graph.closure, want)
    if kind != "Collect":
        with torch.no_grad():
            bare = model(input_ids=ids).logits
        bare_target = make_target(bare, tokenizer, None, kind="demeaned", k=10)
        assert abs(float(bare_target(bare)) - want) > 100 * tolerance
    assert abs(graph.answer_prob - float(logits[0, -1].softmax(-1).max())) < 1e-6
    if graph.n_steering == 0:  # nothing the bare model's graph lacks: the same edges
        with by_hand():
            same = attribute(model, tokenizer, clt, PROMPT)
        torch.testing.assert_close(graph.target_row(), same.target_row(), rtol=0, atol=1e-6)
