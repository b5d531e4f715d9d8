"""Every layout's loader refuses a damaged tensor, naming the file and the tensor: NaN in a weight,
an inf threshold (a bias where the layout has none), an int32 or float8 tensor. A memory-mapped
decoder's dtype is checked at load and its values as its rows are read; a resident one at load.
The same files undamaged load and decode (the controls)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from clt_fixtures import random_clt_tensors, write_clt
from safetensors.torch import load_file, save_file
from test_transcoder_layouts_new import gs2_tensors, write_gs2_clt, write_gs2_per_layer
from transcoder_fixtures import (
    bytedance_tensors,
    random_set,
    write_bytedance,
    write_circuit_tracer,
    write_gemmascope,
    write_sae_lens,
    write_sparsify,
)

from pyvene_causaltrace.errors import TranscoderFormatError
from pyvene_causaltrace.transcoders import load_transcoder

L, D, F = 2, 8, 12
NPZ = "layer_1/width_16k/average_l0_41/params.npz"


def _ct_npz(root: Path) -> Path:
    """circuit-tracer's config listing GemmaScope ``.npz`` files."""
    write_gemmascope(root / "gs", random_set(L, D, F))
    files = [f"gs/layer_{layer}/width_16k/average_l0_41/params.npz" for layer in range(L)]
    (root / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "tiny", "model_kind": "transcoder_set",
        "feature_input_hook": "ln2.hook_normalized", "feature_output_hook": "hook_mlp_out",
        "transcoders": files}))
    return root / "config.yaml"


#: layout -> (writer returning the path to load, {role: (file, tensor)}); every damaged tensor
#: is layer 1's, so a check of layer 0 alone would not pass.
LAYOUTS = {
    "mntss": (lambda r: write_clt(r, random_clt_tensors(L, D, F)),
              {"weight": ("W_enc_1.safetensors", "W_enc_1"),
               "threshold": ("W_enc_1.safetensors", "threshold_1"),
               "decoder": ("W_dec_1.safetensors", "W_dec_1")}),
    "circuit_tracer": (lambda r: write_circuit_tracer(r, random_set(L, D, F)),
                       {"weight": ("layer_1.safetensors", "W_enc"),
                        "threshold": ("layer_1.safetensors", "activation_function.threshold"),
                        "decoder": ("layer_1.safetensors", "W_dec")}),
    "circuit_tracer_npz": (_ct_npz, {"weight": (f"gs/{NPZ}", "W_enc"),
                                     "threshold": (f"gs/{NPZ}", "threshold"),
                                     "decoder": (f"gs/{NPZ}", "W_dec")}),
    "gemmascope": (lambda r: write_gemmascope(r, random_set(L, D, F)),
                   {"weight": (NPZ, "W_enc"), "threshold": (NPZ, "threshold"),
                    "decoder": (NPZ, "W_dec")}),
    "gemmascope2": (lambda r: write_gs2_per_layer(r, gs2_tensors(L, D, F))[0],
                    {role: ("layer_1_width_16k_l0_small/params.safetensors", name)
                     for role, name in (("weight", "w_enc"), ("threshold", "threshold"),
                                        ("decoder", "w_dec"))}),
    "gemmascope2_clt": (lambda r: write_gs2_clt(r, gs2_tensors(L, D, F, clt=True)),
                        {role: ("params_layer_1.safetensors", name)
                         for role, name in (("weight", "b_enc"), ("threshold", "threshold"),
                                            ("decoder", "w_dec"))}),
    "bytedance": (lambda r: write_bytedance(r, bytedance_tensors(L, D, F, k=2)),
                  {"weight": ("W_enc_1.safetensors", "W_enc_1"),
                   "threshold": ("W_dec_norm.safetensors", "W_dec_norm"),  # no thresholds
                   "decoder": ("W_dec_1.safetensors", "W_dec_1")}),
    "sae_lens": (lambda r: write_sae_lens(r, random_set(L, D, F)),
                 {role: ("transcoder_layer_1/sae_weights.safetensors", name)
                  for role, name in (("weight", "W_enc"), ("threshold", "threshold"),
                                     ("decoder", "W_dec"))}),
    "sparsify": (lambda r: write_sparsify(r, random_set(L, D, F, activation="relu_topk", k=3)),
                 {"weight": ("layers.1.mlp/sae.safetensors", "encoder.weight"),
                  "threshold": ("layers.1.mlp/sae.safetensors", "encoder.bias"),  # no thresholds
                  "decoder": ("layers.1.mlp/sae.safetensors", "W_dec")}),
}
#: Layouts whose decoder can stay memory-mapped (checked row by row as it is read).
MAPPED = {"mntss", "circuit_tracer", "gemmascope2", "gemmascope2_clt", "bytedance", "sparsify"}

