"""llamascopium's per-layer transcoders (``sae_type: "sae"``), written here as 2.0.0b34 writes
them (``config.json`` from ``save_hyperparameters``, ``sae_weights.safetensors`` holding
``W_E [D, F]``, ``b_E``, ``W_D [F, D]``, ``b_D`` and the dataset-norm scalars) beside a Lorsa
of the same replacement model, and compared with their encode/decode transcribed from
models/sae.py (``hidden_pre * |W_D|`` through the activation, then ``/ |W_D|``): TopK ranked
by the decoder norm, JumpReLU's threshold on the scaled value, ``dataset-wise`` folded.
The graph-level equality with llamascopium itself: tests_peer/test_lorsa_peer_equality.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa
from safetensors.torch import load_file, save_file

from pyvene_causaltrace.errors import InputError, TranscoderFormatError
from pyvene_causaltrace.transcoders import load_transcoder, save_transcoder
from pyvene_causaltrace.transcoders.formats import detect_format
from pyvene_causaltrace.transcoders.lorsa import load_lorsa

L, D, F, K = 3, 16, 40, 4
#: dataset norms that fold to nothing (sqrt(d_model))
UNIT = (math.sqrt(D), math.sqrt(D))
NORM = "dataset_average_activation_norm."


def sae_config(layer: int, **changes) -> dict:
    cfg = {"sae_type": "sae", "d_model": D, "expansion_factor": F / D, "use_decoder_bias": True,
           "act_fn": "topk", "norm_activation": "inference", "sparsity_include_decoder_norm": True,
           "top_k": K, "use_triton_kernel": False,
           "sparsity_threshold_for_triton_spmm_kernel": 0.996, "jumprelu_threshold_window": 2.0,
           "hook_point_in": f"blocks.{layer}.ln2.hook_normalized",
           "hook_point_out": f"blocks.{layer}.hook_mlp_out", "use_glu_encoder": False}
    cfg.update(changes)
    return cfg


def sae_tensors(seed: int, jumprelu: bool = False) -> dict:
    """Decoder rows of norm 0.2 to 3: ranking by ``pre * |W_D|`` picks other features than
    ranking by ``pre``."""
    g = torch.Generator().manual_seed(seed)
    W_D = torch.randn(F, D, generator=g)
    W_D = W_D / W_D.norm(dim=1, keepdim=True) * (0.2 + 2.8 * torch.rand(F, 1, generator=g))
    out = {"W_E": torch.randn(D, F, generator=g) / math.sqrt(D), "b_E": 0.1 * torch.randn(F,
           generator=g), "W_D": W_D, "b_D": 0.1 * torch.randn(D, generator=g)}
    if jumprelu:
        out["activation_function.log_jumprelu_threshold"] = torch.log(
            0.3 + 0.5 * torch.rand(F, generator=g))
    return out


def write_set(root: Path, norms=UNIT, lorsa: bool = True,
              **changes) -> tuple[Path, list[dict], list[dict]]:
    """``root/transcoder-L{l}`` for every layer (and ``root/lorsa-L0`` beside them)."""
    configs, weights = [], []
    for layer in range(L):
        cfg = sae_config(layer, **changes)
        tensors = sae_tensors(layer, jumprelu=cfg["act_fn"] == "jumprelu")
        folder = root / f"transcoder-L{layer}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(cfg, indent=4))
        state = dict(tensors) | {f"dataset_average_activation_norm.{cfg[k]}": torch.tensor(n)
                                 for k, n in zip(("hook_point_in", "hook_point_out"), norms,
                                                 strict=True)}
        save_file(state, str(folder / "sae_weights.safetensors"), {"version": "2.0.0b34"})
        (folder / "lm_config.json").write_text(json.dumps({"model_name": "tiny-qwen3"}))
        configs.append(cfg)
        weights.append(tensors)
    if lorsa:
        write_peer_lorsa(root / "lorsa-L0", peer_config(0, d_model=D, n_qk=2, d_qk=4),
                         peer_tensors(peer_config(0, d_model=D, n_qk=2, d_qk=4)))
    return root, configs, weights


def theirs(cfg: dict, t: dict, x: torch.Tensor, norms=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(feature acts, reconstruction) as models/sae.py computes them (transcribed)."""
    if cfg["norm_activation"] == "dataset-wise":
        x = x * math.sqrt(D) / norms[0]
    pre = x @ t["W_E"] + t["b_E"]
    norm = t["W_D"].norm(dim=1) if cfg["sparsity_include_decoder_norm"] else torch.ones(F)
    scored = pre * norm
    if cfg["act_fn"] == "topk":
        scored = scored * scored.gt(0)
        keep = torch.zeros_like(scored, dtype=torch.bool).scatter(
            -1, scored.topk(cfg["top_k"], dim=-1).indices, True)
        acts = scored * keep
    elif cfg["act_fn"] == "jumprelu":
        acts = scored * scored.gt(t["activation_function.log_jumprelu_threshold"].exp())
    else:
        acts = scored * scored.gt(0)
    acts = acts / norm
    recon = acts @ t["W_D"] + t["b_D"]
    if cfg["norm_activation"] == "dataset-wise":
        recon = recon / (math.sqrt(D) / norms[1])
        acts = acts / (math.sqrt(D) / norms[0])  # what their folded model's acts are
    return acts, recon


