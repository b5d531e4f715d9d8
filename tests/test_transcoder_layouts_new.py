"""GemmaScope-2 (per-layer, affine skip, the CLT) and ByteDance's joint-TopK CLT, each written here
in its published layout with plain safetensors/json/yaml calls and compared with a dense float64
reference of the maths written here; attribution on the joint TopK with its selection frozen at
the clean run; a directory that matches no layout named with what it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from _support.models import PROMPT, make_tiny_model
from safetensors.torch import save_file
from transcoder_fixtures import bytedance_tensors, write_bytedance

from pyvene_causaltrace.attribution import attribute, demeaned_logit, run_local_replacement
from pyvene_causaltrace.attribution.edges import target_row
from pyvene_causaltrace.errors import InputError, TranscoderFormatError
from pyvene_causaltrace.interventions.clt_splice import (
    clean_selection,
    clt_splice_representations,
    splice_session,
)
from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.transcoders.formats import detect_format

L, D, F = 3, 32, 48


# ------------------------------------------------------------------------ GemmaScope-2 files
def gs2_tensors(n_layers=L, d_model=D, width=F, *, affine=False, clt=False, seed=0):
    """Tensors in GemmaScope-2's own orientation: ``w_enc [D, F]``, ``w_dec [F, D]`` (a CLT's
    ``[F, L, D]``, target t at index t), ``affine_skip_connection [D_in, D_out]``; a third of the
    thresholds negative (where ``relu(z) * 1[z > threshold]`` differs from ``z * 1[z >
    threshold]``)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        t = {"w_enc": torch.randn(d_model, width, generator=g) / d_model**0.5,
             "b_enc": torch.randn(width, generator=g) * 0.3,
             "threshold": torch.rand(width, generator=g) * 0.4 - 0.2,
             "b_dec": torch.randn(d_model, generator=g) * 0.05,
             "w_dec": (torch.randn(width, n_layers, d_model, generator=g) if clt
                       else torch.randn(width, d_model, generator=g)) * 0.1}
        if affine:
            t["affine_skip_connection"] = torch.randn(d_model, d_model, generator=g) * 0.05
        layers.append(t)
    return layers


def write_gs2_per_layer(root: Path, layers, variant="width_16k_l0_small", dtype=torch.float32,
                        model_name="google/gemma-3-270m"):
    """``layer_{l}_{variant}/config.json + params.safetensors`` as google/gemma-scope-2-* hold."""
    affine = "affine_skip_connection" in layers[0]
    name = variant + ("_affine" if affine else "")
    for layer, t in enumerate(layers):
        where = root / f"layer_{layer}_{name}"
        where.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype).contiguous() for k, v in t.items()},
                  str(where / "params.safetensors"))
        (where / "config.json").write_text(json.dumps({
            "hf_hook_point_in": f"model.layers.{layer}.pre_feedforward_layernorm.output",
            "hf_hook_point_out": f"model.layers.{layer}.post_feedforward_layernorm.output",
            "width": t["b_enc"].numel(), "model_name": model_name, "architecture": "jump_relu",
            "l0": 10, "affine_connection": affine, "type": "transcoder"}))
    return root, name


def write_gs2_clt(root: Path, layers, dtype=torch.float32):
    """``params_layer_{l}.safetensors`` as ``clt/width_262k_l0_medium_affine`` holds them."""
    root.mkdir(parents=True, exist_ok=True)
    for layer, t in enumerate(layers):
        save_file({k: v.to(dtype).contiguous() for k, v in t.items()},
                  str(root / f"params_layer_{layer}.safetensors"))
    return root


def gs2_reference(layers, inputs, *, clt=False, dtype=torch.float32):
    """Model card maths in float64 on the weights as stored: ``a = relu(z) * 1[z > threshold]``,
    ``out = a @ w_dec + b_dec + x @ affine`` (a CLT sums ``a_l @ w_dec_l[:, t]`` over l <= t);
    position 0 zeroed."""
    d = [{k: v.to(dtype).double() for k, v in t.items()} for t in layers]
    acts = []
    for layer, t in enumerate(d):
        z = inputs[layer].double() @ t["w_enc"] + t["b_enc"]
        a = torch.relu(z) * (z > t["threshold"])
        a[0] = 0
        acts.append(a)
    recon = []
    for target, t in enumerate(d):
        out = t["b_dec"] + torch.zeros_like(inputs[0].double())
        if "affine_skip_connection" in t:
            out = out + inputs[target].double() @ t["affine_skip_connection"]
        sources = range(target + 1) if clt else (target,)
        for source in sources:
            w = d[source]["w_dec"][:, target] if clt else d[source]["w_dec"]
            out = out + acts[source] @ w
        recon.append(out)
    return torch.stack(acts), torch.stack(recon)


