"""Every tensor the package makes takes the device of its input: the public calls run on a model
whose weights sit on a second device (tests/_support/device_spy.py: a ``meta``-reported tensor
computed on the CPU, as strict as CUDA about meeting CPU tensors), without a GPU. Each call must
not mix devices and must give what the same call gives on the plain CPU model.

What it found (issue 54 item 5): ``salient_logits``' ``searchsorted`` against a CPU threshold
(``attribute`` without an answer), the fit's parameters, pairs and totals on the CPU
(``fit_transcoder`` on a GPU model), ``check_pairing``'s totals, and a spec's ``clt_splice``
transcoder read onto the CPU (``run_spec``)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from _support.device_spy import SPY, DeviceMix, Spied, spy_device, spy_module
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace import (
    attribute,
    fit_transcoder,
    fitting,
    intervene_features,
    run_spec,
    trace,
)
from pyvene_causaltrace.transcoders import load_from_disk
from pyvene_causaltrace.transcoders.checks import check_pairing
from pyvene_causaltrace.transcoders.fit import linear_skip

TEXTS = [PROMPT, "Paris is the capital of France"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """``(plain, spied, clt_path)``: a tiny Llama on the CPU, the same weights on the spy's
    device, and a fixture CLT's directory."""
    plain = make_tiny_model("llama", init=0.2, n_layers=2)
    spied = spy_module(copy.deepcopy(plain))
    path = write_clt(tmp_path_factory.mktemp("clt"), random_clt_tensors(2, 32, 48,
                                                                         threshold=0.1))
    return plain, spied, path


def _spied_clt(path):
    with spy_device():
        return load_from_disk(str(path), device=SPY)


# ------------------------------------------------------------------------------ the spy itself

def test_the_spy_refuses_what_cuda_refuses_and_passes_what_it_allows():
    with spy_device() as mode:
        x = torch.arange(6.0).reshape(2, 3).to(SPY)
        assert isinstance(x, Spied) and x.device == SPY
        sorted_row = x[0].cumsum(0)
        with pytest.raises(DeviceMix, match="searchsorted"):  # a 0-dim CPU tensor: refused
            torch.searchsorted(sorted_row, torch.tensor(2.0))
        with pytest.raises(DeviceMix, match="mm"):
            x @ torch.ones(3, 2)
        with pytest.raises(DeviceMix, match="add"):
            x + torch.ones(3)
        with pytest.raises(DeviceMix, match="generator"):
            torch.randn(3, device=SPY, generator=torch.Generator().manual_seed(0))
        here = torch.searchsorted(sorted_row, torch.tensor(2.0, device=x.device))
        assert isinstance(here, Spied) and int(here) == 2
        y = x * torch.tensor(2.0) + 1  # a 0-dim CPU tensor in a pointwise op: a scalar
        picked = y[torch.tensor([1, 0])]  # CPU indices
        picked[0, torch.tensor([0, 2])] = torch.zeros(2, device=SPY)
        made = torch.zeros(2, 3, device=SPY) + torch.tensor([[1.0]], device=x.device)
        assert isinstance(made, Spied)
        assert y.cpu().tolist() == [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]]
        assert type(y.cpu()) is torch.Tensor and y.to("cpu").device.type == "cpu"
        assert picked.tolist() == [[0.0, 9.0, 0.0], [1.0, 3.0, 5.0]] and float(y[1, 2]) == 11
        assert isinstance(x.new_tensor([1.0]), Spied)
        listed = x.clone()
        listed[..., [1]] = 5.0  # a list index: made on the host, not on the device
        assert listed[:, [1, 2]].tolist() == [[5.0, 2.0], [5.0, 5.0]]
        assert mode.ops > 0
    w = torch.ones(3, requires_grad=True)
    with spy_device():
        leaf = w.detach().to(SPY).requires_grad_()
        (leaf * torch.arange(3.0, device=SPY)).sum().backward()
        assert isinstance(leaf.grad, Spied) and leaf.grad.tolist() == [0.0, 1.0, 2.0]


# --------------------------------------------------------------------- the public calls on it