@pytest.mark.parametrize(("act_fn", "dataset_wise"), [
    ("topk", False), ("topk", True), ("relu", False), ("relu", True), ("jumprelu", False)])
def test_equals_their_encode_and_decode(tmp_path, act_fn, dataset_wise):
    norms = (2.5, 7.0) if dataset_wise else UNIT
    root, configs, weights = write_set(
        tmp_path / "set", norms, act_fn=act_fn,
        norm_activation="dataset-wise" if dataset_wise else "inference")
    assert detect_format(root) == "llamascopium"
    tc = load_transcoder(root)
    cfg = tc.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.d_transcoder, cfg.model_name) == (L, D, F,
                                                                            "tiny-qwen3")
    assert (cfg.feature_input_hook, cfg.feature_output_hook) == ("ln2.hook_normalized",
                                                                  "hook_mlp_out")
    assert cfg.activation == {"topk": "relu_topk", "jumprelu": "jumprelu", "relu": "relu"}[act_fn]
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(5))
    for layer in range(L):
        acts, recon = theirs(configs[layer], weights[layer], x, norms)
        mine = tc.encode(x, layer)
        assert torch.equal(mine != 0, acts != 0), layer
        assert torch.allclose(mine, acts, atol=1e-5)
        ours_recon = mine @ tc.W_dec[layer][:, 0] + tc.b_dec[layer]
        assert torch.allclose(ours_recon, recon, atol=1e-4)
    if act_fn == "topk":  # control: ranked by relu(pre) alone, other features win
        tc.score_weight = None
        assert any(not torch.equal(tc.encode(x, layer) != 0,
                                   theirs(configs[layer], weights[layer], x, norms)[0] != 0)
                   for layer in range(L))


def test_the_lorsa_beside_is_left_to_load_lorsa_and_the_other_way_round(tmp_path):
    root, _, _ = write_set(tmp_path / "set", norms=(1.0, 1.0))
    assert load_transcoder(root, format="llamascopium").cfg.n_layers == L
    lorsa = load_lorsa(root)  # the transcoders beside it are skipped
    assert list(lorsa.layers) == [0]
    one = load_transcoder(root / "transcoder-L0", format="llamascopium")  # one directory
    assert one.cfg.n_layers == 1


def test_a_ranked_set_is_not_written_in_circuit_tracers_layout(tmp_path):
    root, _, _ = write_set(tmp_path / "set", lorsa=False)
    with pytest.raises(InputError, match="score_weight"):
        save_transcoder(load_transcoder(root), tmp_path / "out")
    relu, _, _ = write_set(tmp_path / "relu", lorsa=False, act_fn="relu")
    save_transcoder(load_transcoder(relu), tmp_path / "out")  # nothing lost: written