def _inputs(n_layers=L, n_pos=7, d_model=D, seed=1):
    return torch.randn(n_layers, n_pos, d_model, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemmascope2_per_layer_folders_equal_the_dense_reference(tmp_path, affine, dtype):
    layers = gs2_tensors(affine=affine)
    root, name = write_gs2_per_layer(tmp_path / "transcoder_all", layers, dtype=dtype)
    write_gs2_per_layer(root, gs2_tensors(affine=affine, seed=5), variant="width_262k_l0_big")
    assert detect_format(root) == "gemmascope2"
    with pytest.raises(TranscoderFormatError, match="2 variants.*variant="):
        load_transcoder(root)
    tc = load_transcoder(root, variant=name, dtype=torch.float64)
    assert tc.cfg.feature_input_hook == "mlp.hook_in"
    assert tc.cfg.feature_output_hook == "hook_mlp_out"
    assert tc.cfg.skip is affine and not tc.cfg.cross_layer
    assert tc.cfg.model_name == "google/gemma-3-270m" and tc.cfg.activation == "jumprelu"
    inputs = _inputs()
    acts_ref, recon_ref = gs2_reference(layers, inputs, dtype=dtype)
    acts = tc.encode_all(inputs.double())
    assert (acts != 0).sum() > 20 and (acts - acts_ref).abs().max() < 1e-10
    assert (tc.reconstruct(acts, inputs.double()) - recon_ref).abs().max() < 1e-10


def test_gemmascope2_through_circuit_tracer_config_is_oriented_by_name(tmp_path):
    """mwhanna's circuit-tracer configs list GemmaScope-2 ``params.safetensors`` files; with
    ``d_model == width`` orientation cannot come from the shapes, and the negative thresholds
    must still act as the model card's ``relu(z) * 1[z > threshold]``."""
    layers = gs2_tensors(width=D, affine=True, seed=3)
    root, name = write_gs2_per_layer(tmp_path / "gs2", layers)
    files = [f"gs2/layer_{layer}_{name}/params.safetensors" for layer in range(L)]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "google/gemma-3-270m", "model_kind": "transcoder_set",
        "feature_input_hook": "mlp.hook_in", "feature_output_hook": "hook_mlp_out",
        "transcoders": files}))
    tc = load_transcoder(tmp_path / "config.yaml", dtype=torch.float64)
    inputs = _inputs()
    acts_ref, recon_ref = gs2_reference(layers, inputs)
    acts = tc.encode_all(inputs.double())
    assert (acts - acts_ref).abs().max() < 1e-10
    assert (tc.reconstruct(acts, inputs.double()) - recon_ref).abs().max() < 1e-10


@pytest.mark.parametrize("lazy", [True, False])
def test_gemmascope2_clt_equals_the_dense_reference(tmp_path, lazy):
    layers = gs2_tensors(affine=True, clt=True, seed=7)
    root = write_gs2_clt(tmp_path / "clt" / "width_262k_l0_medium_affine", layers,
                         dtype=torch.bfloat16)
    assert detect_format(root) == "gemmascope2"
    inputs = _inputs()
    acts_ref, recon_ref = gs2_reference(layers, inputs, clt=True, dtype=torch.bfloat16)
    direct = load_transcoder(root, dtype=torch.float64, lazy_decoder=lazy)
    # circuit-tracer's way in: a config.yaml listing the files (mwhanna/gemma-scope-2-*)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "google/gemma-3-270m", "model_kind": "cross_layer_transcoder",
        "feature_input_hook": "mlp.hook_in", "feature_output_hook": "hook_mlp_out",
        "transcoders": [str(root / f"params_layer_{layer}.safetensors")
                        for layer in range(L)]}))
    listed = load_transcoder(tmp_path / "config.yaml", dtype=torch.float64, lazy_decoder=lazy)
    for tc in (direct, listed):
        assert tc.cfg.cross_layer and tc.cfg.skip and tc.cfg.disk_dtype == "bfloat16"
        assert [tuple(w.shape) for w in tc.W_dec] == [(F, L - layer, D) for layer in range(L)]
        acts = tc.encode_all(inputs.double())
        assert (acts != 0).sum() > 20 and (acts - acts_ref).abs().max() < 1e-10
        assert (tc.reconstruct(acts, inputs.double()) - recon_ref).abs().max() < 1e-10


def test_gemmascope2_files_that_disagree_are_refused(tmp_path):
    layers = gs2_tensors(affine=True)
    del layers[1]["affine_skip_connection"]
    root, name = write_gs2_per_layer(tmp_path / "a", layers)
    with pytest.raises(TranscoderFormatError, match="affine_skip_connection absent"):
        load_transcoder(root)
    clt = gs2_tensors(clt=True)
    clt[2]["w_dec"] = clt[2]["w_dec"][:, :2]
    root = write_gs2_clt(tmp_path / "clt", clt)
    with pytest.raises(TranscoderFormatError, match=r"params_layer_2.safetensors: w_dec"):
        load_transcoder(root)


