"""The mntss cross-layer transcoder layout, read and written exactly.

    path/config.yaml               model_name, model_kind, feature_input_hook, feature_output_hook
    path/W_enc_{l}.safetensors     W_enc_{l} [F, D], b_enc_{l} [F], b_dec_{l} [D], threshold_{l} [F]
                                   (no thresholds anywhere: a ReLU CLT)
    path/W_dec_{l}.safetensors     W_dec_{l} [F, L - l, D]

Everything is checked before anything is returned: a missing file, a header that is not
safetensors, a shape that disagrees with the other layers or a dtype that is not floating point
raises a :class:`~.common.TranscoderFormatError` naming the file. Nothing is half-loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from ...errors import InputError
from ..config import CROSS_LAYER, YAML_KEYS, TranscoderConfig
from ..transcoder import Transcoder
from .common import (
    DTYPE_NAMES,
    TranscoderFormatError,
    check_dtype,
    hub_snapshot,
    mmap_tensor,
    open_safetensors,
    read_yaml_mapping,
    shapes_of,
)


def is_layout(path: Path) -> bool:
    """A directory with an mntss ``config.yaml`` and per-layer encoder files."""
    return (path / "config.yaml").exists() and (path / "W_enc_0.safetensors").exists()


def read_config(path: str | Path) -> TranscoderConfig:
    """The config from ``config.yaml`` and the safetensors headers (no weights read)."""
    root = Path(path)
    config_file = root / "config.yaml"
    if not config_file.exists():
        raise TranscoderFormatError(f"{root} has no config.yaml: not a CLT directory")
    meta = read_yaml_mapping(config_file, f"a mapping of {', '.join(YAML_KEYS)}")
    missing = [key for key in YAML_KEYS if key not in meta]
    if missing:
        raise TranscoderFormatError(f"{config_file} lacks {', '.join(missing)}")
    if meta["model_kind"] != CROSS_LAYER:
        raise TranscoderFormatError(f"{config_file}: model_kind is {meta['model_kind']!r}, "
                             f"expected {CROSS_LAYER!r}")
    layers = sorted(int(p.stem.split("_")[-1]) for p in root.glob("W_enc_*.safetensors"))
    if not layers or layers != list(range(len(layers))):
        raise TranscoderFormatError(f"{root}: encoder files for layers {layers}; expected 0..L-1")
    n_layers = len(layers)
    d_transcoder = d_model = None
    disk_dtype = None
    thresholds = None
    for layer in range(n_layers):
        enc = open_safetensors(root / f"W_enc_{layer}.safetensors")
        shapes = shapes_of(enc)
        if thresholds is None:
            thresholds = f"threshold_{layer}" in shapes
        expected = {f"W_enc_{layer}", f"b_enc_{layer}", f"b_dec_{layer}"} \
            | ({f"threshold_{layer}"} if thresholds else set())
        if set(shapes) != expected:
            raise TranscoderFormatError(f"W_enc_{layer}.safetensors holds {sorted(shapes)}, "
                                 f"expected {sorted(expected)}")
        if d_transcoder is None:
            d_transcoder, d_model = shapes[f"W_enc_{layer}"]
            disk_dtype = str(enc.get_slice(f"W_enc_{layer}").get_dtype())
        want = {f"W_enc_{layer}": (d_transcoder, d_model), f"b_enc_{layer}": (d_transcoder,),
                f"b_dec_{layer}": (d_model,)} \
            | ({f"threshold_{layer}": (d_transcoder,)} if thresholds else {})
        _check_shapes(f"W_enc_{layer}.safetensors", shapes, want)
        dec = open_safetensors(root / f"W_dec_{layer}.safetensors")
        _check_shapes(f"W_dec_{layer}.safetensors", shapes_of(dec),
                      {f"W_dec_{layer}": (d_transcoder, n_layers - layer, d_model)})
    try:
        return TranscoderConfig(meta["model_name"], n_layers, d_model, d_transcoder,
                                meta["feature_input_hook"], meta["feature_output_hook"],
                                CROSS_LAYER, DTYPE_NAMES.get(disk_dtype, disk_dtype),
                                activation="jumprelu" if thresholds else "relu",
                                scan=meta.get("scan"))
    except ValueError as error:
        raise TranscoderFormatError(f"{config_file}: {error}") from None


def _check_shapes(name: str, shapes: dict, want: dict) -> None:
    if shapes != want:
        wrong = {k: shapes.get(k) for k in want if shapes.get(k) != want[k]}
        raise TranscoderFormatError(f"{name}: shapes {wrong} disagree with the other layers "
                             f"(expected {want})")


def load_from_disk(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lazy_decoder: bool = True,
    lazy_encoder: bool = False,
) -> Transcoder:
    """Load a CLT directory. ``lazy_decoder`` keeps decoders memory-mapped (rows are read when
    features fire); ``lazy_encoder`` reads each layer's ``W_enc`` from disk when it is used."""
    check_dtype(dtype)
    root = Path(path)
    cfg = read_config(root)
    L = cfg.n_layers
    enc_handles = [open_safetensors(root / f"W_enc_{layer}.safetensors") for layer in range(L)]
    try:
        b_enc = torch.stack([h.get_tensor(f"b_enc_{i}") for i, h in enumerate(enc_handles)])
        threshold = None if cfg.activation == "relu" else torch.stack(
            [h.get_tensor(f"threshold_{i}") for i, h in enumerate(enc_handles)])
        b_dec = torch.stack([h.get_tensor(f"b_dec_{i}") for i, h in enumerate(enc_handles)])
        W_enc = None if lazy_encoder else torch.stack(
            [h.get_tensor(f"W_enc_{i}").to(dtype) for i, h in enumerate(enc_handles)])
        maps = [mmap_tensor(root / f"W_dec_{layer}.safetensors", f"W_dec_{layer}")
                for layer in range(L)]
        W_dec = [tensor for tensor, _ in maps]
    except Exception as error:  # a truncated data section surfaces only here
        raise TranscoderFormatError(f"{root}: could not read tensors: {error}") from None
    if not lazy_decoder:
        W_dec = [w.to(device, dtype).clone() for w in W_dec]

    def encoder_loader(layer: int) -> torch.Tensor:
        with open_safetensors(root / f"W_enc_{layer}.safetensors") as handle:
            return handle.get_tensor(f"W_enc_{layer}")

    clt = Transcoder(
        cfg, b_enc=b_enc, threshold=threshold, b_dec=b_dec, W_enc=W_enc, W_dec=W_dec,
        encoder_loader=encoder_loader, dtype=dtype, device=device, source=str(root))
    if lazy_decoder:
        clt._handles = [handle for _, handle in maps]
    return clt


