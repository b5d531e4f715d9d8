"""Per-layer transcoder sets inside models: GPT-2, Llama, Qwen3 and Gemma-2, each from a different
on-disk layout. The splice with its error is the model; attribution closes (Gemma-2: on the
pre-soft-cap logit); pairing check and anchor run; Gemma-2's hooks are the TransformerLens ones."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from transcoder_fixtures import (
    dense_reference,
    random_set,
    rounded,
    write_circuit_tracer,
    write_gemmascope,
    write_sae_lens,
    write_sparsify,
)

from pyvene_causaltrace.attribution import (
    attribute,
    demeaned_logit,
    pre_softcap_logits,
    run_local_replacement,
)
from pyvene_causaltrace.attribution.edges import feature_rows, feature_rows_loop, feature_targets
from pyvene_causaltrace.interventions.clt_splice import clt_splice_representations
from pyvene_causaltrace.models import get_module
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.transcoders import TranscoderMismatchError, load_transcoder
from pyvene_causaltrace.transcoders.checks import (
    check_pairing,
    replacement_anchor,
    transcoder_states,
)

L, D, F = 3, 32, 48
TEXTS = ["The Space Needle is in the city of Seattle", "Miles Davis plays the trumpet"]


def _set(arch, tmp_path, layout):
    """A tiny model and a set for it written in ``layout``; returns (model, set, tensors)."""
    model = make_tiny_model(arch, init=0.2)
    if layout == "circuit_tracer":  # JumpReLU with skip, bf16 files, the MLP's normed input
        tensors = random_set(L, D, F, skip=True, threshold=0.05, seed=1)
        path = write_circuit_tracer(tmp_path / "ct", tensors, dtype=torch.bfloat16,
                                    input_hook="mlp.hook_in", output_hook="mlp.hook_out")
        tensors = rounded(tensors, torch.bfloat16)
    elif layout == "circuit_tracer_topk":  # circuit-tracer TopK, resid_mid -> hook_mlp_out
        tensors = random_set(L, D, F, activation="topk", k=8, seed=2)
        path = write_circuit_tracer(tmp_path / "topk", tensors)
    elif layout == "sparsify":  # TopK with skip, bf16
        tensors = random_set(L, D, F, activation="relu_topk", k=8, skip=True, seed=3)
        path = write_sparsify(tmp_path / "sp", tensors, dtype=torch.bfloat16,
                              prefix="h" if arch == "gpt2" else "layers")
        tensors = rounded(tensors, torch.bfloat16)
    elif layout == "sae_lens":  # ReLU, resid_mid -> hook_mlp_out
        tensors = random_set(L, D, F, activation="relu", seed=4)
        for t in tensors["layers"]:
            t["b_enc"] -= 0.3  # sparser
        path = write_sae_lens(tmp_path / "sl", tensors)
    else:  # GemmaScope npz: ln2.hook_normalized -> hook_mlp_out
        tensors = random_set(L, D, F, threshold=0.5, seed=5)
        path = write_gemmascope(tmp_path / "gs", tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, load_transcoder(path), tensors


SETUPS = [("gpt2", "circuit_tracer"), ("gpt2", "sparsify"), ("llama", "sparsify"),
          ("llama", "circuit_tracer_topk"), ("qwen3", "sae_lens"), ("qwen3", "circuit_tracer"),
          ("gemma2", "gemmascope"), ("gemma2", "circuit_tracer_topk"),
          ("gemma2", "circuit_tracer")]


@pytest.mark.parametrize("arch,layout", SETUPS)
@pytest.mark.numerics
def test_sets_splice_attribute_and_check(arch, layout, tmp_path, tokenizer):
    model, tc, _ = _set(arch, tmp_path, layout)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    runner = intervenable_model_class()
    with torch.no_grad():
        clean = model(input_ids=ids).logits  # Gemma-2: the capped logits
        spliced = runner(clt_splice_representations(model, tc, add_error=True), model)(
            base={"input_ids": ids})[1].logits
        without = runner(clt_splice_representations(model, tc), model)(
            base={"input_ids": ids})[1].logits
    assert (spliced - clean).abs().max() < 1e-4
    assert (without - clean).abs().max() > 1e-3  # the splice did replace something
    graph = attribute(model, tokenizer, tc, PROMPT)
    assert graph.n_features > 30
    assert graph.closure.relative < 1e-4, graph.closure
    assert graph.feature_closure() < 1e-4
    assert graph.metadata["transcoder"]["kind"] == "transcoder_set"
    report = check_pairing(model, tokenizer, tc, TEXTS)
    assert report.n_tokens > 0 and all(v == v for v in report.fvu_per_layer)
    anchor = replacement_anchor(model, tokenizer, tc, TEXTS)
    assert all(v == v for v in anchor.ce.values())  # random weights: no ordering to expect
    assert anchor.ce["clt"] != anchor.ce["clean"]


@pytest.mark.parametrize("arch,layout", [("llama", "sparsify"), ("gpt2", "circuit_tracer")])
@pytest.mark.numerics
def test_skip_path_edges_batch_equal_the_loop_and_close(arch, layout, tmp_path, tokenizer):
    """With a skip path, a feature's row reaches upstream nodes through it too: the batched
    rows equal the per-node loop and each row sums to its pre-activation."""
    model, tc, _ = _set(arch, tmp_path, layout)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    run = run_local_replacement(model, tc, ids)
    late = (run.feature_layer == L - 1).nonzero().squeeze(-1)[:20]
    rows, constants = feature_rows(run, late)
    loop_rows, loop_constants = feature_rows_loop(run, late)
    assert torch.allclose(rows, loop_rows, atol=1e-5, rtol=1e-5)
    values = feature_targets(run, late).detach()
    assert (rows.double().sum(1) + constants - values).abs().max() < 1e-4
    # the skip path carries real weight: zeroing W_skip changes the late rows
    saved = tc.W_skip
    tc.W_skip = [torch.zeros_like(w) for w in saved]
    try:
        bare = run_local_replacement(model, tc, ids)
        bare_rows, _ = feature_rows(bare, late)
    finally:
        tc.W_skip = saved
    assert (bare_rows - rows).abs().max() > 1e-3


@pytest.mark.numerics
def test_gemma2_hooks_are_transformerlens(tmp_path):
    """``hook_mlp_out`` is what the block adds after the post-feedforward norm;
    ``ln2.hook_normalized`` is resid_mid over its RMS, before the (1 + w) gain;
    ``mlp.hook_out`` is the raw MLP output."""
    model, tc, _ = _set("gemma2", tmp_path, "gemmascope")
    ids = torch.randint(1, 400, (1, 9), generator=torch.Generator().manual_seed(0))
    states = transcoder_states(model, tc, ids)
    found = {}
    handles = []
    for layer in range(L):
        block = model.model.layers[layer]
        handles.append(block.pre_feedforward_layernorm.register_forward_hook(
            lambda m, a, o, _l=layer: found.__setitem__(("mid", _l), (a[0], o))))
        handles.append(block.mlp.register_forward_hook(
            lambda m, a, o, _l=layer: found.__setitem__(("mlp", _l), o)))
        handles.append(block.register_forward_hook(
            lambda m, a, o, _l=layer: found.__setitem__(("post", _l), o[0] if isinstance(
                o, tuple) else o)))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    for layer in range(L):
        resid_mid, normed = found[("mid", layer)]
        block_adds = found[("post", layer)] - resid_mid
        torch.testing.assert_close(states["output"][layer], block_adds[0], atol=1e-5, rtol=1e-5)
        assert (found[("mlp", layer)][0] - states["output"][layer]).abs().max() > 1e-2
        gain = 1 + model.model.layers[layer].pre_feedforward_layernorm.weight
        torch.testing.assert_close(states["input"][layer] * gain, normed[0], atol=1e-5, rtol=1e-5)
        x = resid_mid[0].double()
        expected = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(states["input"][layer].double(), expected, atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.numerics
def test_gemma2_splice_equals_replacing_the_post_norm_output_by_hand(tmp_path):
    model, tc, tensors = _set("gemma2", tmp_path, "gemmascope")
    ids = torch.randint(1, 400, (1, 9), generator=torch.Generator().manual_seed(1))
    states = transcoder_states(model, tc, ids)
    _, recon = dense_reference(tensors, states["input"])
    handles = []
    for layer in range(L):
        def replace(_m, _a, output, _l=layer):
            out = output.clone()
            out[0, 1:] = recon[_l, 1:].to(out.dtype)
            return out
        handles.append(get_module(model, f"model.layers[{layer}].post_feedforward_layernorm")
                       .register_forward_hook(replace))
    with torch.no_grad():
        by_hand = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    with torch.no_grad():
        spliced = intervenable_model_class()(clt_splice_representations(model, tc), model)(
            base={"input_ids": ids})[1].logits
    # by hand uses the clean-run inputs for every layer, so compare layer 0's effect only when
    # later layers' inputs shift: splice one layer at a time instead
    torch.testing.assert_close(spliced[0, 0], by_hand[0, 0], atol=1e-5, rtol=1e-5)
    for layer in range(L):
        reps = clt_splice_representations(model, tc, layers=[layer])
        with torch.no_grad():
            one = intervenable_model_class()(reps, model)(base={"input_ids": ids})[1].logits
        hook = get_module(model, f"model.layers[{layer}].post_feedforward_layernorm")

        def replace_one(_m, _a, output, _l=layer):
            out = output.clone()
            out[0, 1:] = recon[_l, 1:].to(out.dtype)
            return out
        handle = hook.register_forward_hook(replace_one)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        handle.remove()
        torch.testing.assert_close(one, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.numerics
def test_gemma2_attributes_the_pre_softcap_logit(tmp_path, tokenizer):
    model, tc, _ = _set("gemma2", tmp_path, "gemmascope")
    cap = model.config.final_logit_softcapping
    assert cap  # Gemma-2's default (30.0)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        capped = model(input_ids=ids).logits
        model.config.final_logit_softcapping = None
        uncapped = model(input_ids=ids).logits
        model.config.final_logit_softcapping = cap
    assert (torch.tanh(uncapped / cap) * cap - capped).abs().max() < 1e-4
    assert (uncapped - capped).abs().max() > 1e-3  # the cap bites on this model
    graph = attribute(model, tokenizer, tc, PROMPT)
    assert model.config.final_logit_softcapping == cap  # restored
    token = int(capped[0, -1].argmax())
    expected = demeaned_logit(uncapped, token, 10)(uncapped)
    assert abs(graph.closure.target - float(expected)) < 1e-4
    assert graph.closure.relative < 1e-4
    assert graph.metadata["logit_softcap"]["cap"] == cap
    assert abs(graph.answer_prob - float(capped[0, -1].softmax(-1)[token])) < 1e-5
    # the ablation test runs the real, capped model
    from pyvene_causaltrace.attribution.validate import ablation_test

    result = ablation_test(model, tc, graph, sizes=(3,), draws=2)
    assert abs(result.clean_prob - graph.answer_prob) < 1e-5
    assert abs(result.spliced_prob - graph.answer_prob) < 1e-4
    # a failure while the cap is off restores it too
    with pytest.raises(RuntimeError, match="boom"), pre_softcap_logits(model) as off:
        assert off == cap and model.config.final_logit_softcapping is None
        raise RuntimeError("boom")
    assert model.config.final_logit_softcapping == cap
    with pytest.raises(TranscoderMismatchError, match="2 layers"):
        attribute(make_tiny_model("gemma2", n_layers=2), tokenizer, tc, PROMPT)


def test_export_carries_the_scan_and_user_labels(tmp_path, tokenizer):
    from pyvene_causaltrace.attribution.export import check_graph_json, read_labels

    model = make_tiny_model("llama", init=0.2)
    tensors = random_set(L, D, F, skip=True, threshold=0.05)
    tc = load_transcoder(write_circuit_tracer(tmp_path / "ct", tensors, scan="org/tiny-plt"))
    graph = attribute(model, tokenizer, tc, PROMPT)
    nodes = graph.nodes()
    top = nodes[nodes.kind == "feature"].iloc[0]
    layer, feature = int(top.layer), int(top.feature)
    unused = 47 if (layer, feature) != (0, 47) else 46  # a feature of the set, maybe inactive
    (tmp_path / "labels.csv").write_text(f"layer,feature,label\n{layer},{feature},city names\n"
                                         f"0,{unused},unused\n")
    labels = read_labels(tmp_path / "labels.csv")
    payload = graph.to_json(labels=labels, node_threshold=1.0, edge_threshold=1.0)
    check_graph_json(payload)
    assert payload["metadata"]["scan"] == "org/tiny-plt"
    assert payload["metadata"]["info"]["transcoder"]["skip"] is True
    features = [n for n in payload["nodes"] if n["feature_type"] == "cross layer transcoder"]
    # circuit-tracer's Neuronpedia numbering: feature + 10**ceil(log10(48)) * layer
    assert features and all(n["feature"] == int(n["layer"]) * 100 + int(n["node_id"].split("_")[1])
                            for n in features)
    labelled = [n for n in payload["nodes"] if n["clerp"] == "city names"]
    assert [(int(n["layer"]), n["node_id"].split("_")[1]) for n in labelled] and \
        all(n["layer"] == str(layer) and n["node_id"].split("_")[1] == str(feature)
            for n in labelled)
    # JSON tables and bad tables
    (tmp_path / "labels.json").write_text(json.dumps({f"{layer}/{feature}": "city names"}))
    assert read_labels(tmp_path / "labels.json") == {(layer, feature): "city names"}
    (tmp_path / "bad.csv").write_text("layer,feature\n1,2\n")
    with pytest.raises(ValueError, match="need columns layer, feature and label"):
        read_labels(tmp_path / "bad.csv")
    (tmp_path / "bad2.tsv").write_text("layer\tfeature\tlabel\none\t2\tx\n")
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) has layer 'one'"):
        read_labels(tmp_path / "bad2.tsv")


def test_a_hook_the_model_lacks_is_refused_before_anything_runs(tmp_path, tokenizer):
    model, tc, _ = _set("gemma2", tmp_path, "gemmascope")
    del model.model.layers[0].post_feedforward_layernorm
    with pytest.raises(TranscoderMismatchError,
                       match="'hook_mlp_out' maps to model.layers.0..post_feedforward_layernorm"):
        attribute(model, tokenizer, tc, PROMPT)