@pytest.mark.parametrize(("changes", "match"), [
    ({"use_glu_encoder": True}, "use_glu_encoder"),
    ({"apply_decoder_bias_to_pre_encoder": True}, "apply_decoder_bias_to_pre_encoder"),
    ({"act_fn": "batchtopk"}, "act_fn 'batchtopk'"),
    ({"norm_activation": "token-wise"}, "norm_activation 'token-wise'"),
    ({"sae_type": "clt"}, "sae_type 'clt'"),
    ({"hook_point_out": "blocks.{l}.ln2.hook_normalized"}, "an SAE, not a transcoder"),
    ({"hook_point_out": "blocks.9.hook_mlp_out"}, "not a per-layer transcoder"),
    ({"hook_point_in": "ln2.hook_normalized"}, "blocks.<layer>.<hook>"),
    ({"top_k": 0}, "top_k"),
    # their fold leaves a JumpReLU threshold unscaled: folded and unfolded fire differently
    ({"act_fn": "jumprelu", "norm_activation": "dataset-wise"}, "their own fold"),
    # the config against the tensors (W_E [16, 40]): their strict loader refuses these too
    ({"d_model": 99}, r"d_model 99 gives 99; W_E \[16, 40\] holds 16"),
    ({"expansion_factor": 8}, r"expansion_factor 8 gives 128; W_E \[16, 40\] holds 40"),
])
def test_what_we_cannot_represent_is_refused_naming_the_file(tmp_path, changes, match):
    root, _, _ = write_set(tmp_path / "set", lorsa=False)
    folder = root / "transcoder-L1"
    if changes.get("act_fn") == "jumprelu":  # its threshold tensor
        (folder / "sae_weights.safetensors").unlink()
        save_file(sae_tensors(1, jumprelu=True) | {
            f"dataset_average_activation_norm.blocks.1.{h}": torch.tensor(1.0)
            for h in ("ln2.hook_normalized", "hook_mlp_out")},
            str(folder / "sae_weights.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update({k: v.replace("{l}", "1") if isinstance(v, str) else v
                for k, v in changes.items()})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TranscoderFormatError, match=match) as error:
        load_transcoder(root, format="llamascopium")
    assert "transcoder-L1" in str(error.value)


@pytest.mark.parametrize("act_fn", ["topk", "relu"])
@pytest.mark.parametrize("norms", [(-2.5, 7.0), (0.0, 7.0), (2.5, 0.0)])
def test_a_dataset_norm_that_is_not_positive_is_refused(tmp_path, act_fn, norms):
    """A negative input norm folded (``b_E / into``, ``W_D * into``) is not their forward
    (``relu`` does not commute with a negative scale: the reconstruction was off by more than
    its size); a zero one divided by zero. Refused, naming the file and the tensor."""
    root, _, _ = write_set(tmp_path / "set", norms, lorsa=False, act_fn=act_fn,
                           norm_activation="dataset-wise")
    hook = "ln2.hook_normalized" if norms[0] <= 0 else "hook_mlp_out"
    with pytest.raises(TranscoderFormatError, match=rf"transcoder-L0/sae_weights\.safetensors: "
                                                    rf"dataset_average_activation_norm\.blocks"
                                                    rf"\.0\.{hook} is .*not a positive norm"):
        load_transcoder(root)


def test_a_top_k_past_the_features_is_refused_when_read_not_when_encoding(tmp_path):
    """top_k 41 of 40 features once loaded and failed in torch.topk at the first encode."""
    root, _, _ = write_set(tmp_path / "set", lorsa=False, top_k=F + 1)
    with pytest.raises(TranscoderFormatError, match=r"transcoder-L0/sae_weights\.safetensors: "
                                                    r"top_k 41 is more than the 40 features"):
        load_transcoder(root)


