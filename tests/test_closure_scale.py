"""The closure check's scale for a feature's row includes the terms its pre-activation sums,
``sum_i |w_i x_i|``: a feature barely active (pre-activation near 0, summed from large terms
that cancel) is float32 rounding, not a forward the graph cannot see. Found on SmolLM2 by the
README's dataset-with-graphs command: a layer-0 feature at position 0 with pre-activation 4.4e-4
from terms of 2.3 in all left 1.8e-7, 1.4e-4 of its edges' scale, and the run stopped."""

from __future__ import annotations

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from safetensors.torch import load_file, save_file

from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.attribution.edges import CLOSURE_TOLERANCE, row_closures
from pyvene_causaltrace.attribution.replacement import run_local_replacement
from pyvene_causaltrace.errors import ClosureError
from pyvene_causaltrace.transcoders import load_transcoder

LAYER, FEATURE, D = 0, 5, 32


def test_the_scale_counts_the_pre_activation_terms():
    """SmolLM2's numbers: the old scale (edges, constant, target) failed the row; with the
    pre-activation's own terms it is rounding. A residual of 1e-3 of the same terms (a hook the
    graph cannot see) still fails."""
    target = torch.tensor([4.4e-4], dtype=torch.float64)
    rows = (target + 1.79e-7).float().reshape(1, 1)
    constants = torch.zeros(1)
    assert float(row_closures(rows, constants, target)[0]) > CLOSURE_TOLERANCE
    magnitudes = torch.tensor([2.3], dtype=torch.float64)
    assert float(row_closures(rows, constants, target, magnitudes)[0]) < 1e-6
    hooked = (target + 2.3e-3).float().reshape(1, 1)
    assert float(row_closures(hooked, constants, target, magnitudes)[0]) > CLOSURE_TOLERANCE


@pytest.fixture(scope="module")
def barely_active(tokenizer, tmp_path_factory):
    """A tiny Llama and a fixture CLT whose layer-0 feature 5 reads position 0 (the tiny
    tokenizer adds no BOS: spliced) through an encoder row of large entries chosen so that
    ``w . x = 1e-2`` there: terms of about 1e4 that cancel. It writes nothing (zero decoder)."""
    root = tmp_path_factory.mktemp("barely")
    model = make_tiny_model("llama", init=0.2)
    tensors = random_clt_tensors(3, D, 16, threshold=0.3)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    base = load_transcoder(str(write_clt(root / "base", tensors)))
    run = run_local_replacement(model, base, ids, from_position=0)
    x = run.encoder_inputs[LAYER][0, 0].detach().double()
    w = torch.randn(D, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 300
    w = w - (w @ x - 1e-2) * x / (x @ x)  # w . x = 1e-2 in float64
    tensors["W_enc"][LAYER, FEATURE] = w.float()
    tensors["b_enc"][LAYER, FEATURE] = 0.0
    tensors["threshold"][LAYER, FEATURE] = 0.0
    tensors["W_dec"][LAYER][FEATURE] = 0.0
    clt = load_transcoder(str(write_clt(root / "barely", tensors)))
    return model, clt, w, x, root


@pytest.mark.numerics
def test_a_barely_active_feature_is_rounding_not_a_closure_failure(barely_active, tokenizer):
    model, clt, w, x, root = barely_active
    graph = attribute(model, tokenizer, clt, PROMPT, progress=False)
    assert graph.from_position == 0
    nodes = graph.rows.nodes
    mine = [r for r, node in enumerate(nodes.tolist()) if node < graph.n_features
            and int(graph.feature_layer[node]) == LAYER and int(graph.feature_position[node]) == 0
            and int(graph.feature_id[node]) == FEATURE]
    assert len(mine) == 1, "the barely active feature has a row"
    row = mine[0]
    magnitude = float(graph.rows.magnitudes[row])
    reference = float((w.float().double() * x).abs().sum())
    assert abs(magnitude - reference) <= 1e-5 * reference and magnitude > 1e3
    residual = float(graph.closures()[row].abs())
    old_scale = float(graph.rows.abs_sums()[row] + graph.rows.constants[row].abs()
                      + graph.rows.targets[row].abs())
    # the control: under the old scale this row "did not close" (float32 rounding of terms of
    # ~1e4 is ~1e-4 here, against a pre-activation of 1e-2)
    assert residual / old_scale > CLOSURE_TOLERANCE, (residual, old_scale)
    assert float(graph.row_closures()[row]) < 1e-5
    assert graph.feature_closure() < 1e-5
    # the magnitudes travel with the graph file; a file written before them reads them as 0
    graph.save(root / "g.safetensors")
    again = AttributionGraph.load(root / "g.safetensors")
    assert torch.equal(again.rows.magnitudes, graph.rows.magnitudes)
    tensors = load_file(str(root / "g.safetensors"))
    metadata = _metadata(root / "g.safetensors")
    del tensors["rows.magnitudes"]
    save_file(tensors, str(root / "old.safetensors"), metadata=metadata)
    old = AttributionGraph.load(root / "old.safetensors")
    assert float(old.rows.magnitudes.abs().sum()) == 0.0
    assert torch.equal(old.rows.targets, graph.rows.targets)


def test_a_hidden_edit_still_fails_the_rows(barely_active, tokenizer):
    """With the larger scale, a forward hook the graph cannot see still stops attribution."""
    model, clt, _, _, _ = barely_active
    handle = model.model.layers[0].self_attn.register_forward_hook(
        lambda _m, _a, out: (out[0] + 0.5, *out[1:]))
    try:
        with pytest.raises(ClosureError):
            attribute(model, tokenizer, clt, PROMPT, progress=False)
    finally:
        handle.remove()


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata()
