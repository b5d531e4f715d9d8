"""What a transcoder directory's names say is checked before it is trusted: a layer number in a
file or folder name past any model's depth (or the config's layer count) is refused at once,
naming the file, before anything is sized by it; a directory holding the files of two layouts
is refused, naming both, instead of loading one of them."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import yaml
from clt_fixtures import random_clt_tensors, write_clt
from safetensors.torch import save_file
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
from pyvene_causaltrace.transcoders.formats import detect_format

L, D, F = 2, 8, 12
HUGE = 99999999999


def _empty(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.zeros(1)}, str(path))
    return path


def _gs2_folder(root: Path) -> str:
    write_gs2_per_layer(root, gs2_tensors(L, D, F))
    folder = root / "layer_900000000000_width_16k_l0_small"
    _empty(folder / "params.safetensors")
    (folder / "config.json").write_text("{}")
    return folder.name


def _sae_lens(root: Path) -> str:
    write_sae_lens(root, random_set(L, D, F))
    cfg = root / "transcoder_layer_1" / "cfg.json"
    meta = json.loads(cfg.read_text())
    meta["metadata"]["hook_name"] = f"blocks.{HUGE}.hook_resid_mid"
    meta["metadata"]["hook_name_out"] = f"blocks.{HUGE}.hook_mlp_out"
    cfg.write_text(json.dumps(meta))
    return "transcoder_layer_1"


def _sparsify(root: Path) -> str:
    write_sparsify(root, random_set(L, D, F, activation="relu_topk", k=3))
    folder = root / f"layers.{HUGE}.mlp"
    folder.mkdir()
    (folder / "cfg.json").write_text(json.dumps({"k": 3}))
    return folder.name


def _gemmascope(root: Path) -> str:
    write_gemmascope(root, random_set(L, D, F))
    (root / f"layer_{HUGE}" / "width_16k").mkdir(parents=True)
    (root / f"layer_{HUGE}" / "width_16k" / "params.npz").write_bytes(b"")
    return f"layer_{HUGE}"


#: layout -> writes a good transcoder plus one name with a huge layer; returns that name.
HUGE_NAMES = {
    "gemmascope2": _gs2_folder,
    "gemmascope2_clt": lambda r: _empty(write_gs2_clt(r, gs2_tensors(L, D, F, clt=True))
                                        / f"params_layer_{HUGE}.safetensors").name,
    "circuit_tracer": lambda r: _empty(write_circuit_tracer(r, random_set(L, D, F)).parent
                                       / f"layer_{HUGE}.safetensors").name,
    "mntss": lambda r: _empty(write_clt(r, random_clt_tensors(L, D, F))
                              / f"W_enc_{HUGE}.safetensors").name,
    "gemmascope": _gemmascope,
    "sparsify": _sparsify,
    "sae_lens": _sae_lens,
}


@pytest.mark.parametrize("layout", sorted(HUGE_NAMES))
def test_huge_layer_number_in_a_name_refused_at_once(layout, tmp_path):
    """``layer_99999999999``: refused naming the file, in well under a second and a few MB
    (the list of layers missing below it once grew to 21 GB before the kernel killed it)."""
    name = HUGE_NAMES[layout](tmp_path)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(TranscoderFormatError) as excinfo:
            load_transcoder(tmp_path, format="sae_lens" if layout == "sae_lens" else None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 20  # sae-lens's first import is most of it
    assert peak < 64 * 2**20, peak
    assert name in str(excinfo.value) and "layer" in str(excinfo.value), excinfo.value


def test_layer_number_past_the_configs_count_refused(tmp_path):
    """ByteDance's config.json states its layer count: a file past it is refused against it."""
    root = write_bytedance(tmp_path, bytedance_tensors(L, D, F, k=2))
    _empty(root / "W_enc_5.safetensors")
    with pytest.raises(TranscoderFormatError, match=r"W_enc_5\.safetensors.*config\.json says "
                                                    r"2 layers"):
        load_transcoder(root)