def from_pretrained(
    repo_id_or_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lazy_decoder: bool = True,
    lazy_encoder: bool = False,
    revision: str | None = None,
) -> Transcoder:
    """A local directory, or a hub repo fetched with ``huggingface_hub.snapshot_download``
    (which honours ``HF_HUB_OFFLINE=1`` by using only the local cache)."""
    path = Path(repo_id_or_dir).expanduser()
    if not path.is_dir():
        path = hub_snapshot(repo_id_or_dir, revision, ["config.yaml", "*.safetensors"])
    return load_from_disk(path, device=device, dtype=dtype, lazy_decoder=lazy_decoder,
                          lazy_encoder=lazy_encoder)


def save_model(clt: Transcoder, path: str | Path) -> None:
    """Write ``clt`` in the mntss layout, in its on-disk dtype. Loading a directory and saving
    it again reproduces its safetensors files byte for byte."""
    if not clt.cfg.cross_layer or clt.cfg.activation not in ("jumprelu", "relu") \
            or clt.cfg.skip:
        raise InputError("the mntss layout holds JumpReLU or ReLU cross-layer transcoders "
                         "without a skip path only")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, clt.cfg.disk_dtype)
    for layer in range(clt.n_layers):
        tensors = {f"W_enc_{layer}": clt.encoder_weight(layer), f"b_enc_{layer}": clt.b_enc[layer],
                   f"b_dec_{layer}": clt.b_dec[layer]}
        if clt.cfg.activation == "jumprelu":
            tensors[f"threshold_{layer}"] = clt.threshold[layer]
        save_file({k: v.to(dtype).contiguous().cpu() for k, v in tensors.items()},
                  str(root / f"W_enc_{layer}.safetensors"))
        save_file({f"W_dec_{layer}": clt.W_dec[layer].to(dtype).contiguous().cpu()},
                  str(root / f"W_dec_{layer}.safetensors"))
    (root / "config.yaml").write_text(yaml.safe_dump(clt.cfg.yaml_dict(), sort_keys=False))