def test_trace_on_another_device_is_the_cpu_trace(world, tokenizer):
    plain, spied, _ = world
    with spy_device():
        there = trace(spied, tokenizer, PROMPT, SUBJECT, seeds=2, progress=False)
    here = trace(plain, tokenizer, PROMPT, SUBJECT, seeds=2, progress=False)
    np.testing.assert_allclose(there.restored_probs, here.restored_probs, rtol=1e-4, atol=1e-6)
    assert there.clean_prob == pytest.approx(here.clean_prob, rel=1e-5)


def test_attribute_without_an_answer_on_another_device_is_the_cpu_graph(world, tokenizer):
    """The salient logits' cut (searchsorted) reads a threshold on the logits' device."""
    plain, spied, path = world
    options = dict(max_n_logits=4, desired_logit_prob=0.6, max_feature_nodes=8, batch_size=16)
    with spy_device():
        there = attribute(spied, tokenizer, _spied_clt(path), PROMPT, **options)
    here = attribute(plain, tokenizer, load_from_disk(str(path)), PROMPT, **options)
    assert [t["token"] for t in there.targets] == [t["token"] for t in here.targets]
    assert len(here.targets) > 1  # the cut falls after several logits
    torch.testing.assert_close(there.feature_id, here.feature_id)
    torch.testing.assert_close(there.activation.cpu(), here.activation, rtol=1e-4, atol=1e-6)


def test_steering_and_generation_on_another_device(world, tokenizer):
    plain, spied, path = world
    setting = [(1, -1, 3, 5.0)]
    with spy_device():
        there = intervene_features(spied, tokenizer, _spied_clt(path), PROMPT, setting,
                                   max_new_tokens=2)
    here = intervene_features(plain, tokenizer, load_from_disk(str(path)), PROMPT, setting,
                              max_new_tokens=2)
    assert there.generated_ids == here.generated_ids
    torch.testing.assert_close(there.logits.cpu(), here.logits, rtol=1e-4, atol=1e-5)


def test_a_spec_reads_its_transcoder_onto_the_models_device(world, tokenizer):
    plain, spied, path = world
    spec = {"schema_version": 1, "name": "splice", "model": "tiny", "prompt": PROMPT,
            "answer": " city", "interventions": [
                {"type": "clt_splice", "clt": str(path), "error": "clean"},
                {"type": "feature_ablate", "clt_layer": 1, "features": [3, 4], "positions": [5],
                 "value": [0.0, 7.5]}]}
    with spy_device():
        there = run_spec(spec, spied, tokenizer)
    here = run_spec(spec, plain, tokenizer)
    assert there.intervened_probs == pytest.approx(here.intervened_probs, rel=1e-4)


def test_pairing_check_on_another_device(world, tokenizer):
    plain, spied, path = world
    with spy_device():
        there = check_pairing(spied, tokenizer, _spied_clt(path), TEXTS)
    here = check_pairing(plain, tokenizer, load_from_disk(str(path)), TEXTS)
    assert there.fvu == pytest.approx(here.fvu, rel=1e-4)


def test_a_fit_on_another_device_is_the_cpu_fit(world, tokenizer, tmp_path, monkeypatch):
    """The fit's parameters, pairs and totals live with the model (its random draws are the
    CPU's, so the fit is the same on every device; float32 products on both, as the spy's
    device never takes bfloat16's)."""
    plain, spied, _ = world
    monkeypatch.setattr(fitting, "fast_bf16", lambda device: False)
    options = dict(kind="plt", texts=1, steps=2, features=16, k=4, new_tokens=4,
                   progress=False)
    with spy_device():
        there = fit_transcoder(model=spied, tokenizer=tokenizer, out=tmp_path / "spied",
                               **options)
    here = fit_transcoder(model=plain, tokenizer=tokenizer, out=tmp_path / "plain", **options)
    assert there.record["train_tokens"] == here.record["train_tokens"]
    for fvu in (lambda r: r["train_fvu"], lambda r: r["pairing"]["fvu"]):
        assert fvu(there.record) == pytest.approx(fvu(here.record), rel=1e-5)
    assert json.loads((tmp_path / "spied" / "fit.json").read_text())["train_tokens"] > 0


def test_the_least_squares_skip_on_another_device():
    """The default fit's skip (skip_plt) solved on the pairs' device."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 6, generator=g)
    with spy_device():
        there = linear_skip(x.to(SPY), y.to(SPY))
    for got, want in zip(there, linear_skip(x, y), strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