# ------------------------------------------------------------------ two layouts, one folder
TWO_LAYOUTS = {  # a second layout's files written beside a first's
    ("mntss", "gemmascope2"): lambda r: (write_clt(r, random_clt_tensors(L, D, F)),
                                         write_gs2_clt(r, gs2_tensors(L, D, F, clt=True))),
    ("circuit_tracer", "sparsify"): lambda r: (
        write_circuit_tracer(r, random_set(L, D, F)),
        write_sparsify(r, random_set(L, D, F, activation="relu_topk", k=3))),
    ("bytedance", "gemmascope2"): lambda r: (
        write_bytedance(r, bytedance_tensors(L, D, F, k=2)),
        write_gs2_per_layer(r, gs2_tensors(L, D, F))),
    ("gemmascope2", "gemmascope"): lambda r: (write_gs2_per_layer(r, gs2_tensors(L, D, F)),
                                              write_gemmascope(r, random_set(L, D, F))),
}


@pytest.mark.parametrize("pair", sorted(TWO_LAYOUTS), ids="+".join)
def test_two_layouts_in_one_folder_refused_naming_both(pair, tmp_path):
    TWO_LAYOUTS[pair](tmp_path)
    for call in (detect_format, load_transcoder):
        with pytest.raises(TranscoderFormatError, match="2 layouts") as excinfo:
            call(tmp_path)
        assert all(name in str(excinfo.value) for name in pair), excinfo.value
    assert load_transcoder(tmp_path, format=pair[0]).n_layers == L  # a choice is honoured


def test_one_layout_and_a_config_that_lists_its_files_load(tmp_path):
    """The controls: an mntss folder (its config.yaml is circuit-tracer's too) is one layout;
    a circuit-tracer config listing GemmaScope-2 CLT files beside it reads those files."""
    write_clt(tmp_path / "mntss", random_clt_tensors(L, D, F))
    assert detect_format(tmp_path / "mntss") == "mntss"
    root = write_gs2_clt(tmp_path / "listed", gs2_tensors(L, D, F, clt=True))
    (root / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "cross_layer_transcoder", "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "hook_mlp_out",
        "transcoders": [f"params_layer_{layer}.safetensors" for layer in range(L)]}))
    assert detect_format(root) == "circuit_tracer"
    assert load_transcoder(root).n_layers == L


# ------------------------------------------------------------ digits that are not a number
ODD = "\u00b2"  # '²': str.isdigit() says yes, int() refuses it
ODD_NAMES = {  # a good transcoder plus a name whose "layer number" is '²'
    "gemmascope": lambda r: (write_gemmascope(r, random_set(L, D, F)) / f"layer_{ODD}"
                             / "width_16k").mkdir(parents=True),
    "circuit_tracer": lambda r: _empty(write_circuit_tracer(r, random_set(L, D, F)).parent
                                       / f"layer_{ODD}.safetensors"),
    "mntss": lambda r: _empty(write_clt(r, random_clt_tensors(L, D, F))
                              / f"W_enc_{ODD}.safetensors"),
    "bytedance": lambda r: _empty(write_bytedance(r, bytedance_tensors(L, D, F, k=2))
                                  / f"W_enc_{ODD}.safetensors"),
}


@pytest.mark.parametrize("layout", sorted(ODD_NAMES))
def test_a_name_with_a_digit_that_is_no_number_is_not_a_layer_file(layout, tmp_path):
    """``layer_²`` passed ``str.isdigit`` and ``int()`` then raised a bare ValueError while the
    layout was detected; it is simply not a layer file."""
    ODD_NAMES[layout](tmp_path)
    assert detect_format(tmp_path) == layout
    assert load_transcoder(tmp_path).n_layers == L


def test_a_sae_lens_hook_with_a_digit_that_is_no_number_is_refused(tmp_path):
    write_sae_lens(tmp_path, random_set(L, D, F))
    cfg = tmp_path / "transcoder_layer_1" / "cfg.json"
    meta = json.loads(cfg.read_text())
    meta["metadata"]["hook_name"] = f"blocks.{ODD}.hook_resid_mid"
    cfg.write_text(json.dumps(meta))
    with pytest.raises(TranscoderFormatError, match="does not name a layer"):
        load_transcoder(tmp_path, format="sae_lens")
