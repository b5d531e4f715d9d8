"""The one applier (:mod:`pyvene_causaltrace.applier`): every edit of every forward we run goes
through it, one hook per site whatever number of edits target it, by one rule.

- The rule: an edit's new value replaces the site's (the module's tensor is not written), except
  at a residual-stream input, where the new value is copied into the stream (the residual add
  reads it) — shown on a tiny Llama against a hand-written forward.
- Order: edits run in the order added, readers last; groups filter on replayed blocks.
- The public calls (``trace()`` of every kind, ``trace_heads()``, ``attribute()``, with and
  without a user's pyvene interventions) put at most one hook of ours on any site in any
  forward; a control shows the counter sees two where there are two.
"""

from __future__ import annotations

import pytest
import torch
from _support.forwards import observe, snapshot
from _support.hooks import edits_on, installed
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace import Tracer, trace
from pyvene_causaltrace.applier import Edit, Site, applying, only, reader
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.transcoders import load_from_disk


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    model = make_tiny_model("llama", init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path_factory.mktemp("applier") / "clt",
                                       random_clt_tensors(3, 32, 48, threshold=0.1))))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return model, tokenizer, clt, ids


def test_an_output_edit_replaces_and_leaves_the_modules_tensor_alone(world):
    model, _, _, ids = world
    bound = bind(model)
    seen = {}

    def double(value, _call):
        seen["original"] = value
        return value * 2

    after = {}
    with applying(model, [Edit(bound.at("mlp", 1), double),
                          reader(bound.at("mlp", 1), after, "mlp")]), torch.no_grad():
        model(input_ids=ids)
    assert torch.equal(after["mlp"], seen["original"] * 2)  # the reader sees the new value
    with torch.no_grad():  # the tensor the MLP made is not written
        assert torch.equal(seen["original"], model.model.layers[1].mlp(
            model.model.layers[1].post_attention_layernorm(_resid_mid(model, ids, 1))))


def _resid_mid(model, ids, layer):
    found = {}
    bound = bind(model)
    with applying(model, [reader(bound.at("pre_mlp_norm", layer, "input"), found, "x")]), \
            torch.no_grad():
        model(input_ids=ids)
    return found["x"]


def test_a_residual_stream_input_edit_reaches_the_stream(world):
    """resid_mid edited: the MLP's norm and the residual add both see the new value, as pyvene
    writes it; the block's output moves by exactly the added amount plus the MLP's change."""
    model, _, _, ids = world
    bound = bind(model)
    site = bound.at("pre_mlp_norm", 1, "input")
    assert site.stream and not bound.at("mlp", 1, "input").stream
    shift = torch.full((bound.d_model,), 0.25)
    outputs = {}
    with applying(model, [Edit(site, lambda value, _call: value + shift),
                          reader(bound.at("block", 1), outputs, "block"),
                          reader(bound.at("mlp", 1), outputs, "mlp")]), torch.no_grad():
        model(input_ids=ids)
    stream = _resid_mid(model, ids, 1) + shift
    assert torch.allclose(outputs["block"], stream + outputs["mlp"], atol=1e-6)


def test_edits_run_in_order_readers_last_one_hook_per_site(world):
    model, _, _, ids = world
    bound = bind(model)
    order, found = [], {}
    site = bound.at("block", 0)

    def step(name):
        def fn(value, _call):
            order.append(name)
            return value + 1
        return fn

    with applying(model, [reader(site, found, "first"), Edit(site, step("a"))]):
        with applying(model, [Edit(site, step("b"), group="user")]):
            assert snapshot(model)["max_per_site"] == 1
            assert edits_on(model, model.model.layers[0]) == 3
            with torch.no_grad():
                model(input_ids=ids)
            with only([model.model.layers[0]], ["run"]), torch.no_grad():
                model(input_ids=ids)
    assert order == ["a", "b", "a"]
    assert snapshot(model)["hooks"] == 0  # every hook off with its last edit


def test_the_hooks_come_off_whatever_ends_the_block(world):
    model, _, _, ids = world
    bound = bind(model)

    def boom(_value, _call):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError), applying(model, [Edit(bound.at("mlp", 0), boom)]), \
            torch.no_grad():
        model(input_ids=ids)
    assert snapshot(model)["hooks"] == 0
    with pytest.raises(ValueError, match="output"):
        Site(model.model.layers[0], "outside")


def test_the_counter_sees_two_hooks_on_one_site(world):
    """Control for the guards below."""
    model, _, _, ids = world
    block = model.model.layers[0]
    hooks = [(block, "forward", lambda *_: None), (block, "forward", lambda *_: None)]
    with installed(hooks):
        seen = observe(model, lambda: model(input_ids=ids))
    assert seen["max_hooks_per_site"] == 2 and seen["crowded_sites"] == ["model.layers.0.output"]


def _user_model(model):
    from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

    pv = import_pyvene()
    add = pv.AdditionIntervention(source_representation=torch.full((32,), 0.1))
    return pv.IntervenableModel([{"component": "model.layers[1].output",
                                  "intervention": add}], model)


@pytest.mark.parametrize("kind", ["residual", "mlp", "attn", "severed-mlp"])
@pytest.mark.parametrize("user", [False, True], ids=["bare", "with a user's intervention"])
def test_a_trace_puts_one_hook_per_site(world, kind, user):
    model, tokenizer, _, _ = world
    given = _user_model(model) if user else model
    seen = observe(model, lambda: trace(given, tokenizer, PROMPT, SUBJECT, seeds=2, kind=kind,
                                        progress=False))
    assert seen["forwards"] >= 2 and seen["max_hooks_per_site"] == 1, seen


def test_a_head_trace_puts_one_hook_per_site(world):
    model, tokenizer, _, _ = world
    seen = observe(model, lambda: Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=2)
                   .trace_heads(progress=False))
    assert seen["max_hooks_per_site"] == 1, seen


@pytest.mark.parametrize("user", [False, True], ids=["bare", "with a user's intervention"])
def test_a_graph_puts_one_hook_per_site(world, user):
    model, tokenizer, clt, _ = world
    given = _user_model(model) if user else model
    seen = observe(model, lambda: attribute(given, tokenizer, clt, PROMPT))
    assert seen["forwards"] >= 1 and seen["max_hooks_per_site"] == 1, seen
