"""Reading and writing CLTs in the mntss on-disk layout, exactly.

    path/config.yaml               model_name, model_kind, feature_input_hook, feature_output_hook
    path/W_enc_{l}.safetensors     W_enc_{l} [F, D], b_enc_{l} [F], b_dec_{l} [D], threshold_{l} [F]
    path/W_dec_{l}.safetensors     W_dec_{l} [F, L - l, D]

Loaders follow sae-lens's convention — one function per source, looked up by name in
:data:`LOADERS` — and everything is checked before anything is returned: a missing file, a
header that is not safetensors, a shape that disagrees with the other layers or a dtype that is not
floating point raises a :class:`CLTFormatError` naming the file. Nothing is half-loaded.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from .config import MODEL_KIND, YAML_KEYS, CLTConfig
from .transcoder import CrossLayerTranscoder

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CLTFormatError(ValueError):
    """A CLT directory is incomplete, corrupted or inconsistent."""


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        raise CLTFormatError(f"missing file {path}")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise CLTFormatError(f"{path} is not a readable safetensors file: {error}") from None


def _shapes(handle) -> dict[str, tuple[int, ...]]:
    return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


def read_config(path: str | Path) -> CLTConfig:
    """The config from ``config.yaml`` and the safetensors headers (no weights read)."""
    import yaml

    root = Path(path)
    config_file = root / "config.yaml"
    if not config_file.exists():
        raise CLTFormatError(f"{root} has no config.yaml: not a CLT directory")
    meta = yaml.safe_load(config_file.read_text()) or {}
    missing = [key for key in YAML_KEYS if key not in meta]
    if missing:
        raise CLTFormatError(f"{config_file} lacks {', '.join(missing)}")
    if meta["model_kind"] != MODEL_KIND:
        raise CLTFormatError(f"{config_file}: model_kind is {meta['model_kind']!r}, "
                             f"expected {MODEL_KIND!r}")
    layers = sorted(int(p.stem.split("_")[-1]) for p in root.glob("W_enc_*.safetensors"))
    if not layers or layers != list(range(len(layers))):
        raise CLTFormatError(f"{root}: encoder files for layers {layers}; expected 0..L-1")
    n_layers = len(layers)
    d_transcoder = d_model = None
    disk_dtype = None
    for layer in range(n_layers):
        enc = _open(root / f"W_enc_{layer}.safetensors")
        shapes = _shapes(enc)
        expected = {f"W_enc_{layer}", f"b_enc_{layer}", f"b_dec_{layer}", f"threshold_{layer}"}
        if set(shapes) != expected:
            raise CLTFormatError(f"W_enc_{layer}.safetensors holds {sorted(shapes)}, "
                                 f"expected {sorted(expected)}")
        if d_transcoder is None:
            d_transcoder, d_model = shapes[f"W_enc_{layer}"]
            disk_dtype = str(enc.get_slice(f"W_enc_{layer}").get_dtype())
        want = {f"W_enc_{layer}": (d_transcoder, d_model), f"b_enc_{layer}": (d_transcoder,),
                f"b_dec_{layer}": (d_model,), f"threshold_{layer}": (d_transcoder,)}
        _check_shapes(f"W_enc_{layer}.safetensors", shapes, want)
        dec = _open(root / f"W_dec_{layer}.safetensors")
        _check_shapes(f"W_dec_{layer}.safetensors", _shapes(dec),
                      {f"W_dec_{layer}": (d_transcoder, n_layers - layer, d_model)})
    return CLTConfig(meta["model_name"], n_layers, d_model, d_transcoder,
                     meta["feature_input_hook"], meta["feature_output_hook"], MODEL_KIND,
                     _DTYPE_NAMES.get(disk_dtype, disk_dtype))


_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _check_shapes(name: str, shapes: dict, want: dict) -> None:
    if shapes != want:
        wrong = {k: shapes.get(k) for k in want if shapes.get(k) != want[k]}
        raise CLTFormatError(f"{name}: shapes {wrong} disagree with the other layers "
                             f"(expected {want})")


def load_from_disk(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lazy_decoder: bool = True,
    lazy_encoder: bool = False,
) -> CrossLayerTranscoder:
    """Load a CLT directory. ``lazy_decoder`` keeps decoders memory-mapped (rows are read when
    features fire); ``lazy_encoder`` reads each layer's ``W_enc`` from disk when it is used."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    root = Path(path)
    cfg = read_config(root)
    L = cfg.n_layers
    enc_handles = [_open(root / f"W_enc_{layer}.safetensors") for layer in range(L)]
    try:
        b_enc = torch.stack([h.get_tensor(f"b_enc_{i}") for i, h in enumerate(enc_handles)])
        threshold = torch.stack([h.get_tensor(f"threshold_{i}")
                                 for i, h in enumerate(enc_handles)])
        b_dec = torch.stack([h.get_tensor(f"b_dec_{i}") for i, h in enumerate(enc_handles)])
        W_enc = None if lazy_encoder else torch.stack(
            [h.get_tensor(f"W_enc_{i}").to(dtype) for i, h in enumerate(enc_handles)])
        maps = [_mmap_tensor(root / f"W_dec_{layer}.safetensors", f"W_dec_{layer}")
                for layer in range(L)]
        W_dec = [tensor for tensor, _ in maps]
    except Exception as error:  # a truncated data section surfaces only here
        raise CLTFormatError(f"{root}: could not read tensors: {error}") from None
    if not lazy_decoder:
        W_dec = [w.to(device, dtype).clone() for w in W_dec]

    def encoder_loader(layer: int) -> torch.Tensor:
        with _open_ctx(root / f"W_enc_{layer}.safetensors") as handle:
            return handle.get_tensor(f"W_enc_{layer}")

    clt = CrossLayerTranscoder(
        cfg, b_enc=b_enc, threshold=threshold, b_dec=b_dec, W_enc=W_enc, W_dec=W_dec,
        encoder_loader=encoder_loader, dtype=dtype, device=device, source=str(root))
    if lazy_decoder:
        clt._handles = [handle for _, handle in maps]
    return clt


