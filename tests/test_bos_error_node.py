"""What the BOS error node is (docs/attribution.md, "The BOS error node"; the ``bos`` rule in a
graph's metadata): at a position that is not spliced the decoder still covers it, so the error
node there is the MLP output minus ``b_dec`` (a constant) and minus the skip path of the
position's input — not the whole MLP output. Checked on a per-layer skip transcoder, against the
MLP outputs of a plain forward; the control is the old claim (the whole output)."""

from __future__ import annotations

import torch
from _support.models import make_tiny_model
from transcoder_fixtures import random_set, write_circuit_tracer

from pyvene_causaltrace.attribution import run_local_replacement
from pyvene_causaltrace.prompts import bos_metadata
from pyvene_causaltrace.transcoders import load_transcoder


def test_the_bos_error_node_is_the_mlp_output_minus_b_dec_and_the_skip_path(tmp_path):
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    transcoder = load_transcoder(str(write_circuit_tracer(
        tmp_path / "set", random_set(3, 32, 48, skip=True, threshold=0.1))))
    ids = torch.tensor([[1, 17, 42, 99, 7]])
    outputs: dict[int, torch.Tensor] = {}
    handles = [layer.mlp.register_forward_hook(
        lambda _m, _i, out, layer_index=i: outputs.__setitem__(layer_index, out.detach()))
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    run = run_local_replacement(model, transcoder, ids, from_position=1)  # position 0: BOS
    assert bool((run.feature_position >= 1).all()), "no features at the BOS position"
    for layer in range(3):
        out = outputs[layer][0, 0]
        skip = transcoder.skip(run.encoder_inputs[layer][0, 0].detach(), layer)
        error = run.errors[layer][0, 0].detach()
        torch.testing.assert_close(error, out - transcoder.b_dec[layer] - skip,
                                   rtol=1e-5, atol=1e-6)
        # the control: b_dec and the skip path are not part of it
        assert float((error - out).abs().max()) > 1e-3
    rule = bos_metadata(_AddsBos(), "auto")["rule"]
    assert "error node is the MLP output minus b_dec" in rule


class _AddsBos:
    """A tokenizer that prepends a special token (what ``tokenizer_adds_bos`` reads)."""

    bos_token = "<s>"
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        ids = [5, 6] if text else []
        return {"input_ids": ([1] if add_special_tokens else []) + ids}
