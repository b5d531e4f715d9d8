"""Batched rows with the feature leaves' gradients computed from the error leaves'
(:mod:`pyvene_causaltrace.attribution.leaf_grads`) equal the rows of plain autograd on every
leaf — the batched path before it, and the per-node loop — on tiny Llama, GPT-2 and Qwen3 with a
CLT and per-layer transcoders (with a skip path), in float32 and float64."""

from __future__ import annotations

import warnings

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from transcoder_fixtures import random_set, write_circuit_tracer, write_sparsify

from pyvene_causaltrace.attribution import demeaned_logit, run_local_replacement
from pyvene_causaltrace.attribution.edges import (
    _seeds,
    edges_from_grads,
    feature_rows,
    feature_rows_loop,
    target_rows,
)
from pyvene_causaltrace.attribution.leaf_grads import leaf_grads
from pyvene_causaltrace.transcoders import load_from_disk, load_transcoder

L, D, F = 3, 32, 48


def _transcoder(kind: str, arch: str, tmp_path, dtype=torch.float32):
    """A CLT, or a per-layer set with a skip path (circuit-tracer JumpReLU; sparsify TopK)."""
    if kind == "clt":
        tensors = random_clt_tensors(L, D, F, threshold=0.1)
        return load_from_disk(str(write_clt(tmp_path / "clt", tensors)), dtype=dtype)
    if kind == "set_skip":
        tensors = random_set(L, D, F, skip=True, threshold=0.05, seed=1)
        path = write_circuit_tracer(tmp_path / "ct", tensors, input_hook="mlp.hook_in",
                                    output_hook="mlp.hook_out")
    else:
        tensors = random_set(L, D, F, activation="relu_topk", k=8, skip=True, seed=3)
        path = write_sparsify(tmp_path / "sp", tensors, prefix="h" if arch == "gpt2" else "layers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_transcoder(path, dtype=dtype)


def _autograd_rows(run, index):
    """The batched rows as they were computed before: autograd on every leaf."""
    outputs, seeds = _seeds(run, index)
    grads = torch.autograd.grad(outputs, run.inputs(), seeds, retain_graph=True,
                                allow_unused=True, is_grads_batched=True)
    return edges_from_grads(run, grads, batch=len(index))


def _run(arch, kind, tmp_path, tokenizer, dtype=torch.float32):
    model = make_tiny_model(arch, init=0.2, n_layers=L)
    if dtype == torch.float64:
        model = model.double()
    transcoder = _transcoder(kind, arch, tmp_path, dtype)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return run_local_replacement(model, transcoder, ids)


CASES = [("llama", "clt"), ("gpt2", "clt"), ("qwen3", "clt"), ("llama", "set_skip"),
         ("gpt2", "set_skip"), ("llama", "sparsify"), ("gpt2", "sparsify")]


@pytest.mark.parametrize("arch,kind", CASES)
@pytest.mark.numerics
def test_rows_equal_autograd_on_every_leaf(arch, kind, tmp_path, tokenizer):
    run = _run(arch, kind, tmp_path, tokenizer)
    assert run.n_features > 30
    index = torch.arange(run.n_features)
    rows, constants = feature_rows(run, index)
    old, old_constants = _autograd_rows(run, index)
    assert rows.shape == old.shape and rows.dtype == old.dtype == torch.float32
    assert (rows - old).abs().max() <= 1e-6
    assert (constants - old_constants).abs().max() <= 1e-6
    loop, loop_constants = feature_rows_loop(run, index[::7])
    assert (rows[::7] - loop).abs().max() <= 1e-6
    assert (constants[::7] - loop_constants).abs().max() <= 1e-6
    # in batches of every size, and batches whose rows reach no error (layer 0) or few layers
    for part in (index[:5], index[run.feature_layer == 0], index[run.feature_layer == 1],
                 index[run.feature_layer == L - 1][:3]):
        got, _ = feature_rows(run, part)
        assert (got - old[part]).abs().max() <= 1e-6
    # the logit rows too
    target = demeaned_logit(run.logits.detach(), 5, 10)
    new_target, new_constant, _ = target_rows(run, [target])
    seed = target.seed(run.logits)[None]
    grads = torch.autograd.grad(run.logits, run.inputs(), seed, retain_graph=True,
                                allow_unused=True, is_grads_batched=True)
    old_target, old_constant = edges_from_grads(run, grads, batch=1)
    assert (new_target - old_target).abs().max() <= 1e-6
    assert (new_constant - old_constant).abs().max() <= 1e-6


@pytest.mark.parametrize("arch,kind", [("llama", "clt"), ("gpt2", "set_skip")])
@pytest.mark.numerics
def test_leaf_grads_are_autograds(arch, kind, tmp_path, tokenizer):
    """Every leaf's gradient, not only the rows: the features' to float rounding, the others
    exactly (the same autograd graph without the writes' branch)."""
    run = _run(arch, kind, tmp_path, tokenizer)
    index = torch.arange(0, run.n_features, 3)
    outputs, seeds = _seeds(run, index)
    new = leaf_grads(run, outputs, seeds)
    old = torch.autograd.grad(outputs, run.inputs(), seeds, retain_graph=True,
                              allow_unused=True, is_grads_batched=True)
    k = len(run.features)
    assert len(new) == len(old) == len(run.inputs())
    for i, (a, b) in enumerate(zip(new, old, strict=True)):
        if b is None:
            assert a is None
            continue
        assert a is not None and a.shape == b.shape and a.dtype == b.dtype
        if i < k:
            assert (a - b).abs().max() <= 1e-6
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("arch,kind", [("llama", "clt"), ("gpt2", "clt"),
                                       ("llama", "set_skip"), ("gpt2", "sparsify")])
@pytest.mark.numerics
def test_float64_rows_equal_autograd_to_rounding(arch, kind, tmp_path, tokenizer):
    run = _run(arch, kind, tmp_path, tokenizer, dtype=torch.float64)
    index = torch.arange(run.n_features)
    rows, constants = feature_rows(run, index)
    assert rows.dtype == torch.float64
    old, old_constants = _autograd_rows(run, index)
    assert (rows - old).abs().max() <= 1e-12 * max(1.0, float(old.abs().max()))
    assert (constants - old_constants).abs().max() <= 1e-12
