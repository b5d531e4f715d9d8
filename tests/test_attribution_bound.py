"""The bound object attribution runs on (ReplacementModel: the model, tokenizer and transcoder
checked once), and the ``transcoder`` keyword of attribution's public functions (``clt=``, its
old name, is gone)."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import (
    AttributionSettings,
    ReplacementModel,
    attribute,
    run_local_replacement,
)
from pyvene_causaltrace.attribution.validate import ablation_test, answer_prob
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.interventions.clt_splice import clean_errors
from pyvene_causaltrace.transcoders import TranscoderMismatchError, load_from_disk
from pyvene_causaltrace.transcoders.transcoder import check_fits


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    tensors = random_clt_tensors(3, 32, 48, threshold=0.1)
    clt = load_from_disk(str(write_clt(tmp_path_factory.mktemp("bound") / "clt", tensors)))
    return model, clt


def _same(a, b) -> None:
    state_a, state_b = a.rows.state(), b.rows.state()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert a.closure == b.closure and a.answer_prob == b.answer_prob


def test_attribute_takes_transcoder_by_position_or_name(world, tokenizer):
    model, clt = world
    positional = attribute(model, tokenizer, clt, PROMPT, batch_size=16)
    named = attribute(model, tokenizer, transcoder=clt, prompt=PROMPT, batch_size=16)
    _same(positional, named)


def test_run_local_replacement_and_ablation_test_take_transcoder(world, tokenizer):
    model, clt = world
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    named = run_local_replacement(model, transcoder=clt, input_ids=ids)
    assert torch.equal(named.logits, run_local_replacement(model, clt, ids).logits)
    graph = attribute(model, tokenizer, clt, PROMPT)
    named = ablation_test(model, transcoder=clt, graph=graph, sizes=(2,), draws=1)
    assert named == ablation_test(model, clt, graph, sizes=(2,), draws=1)
    errors = clean_errors(model, clt, ids)
    token = graph.target["token"]
    named = answer_prob(bind(model), transcoder=clt, ids=ids, errors=errors, token=token,
                        ablate=[], graph=graph)
    assert named == answer_prob(bind(model), clt, ids, errors, token, [], graph)


def test_the_public_signatures_name_transcoder_and_type_the_tokenizer(world):
    model, clt = world
    for function in (attribute, run_local_replacement, ablation_test, answer_prob):
        names = list(inspect.signature(function).parameters)
        assert "transcoder" in names[1:3] and "clt" not in names, (function.__name__, names)
    with pytest.raises(TypeError, match="unexpected keyword argument 'clt'"):
        run_local_replacement(model, clt=clt, input_ids=torch.ones(1, 3, dtype=torch.long))
    annotation = inspect.signature(attribute).parameters["tokenizer"].annotation
    assert "PreTrainedTokenizerBase" in str(annotation)


def test_the_bound_object_is_checked_once_and_runs_the_same_forward(world, tokenizer):
    model, clt = world
    replacement = ReplacementModel(model, tokenizer, clt)
    assert replacement.bound.n_layers == clt.n_layers
    prepared = replacement.prepare(PROMPT, settings=AttributionSettings(target="demeaned"))
    assert prepared.softcap is None and prepared.target_logits is prepared.logits
    run = replacement.run(prepared.input_ids)
    reference = run_local_replacement(model, clt, prepared.input_ids,
                                      from_position=replacement.from_position)
    assert torch.equal(run.logits, reference.logits)
    assert torch.equal(run.feature_id, reference.feature_id)

    calls = []

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code is inspect.unwrap(check_fits).__code__:
            calls.append(frame.f_back.f_back.f_globals["__name__"])  # past @checked's wrapper

    sys.setprofile(profile)
    try:
        attribute(model, tokenizer, clt, PROMPT, batch_size=16)
    finally:
        sys.setprofile(None)
    assert sum(c.startswith("pyvene_causaltrace.attribution") for c in calls) == 1, calls


def test_the_bound_object_refuses_a_transcoder_that_does_not_fit(world, tokenizer, tmp_path):
    model, _ = world
    tensors = random_clt_tensors(2, 32, 48, threshold=0.1)
    wrong = load_from_disk(str(write_clt(tmp_path / "two-layer", tensors)))
    with pytest.raises(TranscoderMismatchError, match="2 layers"):
        ReplacementModel(model, tokenizer, wrong)
