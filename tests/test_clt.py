"""The cross-layer transcoder: exact maths against a dense float64 reference, the on-disk
layout round trip, lazy and streamed storage, and bad input."""

from __future__ import annotations

import pytest
import torch
from _support.models import make_tiny_model
from clt_fixtures import dense_reference, random_clt_tensors, write_clt

from pyvene_causaltrace import errors, transcoders
from pyvene_causaltrace.transcoders import (
    Transcoder,
    TranscoderFormatError,
    TranscoderMismatchError,
    check_fits,
    load_from_disk,
    read_config,
)

L, D, F, P = 3, 32, 48, 6


@pytest.fixture
def tensors():
    return random_clt_tensors(L, D, F)


def _resid(seed=1):
    return torch.randn(L, P, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("disk_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lazy_decoder, lazy_encoder", [(True, False), (False, True)])
@pytest.mark.numerics
def test_encode_and_reconstruct_equal_the_dense_reference(tmp_path, tensors, disk_dtype,
                                                          lazy_decoder, lazy_encoder):
    as_disk = {k: ([w.to(disk_dtype) for w in v] if k == "W_dec" else v.to(disk_dtype))
               for k, v in tensors.items()}
    write_clt(tmp_path, as_disk, dtype=disk_dtype)
    clt = load_from_disk(tmp_path, dtype=torch.float64, lazy_decoder=lazy_decoder,
                         lazy_encoder=lazy_encoder)
    resid = _resid()
    ref_acts, ref_recon = dense_reference(as_disk, resid)
    acts = clt.encode_all(resid)
    assert (acts > 0).sum() > 10 and (acts == 0).sum() > 10  # JumpReLU does both
    torch.testing.assert_close(acts, ref_acts, atol=1e-12, rtol=0)
    torch.testing.assert_close(clt.reconstruct(acts), ref_recon, atol=1e-12, rtol=0)
    # float32 compute agrees to float32 precision
    clt32 = load_from_disk(tmp_path, dtype=torch.float32, lazy_decoder=lazy_decoder)
    torch.testing.assert_close(clt32.reconstruct(clt32.encode_all(resid)).double(), ref_recon,
                               atol=1e-5, rtol=1e-5)


def test_jumprelu_threshold_is_strict_and_bos_is_zeroed(tmp_path, tensors):
    tensors["threshold"][:] = 0.5
    write_clt(tmp_path, tensors)
    clt = load_from_disk(tmp_path, dtype=torch.float64)
    z = torch.tensor([0.5, 0.5000001, 0.2, 3.0], dtype=torch.float64)
    x = torch.zeros(D, dtype=torch.float64)
    clt.b_enc[0, :4] = z
    clt.W_enc = torch.zeros_like(clt.W_enc)
    out = clt.encode(x, 0)[:4]
    assert out.tolist() == [0.0, 0.5000001, 0.0, 3.0]
    resid = _resid()
    assert clt.encode_all(resid)[:, 0].abs().sum() == 0
    assert clt.encode_all(resid, zero_bos=False)[:, 0].abs().sum() > 0


@pytest.mark.parametrize("disk_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.numerics
def test_save_model_round_trip_is_byte_exact(tmp_path, tensors, disk_dtype):
    source = write_clt(tmp_path / "src", tensors, model_name="org/tiny", dtype=disk_dtype)
    clt = Transcoder.from_pretrained(str(source))
    assert clt.cfg.disk_dtype == str(disk_dtype).removeprefix("torch.")
    clt.save_model(str(tmp_path / "copy"))
    for file in sorted(source.iterdir()):
        assert (tmp_path / "copy" / file.name).read_bytes() == file.read_bytes(), file.name
    again = Transcoder.load_from_disk(str(tmp_path / "copy"))
    assert again.cfg == clt.cfg
    resid = _resid()
    torch.testing.assert_close(again.reconstruct(again.encode_all(resid)),
                               clt.reconstruct(clt.encode_all(resid)), atol=0, rtol=0)


def test_config_and_hf_hooks(tmp_path, tensors):
    write_clt(tmp_path, tensors, model_name="org/tiny")
    cfg = read_config(tmp_path)
    assert (cfg.n_layers, cfg.d_model, cfg.d_transcoder, cfg.n_features) == (L, D, F, L * F)
    from pyvene_causaltrace.models import get_adapter

    hooks = cfg.hf_hooks(get_adapter("llama"), 2)
    assert hooks == {"input": "model.layers[2].post_attention_layernorm.input",
                     "output": "model.layers[2].mlp.output"}
    assert cfg.hf_hooks(get_adapter("gpt2"), 0)["input"] == "transformer.h[0].ln_2.input"


def test_hub_id_from_the_offline_cache(tmp_path, tensors, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny-clt" / "snapshots" / "abc123"
    write_clt(snapshot, tensors)
    (tmp_path / "hub" / "models--org--tiny-clt" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny-clt" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    clt = Transcoder.from_pretrained("org/tiny-clt")
    assert clt.cfg.n_layers == L
    with pytest.raises(TranscoderFormatError,
                       match="neither a local path nor a reachable hub repo"):
        Transcoder.from_pretrained("org/not-cached")


def test_bad_directories_are_refused(tmp_path, tensors):
    write_clt(tmp_path / "a", tensors)
    (tmp_path / "a" / "W_dec_1.safetensors").unlink()
    with pytest.raises(TranscoderFormatError, match="missing file .*W_dec_1"):
        load_from_disk(tmp_path / "a")

    write_clt(tmp_path / "b", tensors)
    (tmp_path / "b" / "W_enc_2.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(TranscoderFormatError, match="W_enc_2.safetensors is not a readable"):
        load_from_disk(tmp_path / "b")

    bad = dict(tensors, W_dec=[w.clone() for w in tensors["W_dec"]])
    bad["W_dec"][1] = bad["W_dec"][1][:, :1]  # a decoder that skips a target layer
    write_clt(tmp_path / "c", bad)
    with pytest.raises(TranscoderFormatError, match="W_dec_1.safetensors: shapes"):
        load_from_disk(tmp_path / "c")

    write_clt(tmp_path / "d", tensors)
    (tmp_path / "d" / "config.yaml").write_text("model_name: x\nmodel_kind: sae\n"
                                                "feature_input_hook: a\nfeature_output_hook: b\n")
    with pytest.raises(TranscoderFormatError, match="model_kind"):
        load_from_disk(tmp_path / "d")

    with pytest.raises(TranscoderFormatError, match="no config.yaml"):
        load_from_disk(tmp_path / "nothing-here-at-all")

    write_clt(tmp_path / "e", tensors)
    with pytest.raises(ValueError, match="dtype"):
        load_from_disk(tmp_path / "e", dtype=torch.int8)


def test_clt_must_fit_the_model(tmp_path, tensors):
    write_clt(tmp_path, tensors, model_name="tiny")
    clt = load_from_disk(tmp_path)
    check_fits(make_tiny_model("llama", n_layers=L), clt)  # 3 layers x 32: fits
    with pytest.raises(TranscoderMismatchError, match="3 layers x d_model 32; the model has 4"):
        check_fits(make_tiny_model("llama", n_layers=4), clt)


@pytest.mark.numerics
def test_sae_lens_views_and_converters(tmp_path, tensors):
    from sae_lens import SAE
    from sae_lens.saes.transcoder import JumpReLUTranscoder

    from pyvene_causaltrace.transcoders.formats.sae_lens import (
        disk_converter,
        hub_converter,
        to_sae_lens,
    )

    write_clt(tmp_path, tensors, model_name="org/tiny")
    clt = load_from_disk(tmp_path, dtype=torch.float64)
    x = _resid()[1].double()
    acts = clt.encode(x, 1)
    view = to_sae_lens(clt, 1, target=2)
    assert isinstance(view, JumpReLUTranscoder)
    torch.testing.assert_close(view.encode(x.float()).double(), acts, atol=1e-5, rtol=0)
    # the view's decoder is the layer-1 -> layer-2 slice plus b_dec[2]
    torch.testing.assert_close(view.decode(acts.float()).double(),
                               acts @ clt.W_dec[1][:, 1].double() + clt.b_dec[2],
                               atol=1e-5, rtol=0)
    # summing the views over source layers gives the CLT's reconstruction of layer 2
    resid = _resid()
    all_acts = clt.encode_all(resid)
    total = clt.b_dec[2] + sum(
        (to_sae_lens(clt, s, 2).decode(all_acts[s].float()).double() - clt.b_dec[2])
        for s in range(3))
    torch.testing.assert_close(total, clt.reconstruct(all_acts)[2], atol=1e-5, rtol=0)
    loaded = JumpReLUTranscoder.load_from_disk(str(tmp_path), converter=disk_converter(0))
    assert loaded.cfg.metadata.hook_name == "blocks.0.hook_resid_mid"
    assert loaded.cfg.metadata.hook_name_out == "blocks.0.hook_mlp_out"
    torch.testing.assert_close(loaded.threshold.double(), clt.threshold[0])
    via_hub = SAE.from_pretrained(str(tmp_path), "layer_0_to_1", converter=hub_converter)
    assert via_hub.cfg.metadata.hook_name_out == "blocks.1.hook_mlp_out"
    with pytest.raises(ValueError, match="do not write layer"):
        to_sae_lens(clt, 2, target=1)


def test_the_transcoder_errors_are_those_of_errors_py():
    assert TranscoderFormatError is errors.TranscoderFormatError
    assert TranscoderMismatchError is errors.TranscoderMismatchError
    with pytest.raises(AttributeError, match="no attribute 'CLTNothing'"):
        transcoders.CLTNothing  # noqa: B018
