"""Files a reader must refuse, or read as their own project does, rather than return wrong
numbers without an error (audit of the layout readers): sae-lens input normalisation,
circuit-tracer configs contradicting their files, GemmaScope's ``relu(z) * 1[z > threshold]``
with negative thresholds, two files or folders naming one layer."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import yaml
from transcoder_fixtures import (
    dense_reference,
    random_set,
    write_circuit_tracer,
    write_gemmascope,
    write_sae_lens,
    write_sparsify,
)

from pyvene_causaltrace.transcoders import TranscoderFormatError, load_transcoder

L, D, F = 2, 8, 12


def _set_cfg(root, **fields):
    for sub in root.iterdir():
        cfg = json.loads((sub / "cfg.json").read_text())
        (sub / "cfg.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("mode", ["layer_norm", "constant_norm_rescale",
                                  "expected_average_only_in"])
def test_sae_lens_input_normalisation_is_refused_not_ignored(tmp_path, mode):
    from sae_lens import SAE

    tensors = random_set(L, D, F)
    root = write_sae_lens(tmp_path / "sl", tensors)
    _set_cfg(root, normalize_activations=mode)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0)) * 3 + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sae = SAE.load_from_disk(str(root / "transcoder_layer_0"))
    raw, _ = dense_reference({**tensors, "layers": tensors["layers"][:1]}, x[None])
    if mode != "expected_average_only_in":  # sae-lens itself rescales the input at run time:
        assert not torch.allclose(sae.encode(x)[1:].double(), raw[0, 1:], atol=1e-4)
    # (expected_average_only_in: the weights want x times a factor the files do not hold)
    with pytest.raises(TranscoderFormatError, match="normalize_activations"):
        load_transcoder(root, format="sae_lens")


def test_circuit_tracer_config_contradicting_its_files_is_refused(tmp_path):
    # k: the config's 5 against the files' 3 (read before: 5, silently)
    tensors = random_set(L, D, F, activation="topk", k=3)
    config = write_circuit_tracer(tmp_path / "k", tensors, k_in_files=True)
    meta = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**meta, "activation": "topk", "k": 5}))
    with pytest.raises(TranscoderFormatError, match="files hold k"):
        load_transcoder(config)
    config.write_text(yaml.safe_dump({**meta, "activation": "topk", "k": 3}))
    assert load_transcoder(config).cfg.k == 3  # agreeing: read
    # k without activation: topk (read before: relu, or jumprelu, k ignored)
    relu = write_circuit_tracer(tmp_path / "relu", random_set(L, D, F, activation="relu"))
    relu.write_text(yaml.safe_dump({**yaml.safe_load(relu.read_text()), "activation": None,
                                    "k": 3}))
    with pytest.raises(TranscoderFormatError, match="a top-k set says activation: topk"):
        load_transcoder(relu)
    # activation relu over files holding thresholds (read before: relu, thresholds dropped)
    config = write_circuit_tracer(tmp_path / "act", random_set(L, D, F))
    meta = yaml.safe_load(config.read_text())
    for activation in ("relu", "topk"):
        config.write_text(yaml.safe_dump({**meta, "activation": activation}
                                         | ({"k": 3} if activation == "topk" else {})))
        with pytest.raises(TranscoderFormatError, match="JumpReLU thresholds"):
            load_transcoder(config)


def test_gemmascope_negative_thresholds_keep_the_relu(tmp_path):
    # GemmaScope's JumpReLU is relu(z) * 1[z > threshold]: a negative threshold never lets a
    # negative pre-activation through (it did: z * 1[z > threshold] read the files as they were)
    tensors = random_set(L, D, F, threshold=-0.5)
    root = write_gemmascope(tmp_path / "gs", tensors)
    x = torch.randn(L, 6, D, generator=torch.Generator().manual_seed(1))
    tc = load_transcoder(root, dtype=torch.float64)
    acts = tc.encode_all(x.double())
    W = [t["W_enc"].double() for t in tensors["layers"]]
    z = torch.stack([x[layer].double() @ W[layer].T + tensors["layers"][layer]["b_enc"].double()
                     for layer in range(L)])
    thresholds = torch.stack([t["threshold"].double() for t in tensors["layers"]])
    want = torch.relu(z) * (z > thresholds[:, None])
    want[:, 0] = 0
    assert (z[:, 1:] < 0).logical_and(z[:, 1:] > thresholds[:, None]).any()  # the case arises
    torch.testing.assert_close(acts, want, atol=1e-12, rtol=0)


def test_two_files_naming_one_layer_are_refused_not_one_picked(tmp_path):
    # layer_1 and layer_01 (or layers.1.mlp and model.layers.1.mlp) both parse as layer 1: one
    # of them was read, which one by directory order, without a word
    tensors, other = random_set(L, D, F), random_set(L, D, F, seed=5)
    config = write_circuit_tracer(tmp_path / "ct", tensors)
    write_circuit_tracer(tmp_path / "ct2", other)
    shutil.copy(tmp_path / "ct2" / "layer_1.safetensors", tmp_path / "ct" / "layer_01.safetensors")
    meta = yaml.safe_load(config.read_text())
    meta.pop("transcoders", None)
    config.write_text(yaml.safe_dump(meta))
    root = write_gemmascope(tmp_path / "gs", tensors)
    shutil.copytree(root / "layer_1", root / "layer_01")
    topk = random_set(L, D, F, activation="topk", k=3)
    sparse = write_sparsify(tmp_path / "sp", topk)
    write_sparsify(tmp_path / "sp2", topk, prefix="model.layers")
    shutil.copytree(tmp_path / "sp2" / "model.layers.1.mlp", sparse / "model.layers.1.mlp")
    for source in (config, root, sparse):
        with pytest.raises(TranscoderFormatError, match="both name layer 1"):
            load_transcoder(source)
