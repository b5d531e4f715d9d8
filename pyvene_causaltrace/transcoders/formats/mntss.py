"""The mntss cross-layer transcoder layout, read and written exactly: ``config.yaml``,
``W_enc_{l}.safetensors`` (``W_enc_{l}`` ``[F, D]``, ``b_enc_{l}``, ``b_dec_{l}``,
``threshold_{l}``; none anywhere: a ReLU CLT) and ``W_dec_{l}.safetensors`` (``[F, L - l,
D]``). Anything missing, not safetensors, inconsistent across layers or not floating point
raises :class:`~.common.TranscoderFormatError` naming the file, before anything is returned;
``shard=(rank, world)`` reads only that rank's rows (``get_slice``)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from ...arguments import checked
from ...errors import InputError
from ..config import CROSS_LAYER, YAML_KEYS, TranscoderConfig
from ..transcoder import Transcoder, shard_features
from .common import (
    DTYPE_NAMES,
    TranscoderFormatError,
    check_dtype,
    check_shapes,
    check_weight,
    encoder_layers,
    hub_snapshot,
    open_safetensors,
    read_decoders,
    read_features,
    read_tensors,
    read_yaml_mapping,
    reading,
    refuse_shard,
    shapes_of,
    transcoder_config,
)


def is_layout(path: Path) -> bool:
    """A directory with an mntss ``config.yaml`` and per-layer encoder files."""
    return (path / "config.yaml").exists() and (path / "W_enc_0.safetensors").exists()


@checked
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
    n_layers = encoder_layers(root)
    d_transcoder = d_model = disk_dtype = thresholds = None
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
        check_shapes(f"W_enc_{layer}.safetensors", shapes, want, "the other layers")
        dec = open_safetensors(root / f"W_dec_{layer}.safetensors")
        check_shapes(f"W_dec_{layer}.safetensors", shapes_of(dec),
                     {f"W_dec_{layer}": (d_transcoder, n_layers - layer, d_model)},
                     "the other layers")
    return transcoder_config(config_file, meta["model_name"], n_layers, d_model, d_transcoder,
                             meta["feature_input_hook"], meta["feature_output_hook"],
                             CROSS_LAYER, DTYPE_NAMES.get(disk_dtype, disk_dtype),
                             activation="jumprelu" if thresholds else "relu",
                             scan=meta.get("scan"))


class EncoderFiles:
    """Streams ``W_enc_{layer}`` from ``root`` — rows ``[lo, hi)`` only when ``features`` is
    given (the encoder loader of a ``lazy_encoder`` CLT, or of its shard)."""

    def __init__(self, root: Path, features: tuple[int, int] | None = None) -> None:
        self.root, self.features = root, features

    def __call__(self, layer: int) -> torch.Tensor:
        path, name = self.root / f"W_enc_{layer}.safetensors", f"W_enc_{layer}"
        with open_safetensors(path) as handle:  # checked as read (dtype, NaN/inf)
            weight = check_weight(read_features(handle, name, self.features), path, name)
            return weight if self.features is None else weight.clone()

    def sliced(self, lo: int, hi: int) -> EncoderFiles:
        return EncoderFiles(self.root, (lo, hi))


@checked
def load_from_disk(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lazy_decoder: bool = True,
    lazy_encoder: bool = False,
    shard: tuple[int, int] | None = None,
) -> Transcoder:
    """Load a CLT directory. ``lazy_decoder`` keeps decoders memory-mapped (rows are read when
    features fire); ``lazy_encoder`` reads each layer's ``W_enc`` from disk when it is used;
    ``shard=(rank, world)`` reads only that rank's features (module docstring)."""
    check_dtype(dtype)
    root = Path(path)
    cfg = read_config(root)
    features = shard_features(cfg.d_transcoder, shard)
    L = cfg.n_layers

    def each(name: str, part=features) -> list[torch.Tensor]:
        """Tensor ``{name}_{l}`` of each layer's encoder file (its rows ``part``), checked."""
        return [read_tensors(root / f"W_enc_{layer}.safetensors", [f"{name}_{layer}"], part,
                             {f"{name}_{layer}": 0})[f"{name}_{layer}"] for layer in range(L)]

    with reading(root):
        b_enc = torch.stack(each("b_enc"))
        threshold = None if cfg.activation == "relu" else torch.stack(each("threshold"))
        b_dec = torch.stack(each("b_dec", None))
        W_enc = None if lazy_encoder else torch.stack([w.to(dtype) for w in each("W_enc")])
        W_dec, maps = read_decoders(
            [(root / f"W_dec_{layer}.safetensors", f"W_dec_{layer}") for layer in range(L)],
            features, lazy_decoder=lazy_decoder, device=device, dtype=dtype)
    return Transcoder(
        cfg, b_enc=b_enc, threshold=threshold, b_dec=b_dec, W_enc=W_enc, W_dec=W_dec,
        encoder_loader=EncoderFiles(root, features), dtype=dtype, device=device,
        source=str(root), features=features, handles=maps)


@checked
def from_pretrained(
    repo_id_or_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lazy_decoder: bool = True,
    lazy_encoder: bool = False,
    revision: str | None = None,
    shard: tuple[int, int] | None = None,
) -> Transcoder:
    """A local directory, or a hub repo fetched with ``huggingface_hub.snapshot_download``
    (which honours ``HF_HUB_OFFLINE=1`` by using only the local cache); ``shard=(rank,
    world)`` reads only that rank's features (:func:`load_from_disk`)."""
    path = Path(repo_id_or_dir).expanduser()
    if not path.is_dir():
        path = hub_snapshot(repo_id_or_dir, revision, ["config.yaml", "*.safetensors"])
    return load_from_disk(path, device=device, dtype=dtype, lazy_decoder=lazy_decoder,
                          lazy_encoder=lazy_encoder, shard=shard)


@checked
def save_model(transcoder: Transcoder, path: str | Path) -> None:
    """Write ``transcoder`` in the mntss layout, in its on-disk dtype. Loading a directory and
    saving it again reproduces its safetensors files byte for byte."""
    refuse_shard(transcoder)
    if not transcoder.cfg.cross_layer or transcoder.cfg.activation not in ("jumprelu", "relu") \
            or transcoder.cfg.skip:
        raise InputError("the mntss layout holds JumpReLU or ReLU cross-layer transcoders "
                         "without a skip path only")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, transcoder.cfg.disk_dtype)
    for layer in range(transcoder.n_layers):
        tensors = {f"W_enc_{layer}": transcoder.encoder_weight(layer),
                   f"b_enc_{layer}": transcoder.b_enc[layer],
                   f"b_dec_{layer}": transcoder.b_dec[layer]}
        if transcoder.cfg.activation == "jumprelu":
            tensors[f"threshold_{layer}"] = transcoder.threshold[layer]
        save_file({k: v.to(dtype).contiguous().cpu() for k, v in tensors.items()},
                  str(root / f"W_enc_{layer}.safetensors"))
        save_file({f"W_dec_{layer}": transcoder.W_dec[layer].to(dtype).contiguous().cpu()},
                  str(root / f"W_dec_{layer}.safetensors"))
    (root / "config.yaml").write_text(yaml.safe_dump(transcoder.cfg.yaml_dict(), sort_keys=False))
