"""Our forwards' hook runner (:func:`pyvene_causaltrace.runtime.intervened`) gives pyvene's
numbers bit for bit: the same representation dicts — every kind our call sites build — run
through it and through an ``IntervenableModel``, on tiny models of the core architectures. A
control shows the comparison can fail (a representation left out changes the logits)."""

from __future__ import annotations

import threading

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution.replacement import _freeze_representations
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.interventions.clt_splice import clean_errors, clt_splice_representations
from pyvene_causaltrace.interventions.frozen import FrozenAttention, attention_patterns
from pyvene_causaltrace.interventions.noise import NoiseAdd
from pyvene_causaltrace.interventions.restore import CleanRestore
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.runtime import intervened
from pyvene_causaltrace.transcoders import load_from_disk

ARCHS = ("gpt2", "llama", "qwen3")


@pytest.fixture(scope="module", params=ARCHS)
def world(request, tmp_path_factory, tokenizer):
    model = make_tiny_model(request.param, init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path_factory.mktemp(request.param) / "clt",
                                       random_clt_tensors(3, 32, 48, threshold=0.1))))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return bind(model), clt, ids


def cases(bound, clt, ids):
    """name -> a function making fresh representations (interventions hold per-run state)."""
    n = ids.shape[1]
    errors = clean_errors(bound, clt, ids)
    patterns = attention_patterns(bound, ids)
    return {
        "noise on the embeddings": lambda: [{"component": bound.site("embed"),
                                             "intervention": NoiseAdd(seeds=[3, 4],
                                                                      positions=[1, 2],
                                                                      scale=3.0, sigma=0.1)}],
        "a restore at a block's input (a pre-hook)": lambda: [{
            "component": bound.site("resid_pre", 1),
            "intervention": CleanRestore(positions=[n - 1],
                                         states=torch.randn(1, n, bound.d_model))}],
        "frozen norms and attention": lambda: _freeze_representations(bound),
        "a splice with ablations, errors held": lambda: clt_splice_representations(
            bound, clt, errors=errors, live_error=True, error_from="clean",
            ablations=[{"clt_layer": 1, "features": [0, 3, 5]}]),
        "held attention patterns": lambda: [
            {"component": bound.site("attn_output", layer),
             "intervention": FrozenAttention(pattern=pattern, pattern_from="clean")}
            for layer, pattern in enumerate(patterns)],
    }


@pytest.mark.parametrize("name", ["noise on the embeddings",
                                  "a restore at a block's input (a pre-hook)",
                                  "frozen norms and attention",
                                  "a splice with ablations, errors held",
                                  "held attention patterns"])
def test_the_runner_gives_pyvenes_numbers(world, name):
    bound, clt, ids = world
    make = cases(bound, clt, ids)[name]
    batch = ids.repeat(2, 1)
    with torch.no_grad():
        torch.manual_seed(0)
        pv_logits = intervenable_model_class()(make(), bound.model)(
            base={"input_ids": batch, "use_cache": False})[1].logits
        torch.manual_seed(0)
        with intervened(bound, make()) as model:
            ours = model(input_ids=batch, use_cache=False).logits
        plain = bound.model(input_ids=batch, use_cache=False).logits
    assert torch.equal(ours, pv_logits)
    if name not in ("frozen norms and attention", "held attention patterns"):
        # control: these edits change the logits (freezes keep the forward's values)
        assert not torch.equal(plain, pv_logits)


def test_the_hooks_go_when_the_block_ends_and_act_in_this_thread_only(world):
    bound, clt, ids = world
    model, ids = bound.model, ids.repeat(2, 1)  # a row per noise seed
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        seen = {}
        with intervened(bound, cases(bound, clt, ids)["noise on the embeddings"]()):
            inside = model(input_ids=ids).logits
            other = threading.Thread(target=lambda: seen.setdefault(
                "logits", model(input_ids=ids).logits))
            other.start()
            other.join()
        assert not torch.equal(inside, plain)
        assert torch.equal(seen["logits"], plain)
        assert torch.equal(model(input_ids=ids).logits, plain)
        with pytest.raises(RuntimeError), intervened(bound, cases(bound, clt, ids)[
                "noise on the embeddings"]()):
            raise RuntimeError("interrupted")
        assert torch.equal(model(input_ids=ids).logits, plain)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_weights_record_no_gradient_unless_kept(world):
    bound, clt, ids = world
    reps = cases(bound, clt, ids)["noise on the embeddings"]
    ids = ids.repeat(2, 1)
    with intervened(bound, reps()) as model:
        assert not model(input_ids=ids).logits.requires_grad
    with intervened(bound, reps(), keep_model_gradients=True) as model:
        assert model(input_ids=ids).logits.requires_grad
    assert all(p.requires_grad for p in bound.model.parameters())


def test_a_component_that_is_not_a_module_input_or_output_is_refused(world):
    bound = world[0]
    with pytest.raises(InputError, match="'<module path>.output'"), \
            intervened(bound, [{"component": "model.layers", "intervention": None}]):
        pass
