"""Per-layer transcoder sets in every layout we read — circuit-tracer, GemmaScope npz, sae-lens,
sparsify — load equal to a dense float64 reference; hub references resolve offline; bad sets
are refused whole."""

from __future__ import annotations

import inspect
import json
import warnings

import pytest
import torch
import yaml
from clt_fixtures import random_clt_tensors, write_clt
from safetensors.torch import save_file
from transcoder_fixtures import (
    dense_reference,
    random_set,
    rounded,
    write_circuit_tracer,
    write_gemmascope,
    write_sae_lens,
    write_sparsify,
)

from pyvene_causaltrace.transcoders import (
    FORMATS,
    TranscoderFormatError,
    detect_format,
    load_transcoder,
    save_transcoder,
)
from pyvene_causaltrace.transcoders.formats import _DETECTORS
from pyvene_causaltrace.transcoders.transcoder import activate

L, D, F = 3, 32, 48


def _inputs(seed=0, n_pos=6):
    return torch.randn(L, n_pos, D, generator=torch.Generator().manual_seed(seed))


def _assert_matches(tc, tensors, fold_b_dec=False):
    x = _inputs()
    acts, recon = dense_reference(tensors, x, fold_b_dec=fold_b_dec)
    got = tc.encode_all(x.double())
    assert torch.equal(got != 0, acts != 0)
    torch.testing.assert_close(got, acts, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(tc.reconstruct(got, x.double()), recon, atol=1e-10, rtol=1e-10)


CASES = [("jumprelu", False), ("jumprelu", True), ("relu", False), ("relu", True),
         ("topk", False), ("topk", True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation,skip", CASES)
@pytest.mark.numerics
def test_circuit_tracer_set_equals_the_dense_reference(tmp_path, activation, skip, dtype):
    tensors = random_set(L, D, F, skip=skip, activation=activation, k=5)
    config = write_circuit_tracer(tmp_path / "set", tensors, dtype=dtype, scan="org/set")
    assert detect_format(config.parent) == "circuit_tracer"
    tc = load_transcoder(config, dtype=torch.float64)
    assert not tc.cfg.cross_layer and tc.cfg.skip == skip and tc.cfg.activation == activation
    assert tc.cfg.disk_dtype == str(dtype).removeprefix("torch.") and tc.cfg.scan == "org/set"
    assert tc._handles  # decoders memory-mapped
    _assert_matches(tc, rounded(tensors, dtype))
    # written back (circuit-tracer's layout) and read again: identical bytes, identical maths
    save_transcoder(tc, tmp_path / "again")
    for layer in range(L):
        assert (tmp_path / "again" / f"layer_{layer}.safetensors").read_bytes() == \
            (tmp_path / "set" / f"layer_{layer}.safetensors").read_bytes()
    _assert_matches(load_transcoder(tmp_path / "again", dtype=torch.float64),
                    rounded(tensors, dtype))


@pytest.mark.numerics
def test_circuit_tracer_older_files_and_k_in_the_files(tmp_path):
    tensors = random_set(L, D, F, activation="topk", k=4)
    config = write_circuit_tracer(tmp_path / "old", tensors, transposed_decoder=True,
                                  k_in_files=True)
    tc = load_transcoder(config, dtype=torch.float64)
    assert tc.cfg.k == 4
    _assert_matches(tc, tensors)
    # GemmaScope-2 style keys: w_enc [D, F], affine_skip_connection [D_in, D_out]
    t = random_set(L, D, F, skip=True)
    root = tmp_path / "gs2"
    root.mkdir()
    for layer, lt in enumerate(t["layers"]):
        save_file({"w_enc": lt["W_enc"].T.contiguous(), "w_dec": lt["W_dec"],
                   "b_enc": lt["b_enc"], "b_dec": lt["b_dec"], "threshold": lt["threshold"],
                   "affine_skip_connection": lt["W_skip"].T.contiguous()},
                  str(root / f"layer_{layer}.safetensors"))
    (root / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "hook_mlp_out"}))
    _assert_matches(load_transcoder(root, dtype=torch.float64), t)


@pytest.mark.numerics
def test_gemmascope_npz_equals_the_dense_reference(tmp_path):
    tensors = random_set(L, D, F)
    root = write_gemmascope(tmp_path / "gs", tensors)
    assert detect_format(root) == "gemmascope"
    tc = load_transcoder(root, dtype=torch.float64)
    assert (tc.cfg.feature_input_hook, tc.cfg.feature_output_hook) == \
        ("ln2.hook_normalized", "hook_mlp_out")
    _assert_matches(tc, tensors)
    # the same files named one per layer by a circuit-tracer config
    files = [str(p) for p in sorted(root.rglob("params.npz"))]
    config = write_circuit_tracer(tmp_path / "ct", tensors, files=files,
                                  input_hook="ln2.hook_normalized")
    _assert_matches(load_transcoder(config, dtype=torch.float64), tensors)
    # several L0 variants per layer: the loader asks for a choice instead of guessing
    many = write_gemmascope(tmp_path / "many", tensors, l0s=(20, 80))
    with pytest.raises(TranscoderFormatError, match="2 params.npz files"):
        load_transcoder(many)
    chosen = [many / f"layer_{i}/width_16k/average_l0_80/params.npz" for i in range(L)]
    _assert_matches(load_transcoder(chosen, format="gemmascope", dtype=torch.float64), tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation,skip", CASES[:4])
@pytest.mark.numerics
def test_sae_lens_transcoders_assemble_into_a_set(tmp_path, activation, skip, dtype):
    tensors = random_set(L, D, F, skip=skip, activation=activation)
    root = write_sae_lens(tmp_path / "sl", tensors, dtype=dtype,
                          input_hook="ln2.hook_normalized")
    assert detect_format(root) == "sae_lens"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = load_transcoder(root, dtype=torch.float64)
    assert tc.cfg.feature_input_hook == "ln2.hook_normalized" and tc.cfg.skip == skip
    _assert_matches(tc, rounded(tensors, getattr(torch, dtype)))


@pytest.mark.numerics
def test_sae_lens_release_is_assembled_through_sae_lens(tmp_path, monkeypatch):
    """``load_release`` asks sae-lens for each id (here served from disk instead of the hub)."""
    from sae_lens import SAE

    from pyvene_causaltrace.transcoders.formats import sae_lens as fmt

    tensors = random_set(L, D, F, skip=True)
    root = write_sae_lens(tmp_path / "sl", tensors)
    asked = []

    def from_pretrained(release, sae_id, device="cpu", **_):
        asked.append((release, sae_id))
        return SAE.load_from_disk(str(root / sae_id), device=device)

    monkeypatch.setattr(SAE, "from_pretrained", staticmethod(from_pretrained))
    ids = [f"transcoder_layer_{i}" for i in range(L)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = fmt.load_release("some-release", ids, dtype=torch.float64)
    assert asked == [("some-release", i) for i in ids] and tc.cfg.scan == "some-release"
    _assert_matches(tc, tensors)
    assert load_transcoder("some-release", format="sae_lens", sae_ids=ids).cfg.skip
    assert "layer_0/width_16k/average_l0_76" in fmt.release_ids("gemma-scope-2b-pt-transcoders")
    with pytest.raises(TranscoderFormatError, match="not a sae-lens release"):
        fmt.release_ids("no-such-release")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.numerics
def test_sparsify_topk_equals_the_dense_reference(tmp_path, skip, legacy, dtype):
    tensors = random_set(L, D, F, skip=skip, activation="relu_topk", k=6)
    root = write_sparsify(tmp_path / "sp", tensors, dtype=dtype, legacy=legacy)
    assert detect_format(root) == "sparsify"
    tc = load_transcoder(root, dtype=torch.float64)
    assert tc.cfg.activation == "relu_topk" and tc.cfg.k == 6
    assert (tc.cfg.feature_input_hook, tc.cfg.feature_output_hook) == ("mlp.hook_in",
                                                                       "mlp.hook_out")
    _assert_matches(tc, rounded(tensors, dtype), fold_b_dec=legacy)


def test_topk_flavours_differ_where_few_preactivations_are_positive():
    z = torch.tensor([[-1.0, -2.0, 3.0, -0.5]])
    assert activate(z, "topk", k=2).tolist() == [[0.0, 0.0, 3.0, -0.5]]  # circuit-tracer
    assert activate(z, "relu_topk", k=2).tolist() == [[0.0, 0.0, 3.0, 0.0]]  # sparsify


def _fake_hub(cache, repo, files: dict, revision="main", commit="c0ffee"):
    """A Hugging Face cache entry for ``repo`` at ``revision`` holding ``files``."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snapshot = base / "snapshots" / commit
    for name, writer in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        writer(snapshot / name)
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / revision).write_text(commit)
    return snapshot


@pytest.mark.numerics
def test_hub_references_resolve_from_the_offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    tensors = random_set(L, D, F, skip=True)
    local = write_circuit_tracer(tmp_path / "weights", tensors).parent

    def copy(name):
        return lambda path: path.write_bytes((local / name).read_bytes())

    _fake_hub(cache, "org/weights", {f"sub/layer_{i}.safetensors": copy(f"layer_{i}.safetensors")
                                     for i in range(L)}, revision="v2", commit="abc")
    files = [f"hf://org/weights/sub/layer_{i}.safetensors?revision=v2" for i in range(L)]

    def config(path):
        path.write_text(yaml.safe_dump({
            "model_name": "tiny", "model_kind": "transcoder_set",
            "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out",
            "transcoders": files}))

    _fake_hub(cache, "org/set", {"config.yaml": config})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    tc = load_transcoder("org/set", dtype=torch.float64)
    assert tc.cfg.scan == "org/set" and tc.cfg.skip
    _assert_matches(tc, tensors)
    # a missing layer file is named, with the offline hint
    files[1] = "hf://org/weights/sub/layer_9.safetensors?revision=v2"
    _fake_hub(cache, "org/broken", {"config.yaml": config})
    with pytest.raises(TranscoderFormatError,
                       match=r"sub/layer_9.safetensors.*org/weights.*HF_HUB_OFFLINE"):
        load_transcoder("org/broken")
    with pytest.raises(TranscoderFormatError, match="not in the local cache"):
        load_transcoder("org/not-cached")
    # circuit-tracer's cross_layer_transcoder config: the mntss files beside it, in a subfolder
    clt_dir = write_clt(tmp_path / "clt", random_clt_tensors(L, D, F))
    _fake_hub(cache, "org/clts", {f"big/{p.name}": copy_from(p) for p in clt_dir.iterdir()})
    clt = load_transcoder("org/clts/big")
    assert clt.cfg.cross_layer and clt.cfg.scan == "org/clts//big"


def copy_from(source):
    return lambda path: path.write_bytes(source.read_bytes())


def test_bad_sets_are_refused_with_the_file_named(tmp_path):
    good = random_set(L, D, F, skip=True)
    # a missing layer
    config = write_circuit_tracer(tmp_path / "gap", good)
    (tmp_path / "gap" / "layer_1.safetensors").unlink()
    meta = yaml.safe_load(config.read_text())
    meta.pop("transcoders", None)
    config.write_text(yaml.safe_dump(meta))
    with pytest.raises(TranscoderFormatError, match=r"layer\(s\) \[1\]"):
        load_transcoder(config)
    # a listed file that does not exist
    config = write_circuit_tracer(tmp_path / "listed", good,
                                  files=["layer_0.safetensors", "layer_7.safetensors"])
    with pytest.raises(TranscoderFormatError, match="missing file .*layer_7.safetensors"):
        load_transcoder(config)
    # mixed d_model
    mixed = random_set(L, D, F, skip=False)
    mixed["layers"][2] = random_set(1, 16, F)["layers"][0]
    with pytest.raises(TranscoderFormatError, match=r"layer_2.safetensors \(layer 2\): shapes"):
        load_transcoder(write_circuit_tracer(tmp_path / "mixed", mixed))
    # W_skip of the wrong shape
    wrong = random_set(L, D, F, skip=True)
    wrong["layers"][1]["W_skip"] = torch.zeros(D, D + 1)
    with pytest.raises(TranscoderFormatError, match="W_skip"):
        load_transcoder(write_circuit_tracer(tmp_path / "skip", wrong))
    # skip on some layers only
    partial = random_set(L, D, F, skip=True)
    del partial["layers"][2]["W_skip"]
    with pytest.raises(TranscoderFormatError, match="W_skip missing"):
        load_transcoder(write_circuit_tracer(tmp_path / "partial", partial))
    # unknown activation, unknown hook, topk without k
    for name, change, message in (
            ("act", {"activation": "gelu"}, "unknown activation 'gelu'"),
            ("hook", {"feature_input_hook": "blocks.0.attn.hook_z"},
             "unknown feature_input_hook 'blocks.0.attn.hook_z'"),
            ("topk", {"activation": "topk"}, "needs k")):
        config = write_circuit_tracer(tmp_path / name, good)
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), **change}))
        with pytest.raises(TranscoderFormatError, match=message):
            load_transcoder(config)
    # a corrupt layer file, a sparsify SAE that is not a transcoder, an unknown directory
    config = write_circuit_tracer(tmp_path / "corrupt", good)
    (tmp_path / "corrupt" / "layer_2.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(TranscoderFormatError, match="layer_2.safetensors is not a readable"):
        load_transcoder(config)
    sae = write_sparsify(tmp_path / "sae", random_set(L, D, F, activation="relu_topk", k=3))
    cfg_file = sae / "layers.1.mlp" / "cfg.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "transcode": False}))
    with pytest.raises(TranscoderFormatError, match="layers.1.mlp.*not a transcoder"):
        load_transcoder(sae)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TranscoderFormatError, match="no transcoder layout"):
        load_transcoder(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown format"):
        load_transcoder(tmp_path / "empty", format="nope")


def test_bad_sae_lens_and_gemmascope_sets(tmp_path):
    import shutil

    root = write_sae_lens(tmp_path / "sl", random_set(L, D, F))
    shutil.rmtree(root / "transcoder_layer_1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TranscoderFormatError, match=r"no transcoder for layer\(s\) \[1\]"):
            load_transcoder(root)
        mixed = write_sae_lens(tmp_path / "mixed", random_set(2, D, F))
        write_sae_lens(tmp_path / "other", random_set(3, D, F), output_hook="mlp.hook_out")
        shutil.copytree(tmp_path / "other" / "transcoder_layer_2", mixed / "transcoder_layer_2")
        with pytest.raises(TranscoderFormatError, match="different hooks"):
            load_transcoder(mixed)
    gs = write_gemmascope(tmp_path / "gs", random_set(L, D, F))
    shutil.rmtree(gs / "layer_0")
    with pytest.raises(TranscoderFormatError, match=r"missing layer_<l> directories .*\[0\]"):
        load_transcoder(gs, format="gemmascope")
    npz = gs / "layer_1" / "width_16k" / "average_l0_41" / "params.npz"
    npz.write_bytes(b"garbage")
    with pytest.raises(TranscoderFormatError, match="params.npz is not a readable npz"):
        load_transcoder([npz], format="gemmascope")


def test_every_layout_follows_the_loader_and_detector_protocols():
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for name, loader in FORMATS.items():
        params = list(inspect.signature(loader).parameters.values())
        assert params[0].kind in positional, name
        keywords = {p.name: p for p in params[1:]}
        assert all(keywords[k].default is not inspect.Parameter.empty
                   for k in ("device", "dtype")), name
    assert sorted(name for name, _ in _DETECTORS) == sorted(FORMATS)
    for name, detect in _DETECTORS:
        assert len(inspect.signature(detect).parameters) == 1, name


def test_a_loader_added_to_formats_is_used_by_name(tmp_path, monkeypatch):
    calls = []

    def load(source, /, *, device="cpu", dtype=torch.float32, **options):
        calls.append((source, device, options))
        return "loaded"

    monkeypatch.setitem(FORMATS, "mine", load)
    assert load_transcoder(tmp_path, format="mine", device="meta", scan="s") == "loaded"
    assert calls == [(tmp_path, "meta", {"scan": "s"})]