# ------------------------------------------------------------------------ ByteDance files
def joint_reference(t: dict, inputs: torch.Tensor, per_layer: bool = False):
    """Float64: ``a_l = relu(W_enc_l x_l)``, score ``a_l * ||W_dec_l[i]||``, keep the ``L * k``
    best over all layers at each position (``per_layer``: the ``k`` best of each layer, the rule
    this layout does NOT use); decode ``sum_{l <= m} a_l @ W_dec_l[:, m - l]``."""
    n_layers, k = len(t["W_enc"]), t["k"]
    a = torch.stack([torch.relu(inputs[layer].double() @ t["W_enc"][layer].double().T)
                     for layer in range(n_layers)])  # [L, P, F]
    norms = torch.stack([w.double().flatten(1).norm(dim=1) for w in t["W_dec"]])
    score = a * norms[:, None, :]
    keep = torch.zeros_like(score, dtype=torch.bool)
    for pos in range(score.shape[1]):
        if per_layer:
            for layer in range(n_layers):
                keep[layer, pos, score[layer, pos].topk(k).indices] = True
        else:
            flat = score[:, pos].reshape(-1)
            chosen = flat.topk(n_layers * k).indices
            keep[chosen // score.shape[2], pos, chosen % score.shape[2]] = True
    acts = a * keep * (a > 0)
    acts[:, 0] = 0
    recon = torch.stack([sum(acts[src] @ t["W_dec"][src][:, m - src].double()
                             for src in range(m + 1)) for m in range(n_layers)])
    return acts, recon


def test_bytedance_joint_topk_equals_the_dense_reference(tmp_path):
    t = bytedance_tensors()
    root = write_bytedance(tmp_path / "Cross-Layer-TopK-CLT", t)
    assert detect_format(root) == "bytedance"
    tc = load_transcoder(root, dtype=torch.float64)
    cfg = tc.cfg
    assert (cfg.activation, cfg.k, cfg.cross_layer, cfg.skip) == ("joint_topk", L * 4, True, False)
    assert (cfg.feature_input_hook, cfg.feature_output_hook) == ("hook_resid_mid", "mlp.hook_out")
    assert cfg.model_name == "Qwen/Qwen3-8B-Base"
    assert not tc.b_enc.any() and not tc.b_dec.any()
    inputs = _inputs(n_pos=9)
    acts_ref, recon_ref = joint_reference(t, inputs)
    per_layer, _ = joint_reference(t, inputs, per_layer=True)
    assert not torch.equal(acts_ref != 0, per_layer != 0)  # the two rules differ here
    counts = (acts_ref[:, 1:] != 0).sum(-1)  # features per (layer, position): uneven
    assert (counts.sum(0) == L * 4).all() and (counts != 4).any()
    acts = tc.encode_all(inputs.double())
    assert torch.equal(acts != 0, acts_ref != 0)
    assert (acts - acts_ref).abs().max() < 1e-10
    assert (tc.reconstruct(acts, inputs.double()) - recon_ref).abs().max() < 1e-10
    with pytest.raises(InputError, match="all 3 layers"):
        tc.encode(inputs[0], 0)


def test_bytedance_files_that_disagree_are_refused(tmp_path):
    t = bytedance_tensors()
    root = write_bytedance(tmp_path / "b", t)
    save_file({"W_dec_norm": torch.ones(L, F)}, str(root / "W_dec_norm.safetensors"))
    with pytest.raises(TranscoderFormatError, match="W_dec_norm_0 differs"):
        load_transcoder(root)
    root = write_bytedance(tmp_path / "c", t)
    save_file({"W_dec_1": t["W_dec"][1][:, :1].contiguous(),
               "W_dec_norm_1": torch.ones(F)}, str(root / "W_dec_1.safetensors"))
    with pytest.raises(TranscoderFormatError, match="W_dec_1.safetensors holds"):
        load_transcoder(root)


# ----------------------------------------------------------------- joint TopK in the model
def _hand_inputs(model, ids):
    """Each layer's ``resid_mid`` (the input of ``post_attention_layernorm``), read with plain
    torch hooks: ``[L, P, D]``."""
    found = {}
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda _m, args, i=i: found.__setitem__(i, args[0][0].detach()))
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([found[i] for i in range(len(found))])


@pytest.fixture()
def joint_setup(tmp_path, tokenizer):
    model = make_tiny_model("qwen3", init=0.2, n_layers=L)
    t = bytedance_tensors(k=3, seed=2)
    clt = load_transcoder(write_bytedance(tmp_path / "joint", t))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return model, t, clt, ids