DAMAGE = {  # how -> (what it does to a float tensor, the error it must give)
    "nan": (lambda t: t.flatten().index_fill(0, torch.tensor([t.numel() - 1]), float("nan"))
            .view(t.shape), "NaN/inf"),  # the last row
    "inf": (lambda t: t.flatten().index_fill(0, torch.tensor([0]), float("inf"))
            .view(t.shape), "NaN/inf"),
    "int32": (lambda t: (t * 100).to(torch.int32), "int32"),
    "float8": (lambda t: t.to(torch.float8_e4m3fn), r"float8_e4m3fn|numpy \|V1"),
}


def _damage(path: Path, name: str, how: str) -> None:
    """Rewrite ``path`` with tensor ``name`` damaged by ``how`` (the file's other tensors as
    they were)."""
    change = DAMAGE[how][0]
    if path.suffix == ".npz":
        with np.load(path) as data:
            arrays = dict(data)
        array = arrays[name]
        if how == "float8":  # numpy has no float8: such a file holds its bytes, a void dtype
            arrays[name] = np.frombuffer(torch.from_numpy(array).to(torch.float8_e4m3fn)
                                         .view(torch.uint8).numpy().tobytes(), dtype="V1")
        else:
            arrays[name] = change(torch.from_numpy(array)).numpy()
        np.savez(path, **arrays)
        return
    tensors = load_file(str(path))
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(path))


def _written(layout: str, root: Path, role: str | None = None, how: str | None = None):
    writer, where = LAYOUTS[layout]
    path = writer(root)
    if role is not None:
        file, name = where[role]
        _damage(root / file, name, how)
    return path


def _load(layout: str, path: Path, **kwargs):
    return load_transcoder(path, format="sae_lens" if layout == "sae_lens" else None, **kwargs)


def _refused(layout: str, role: str, how: str, excinfo) -> None:
    file, name = LAYOUTS[layout][1][role]
    message = str(excinfo.value)
    assert file.split("/")[-1] in message and f"tensor {name}" in message, message
    assert re.search(DAMAGE[how][1], message), message


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_clean_files_load_and_decode(layout, tmp_path):
    """The control: undamaged files load (mapped or not) and every decoder row reads."""
    for lazy in (True, False):
        tc = _load(layout, _written(layout, tmp_path / str(lazy)), lazy_decoder=lazy)
        for layer in range(L):
            assert torch.isfinite(tc.decoder_rows(layer, torch.arange(F))).all()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("role,how", [("weight", "nan"), ("threshold", "inf"),
                                      ("weight", "int32"), ("weight", "float8")])
def test_damaged_weight_refused_at_load(layout, role, how, tmp_path):
    with pytest.raises(TranscoderFormatError) as excinfo:
        _load(layout, _written(layout, tmp_path, role, how))
    _refused(layout, role, how, excinfo)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("how", ["int32", "float8"])
def test_decoder_dtype_refused_at_load(layout, how, tmp_path):
    """A decoder's dtype is read from the header: refused at load, mapped or resident (an int32
    map was a raw KeyError, a float8 one loaded)."""
    for lazy in (True, False):
        with pytest.raises(TranscoderFormatError) as excinfo:
            _load(layout, _written(layout, tmp_path / str(lazy), "decoder", how),
                  lazy_decoder=lazy)
        _refused(layout, "decoder", how, excinfo)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decoder_nan_refused_when_read(layout, tmp_path):
    """A resident decoder is checked at load; a memory-mapped one row by row as it is read
    (reading all of it at load would cost a pass over the largest tensor, read or not)."""
    with pytest.raises(TranscoderFormatError) as excinfo:
        _load(layout, _written(layout, tmp_path / "resident", "decoder", "nan"),
              lazy_decoder=False)
    _refused(layout, "decoder", "nan", excinfo)
    if layout not in MAPPED:
        return
    tc = _load(layout, _written(layout, tmp_path / "mapped", "decoder", "nan"))
    assert tc._handles
    tc.decoder_rows(1, torch.tensor([0, 2]))  # a clean row reads
    with pytest.raises(TranscoderFormatError) as excinfo:
        tc.decoder_rows(1, torch.tensor([F - 1]))  # the damaged one does not
    _refused(layout, "decoder", "nan", excinfo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_finds_one_bad_value_anywhere(dtype):
    """The one-pass check (``aminmax``: NaN propagates, inf reaches an end) finds a single NaN,
    inf or -inf at the start, inside a vectorised stretch, at the end, in a strided view."""
    from pyvene_causaltrace.finite import all_finite

    x = torch.randn(3001, 7).to(dtype)
    assert all_finite(x) and all_finite(x.T) and all_finite(x[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, 1234, x.numel() - 1):
            y = x.clone().view(-1)
            y[index] = bad
            assert not all_finite(y.view(3001, 7)) and not all_finite(y.view(3001, 7).T)