def test_a_missing_layer_and_a_set_of_two_kinds_are_refused(tmp_path):
    root, _, _ = write_set(tmp_path / "set", lorsa=False)
    (root / "transcoder-L1" / "config.json").unlink()
    with pytest.raises(TranscoderFormatError, match=r"layer\(s\) \[1\]"):
        load_transcoder(root, format="llamascopium")
    root, _, _ = write_set(tmp_path / "two", lorsa=False)
    cfg = json.loads((root / "transcoder-L2" / "config.json").read_text())
    (root / "transcoder-L2" / "config.json").write_text(json.dumps(cfg | {"top_k": 7}))
    with pytest.raises(TranscoderFormatError, match="top_k 7"):
        load_transcoder(root, format="llamascopium")
    with pytest.raises(TranscoderFormatError, match="no llamascopium transcoder"):
        load_transcoder(tmp_path, format="llamascopium")  # sets below, none here


class _Ranks:
    """Two ranks' all_gather played back in one process: each shard's top-k candidates are
    recorded on a first pass, then every shard is handed both."""

    def __init__(self, sent: dict | None = None):
        self.sent, self.seen = sent, []

    def all_gather(self, tensor, what):
        self.seen.append(tensor)
        return [tensor] if self.sent is None else [self.sent[0], self.sent[1]]


def test_a_sharded_ranked_set_keeps_the_whole_sets_features(tmp_path, monkeypatch):
    """Shards of a set ranked by decoder norms (``score_weight`` cut with the features) pick,
    over both ranks, what the whole set picks; control: unweighted ranking picks others."""
    from pyvene_causaltrace import distributed

    root, _, _ = write_set(tmp_path / "set", lorsa=False)
    whole = load_transcoder(root)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(3))
    shards = [load_transcoder(root, shard=(rank, 2)) for rank in range(2)]
    assert [s.score_weight.shape for s in shards] == [(L, F // 2)] * 2
    for layer in range(L):
        sent = {}
        for rank, shard in enumerate(shards):
            fake = _Ranks()
            monkeypatch.setattr(distributed, "current", lambda fake=fake: fake)
            shard.encode(x, layer)
            sent[rank] = fake.seen[0]
        parts = []
        for shard in shards:
            monkeypatch.setattr(distributed, "current", lambda sent=sent: _Ranks(sent))
            parts.append(shard.encode(x, layer))
        assert torch.equal(torch.cat(parts, -1), whole.encode(x, layer)), layer
    whole.score_weight = None
    assert any(not torch.equal(whole.encode(x, layer) != 0, load_transcoder(root).encode(
        x, layer) != 0) for layer in range(L))


@pytest.mark.parametrize("act_fn", ["topk", "relu"])
def test_a_bfloat16_file_is_folded_in_float32(tmp_path, act_fn):
    """A bfloat16 set read as float32 was folded (``b_E / into``, ``W_D * into / out``) in
    bfloat16 before the cast: every folded weight rounded again, the TopK ranking moved. The
    reference: their forward in float64 on the stored weights."""
    norms = (3.3, 7.0)
    root, configs, _ = write_set(tmp_path / "set", norms, lorsa=False, act_fn=act_fn,
                                 norm_activation="dataset-wise")
    stored = []
    for layer in range(L):
        file = root / f"transcoder-L{layer}" / "sae_weights.safetensors"
        state = {k: v.to(torch.bfloat16) for k, v in load_file(str(file)).items()}
        save_file(state, str(file))
        stored.append({k: v.double() for k, v in state.items()})
    tc = load_transcoder(root)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for layer in range(L):
        cfg, weights = configs[layer], stored[layer]
        acts, recon = theirs(cfg, weights, x, [float(weights[f"{NORM}{cfg[key]}"])
                                               for key in ("hook_point_in", "hook_point_out")])
        mine = tc.encode(x.float(), layer)
        assert torch.equal(mine != 0, acts != 0), layer
        ours = (mine @ tc.W_dec[layer][:, 0] + tc.b_dec[layer]).double()
        torch.testing.assert_close(ours, recon, atol=1e-5, rtol=1e-5)