def test_joint_topk_attribution_closes_with_the_selection_frozen_at_the_clean_run(
        joint_setup, tokenizer):
    model, t, clt, ids = joint_setup
    clean = model(input_ids=ids).logits
    run = run_local_replacement(model, clt, ids)
    assert run.logits.shape[1] == 1  # the last position's: every logit target reads it
    assert (run.logits.detach() - clean[:, -1:]).abs().max() < 1e-4
    target = demeaned_logit(clean, int(clean[0, -1].argmax()), 10)
    _, _, closure = target_row(run, target)
    assert closure.relative < 1e-4, closure
    # the nodes are exactly the clean run's joint top-k (the reference's, from hand hooks) ...
    acts_ref, _ = joint_reference(t, _hand_inputs(model, ids))
    expected = {tuple(x) for x in (acts_ref != 0).nonzero().tolist()}
    got = set(zip(run.feature_layer.tolist(), run.feature_position.tolist(),
                  run.feature_id.tolist(), strict=True))
    assert got == expected
    # ... not a per-layer top-k's, which keeps other features
    per_layer, _ = joint_reference(t, _hand_inputs(model, ids), per_layer=True)
    assert got != {tuple(x) for x in (per_layer != 0).nonzero().tolist()}
    values = acts_ref[run.feature_layer, run.feature_position, run.feature_id]
    assert (run.activation.double() - values).abs().max() < 1e-4
    # position 0 as BOS, as the reference (the tiny tokenizer adds none: "auto" splices it)
    graph = attribute(model, tokenizer, clt, PROMPT, batch_size=16, bos="always")
    assert graph.closure.relative < 1e-4 and graph.feature_closure() < 1e-4
    assert graph.n_features == len(expected)


def test_joint_topk_live_splice_needs_a_selection_and_is_exact_with_the_clean_one(joint_setup):
    model, t, clt, ids = joint_setup
    runner = intervenable_model_class()
    bare = runner(clt_splice_representations(model, clt, add_error=True), model)
    with pytest.raises(InputError, match="only after its last layer.*clean_selection"):
        bare(base={"input_ids": ids, "use_cache": False})
    selection = clean_selection(model, clt, ids)
    reps = clt_splice_representations(model, clt, add_error=True, selection=selection)
    _, out = runner(reps, model)(base={"input_ids": ids, "use_cache": False})
    clean = model(input_ids=ids).logits
    assert (out.logits - clean).abs().max() < 1e-4
    acts_ref, _ = joint_reference(t, _hand_inputs(model, ids))
    session = splice_session(reps)
    acts = torch.stack([session.acts[layer][0] for layer in range(L)])
    assert (acts.double() - acts_ref).abs().max() < 1e-4
    with pytest.raises(InputError, match="selection= is for a joint_topk"):
        per_layer = load_transcoder(write_gs2_clt(Path(clt.source).parent / "gs2",
                                                  gs2_tensors(clt=True)))
        clt_splice_representations(model, per_layer, selection=selection)


# ------------------------------------------------------------------------ unknown layouts
def test_a_directory_matching_no_layout_is_named_with_its_files(tmp_path):
    """ByteDance's files without ``W_dec_norm.safetensors``: no detector matches; the one error
    line names what is there and the layouts we read."""
    root = write_bytedance(tmp_path / "partial", bytedance_tensors())
    (root / "W_dec_norm.safetensors").unlink()
    with pytest.raises(TranscoderFormatError) as caught:
        load_transcoder(root)
    message = str(caught.value)
    assert "\n" not in message
    for needed in ("W_enc_0.safetensors", "config.json", "factors.safetensors", "bytedance",
                   "gemmascope2", "mntss", "format="):
        assert needed in message, (needed, message)


def test_a_gemmascope2_clt_hub_subfolder_resolves_from_the_offline_cache(tmp_path,
                                                                         monkeypatch):
    """``google/gemma-scope-2-*/clt/<variant>`` has no config.yaml: the subfolder is fetched
    (here: from the offline cache) and its layout detected."""
    cache = tmp_path / "hub"
    base = cache / "models--google--gemma-scope-2-270m-pt"
    layers = gs2_tensors(affine=True, clt=True, seed=11)
    write_gs2_clt(base / "snapshots" / "c0ffee" / "clt" / "width_262k_l0_medium_affine", layers)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text("c0ffee")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    tc = load_transcoder("google/gemma-scope-2-270m-pt/clt/width_262k_l0_medium_affine",
                         dtype=torch.float64)
    inputs = _inputs()
    acts_ref, recon_ref = gs2_reference(layers, inputs, clt=True)
    acts = tc.encode_all(inputs.double())
    assert (tc.reconstruct(acts, inputs.double()) - recon_ref).abs().max() < 1e-10