_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F64": torch.float64}


def _mmap_tensor(path: Path, name: str):
    """``(tensor, mmap)``: ``name`` from a safetensors file as a view of a read-only memory map
    advised for random access (decoder rows are read a few at a time, scattered over the file).
    The layout is safetensors': an 8-byte header length, a JSON header, then raw data."""
    import json
    import mmap

    with open(path, "rb") as file:
        header_len = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(header_len))
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    info = header[name]
    start, stop = (8 + header_len + offset for offset in info["data_offsets"])
    dtype = _TORCH_DTYPES[info["dtype"]]
    with warnings.catch_warnings():  # the buffer is read-only; we never write to it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapped, dtype=dtype, count=(stop - start) // dtype.itemsize,
                                offset=start)
    return flat.view(info["shape"]), mapped


def _open_ctx(path: Path):
    from safetensors import safe_open

    return safe_open(str(path), framework="pt", device="cpu")


def from_pretrained(
    repo_id_or_dir: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lazy_decoder: bool = True,
    lazy_encoder: bool = False,
    revision: str | None = None,
) -> CrossLayerTranscoder:
    """A local directory, or a hub repo fetched with ``huggingface_hub.snapshot_download``
    (which honours ``HF_HUB_OFFLINE=1`` by using only the local cache)."""
    path = Path(repo_id_or_dir).expanduser()
    if not path.is_dir():
        path = Path(_download(repo_id_or_dir, revision))
    return load_from_disk(path, device=device, dtype=dtype, lazy_decoder=lazy_decoder,
                          lazy_encoder=lazy_encoder)


def _download(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision,
                                 allow_patterns=["config.yaml", "*.safetensors"])
    except LocalEntryNotFoundError as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise CLTFormatError(f"{repo_id!r} is neither a directory nor a reachable hub repo"
                             f"{hint}: {error}") from None


def save_model(clt: CrossLayerTranscoder, path: str | Path) -> None:
    """Write ``clt`` in the mntss layout, in its on-disk dtype. Loading a directory and saving
    it again reproduces its safetensors files byte for byte."""
    import yaml
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, clt.cfg.disk_dtype)
    for layer in range(clt.n_layers):
        save_file({
            f"W_enc_{layer}": clt.encoder_weight(layer).to(dtype).contiguous().cpu(),
            f"b_enc_{layer}": clt.b_enc[layer].to(dtype).contiguous().cpu(),
            f"b_dec_{layer}": clt.b_dec[layer].to(dtype).contiguous().cpu(),
            f"threshold_{layer}": clt.threshold[layer].to(dtype).contiguous().cpu(),
        }, str(root / f"W_enc_{layer}.safetensors"))
        save_file({f"W_dec_{layer}": clt.W_dec[layer].to(dtype).contiguous().cpu()},
                  str(root / f"W_dec_{layer}.safetensors"))
    (root / "config.yaml").write_text(yaml.safe_dump(clt.cfg.yaml_dict(), sort_keys=False))


#: Loader functions by source name, sae-lens style.
LOADERS: dict[str, Callable[..., CrossLayerTranscoder]] = {
    "mntss": from_pretrained,
    "directory": load_from_disk,
}
