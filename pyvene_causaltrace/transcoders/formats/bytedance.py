"""ByteDance's cross-layer TopK CLT (``ByteDance-Seed/Cross-Layer-TopK-CLT``, Qwen3-8B-Base: 36
layers x 32,768 features, fp32), as its model card describes it (files and tensors:
docs/transcoders.md). ``a_l = relu(W_enc_l x_l)``; the ``L * k`` features of best ``a_l[i] *
W_dec_norm[l, i]`` over all layers are kept jointly at each position (``joint_topk``);
``mlp_out[m] = sum_{l <= m} a_l @ W_dec_l[:, m - l]``, read from ``hook_resid_mid`` into
``mlp.hook_out``. ``factors.safetensors`` is already folded in (not read). The card's rule
dropping tokens of outsized norm (20x a layer's mean) is applied to position 0 only, zeroed as
for every transcoder."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import CROSS_LAYER
from ..transcoder import Transcoder, shard_features
from .common import (
    DTYPE_NAMES,
    TranscoderFormatError,
    check_dtype,
    check_stored_dtypes,
    encoder_layers,
    open_safetensors,
    read_decoders,
    read_json_object,
    read_tensors,
    shapes_of,
    transcoder_config,
)

CONFIG = "config.json"
NORMS = "W_dec_norm.safetensors"
INPUT_HOOK, OUTPUT_HOOK = "hook_resid_mid", "mlp.hook_out"
#: config.json keys that may name the base model and the dimensions (checked when present).
MODEL_KEYS = ("base_model", "model_name", "model")
DIMENSION_KEYS = {"n_layers": 0, "num_layers": 0, "d_model": 2, "hidden_size": 2}


def is_layout(path: Path) -> bool:
    """A directory with config.json, ``W_enc_0.safetensors`` and ``W_dec_norm.safetensors``."""
    return path.is_dir() and all((path / name).exists()
                                 for name in (CONFIG, "W_enc_0.safetensors", NORMS))


def _config(path: Path) -> dict:
    meta = read_json_object(path)
    for key in ("d_feature", "k"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) \
                or meta[key] < 1:
            raise TranscoderFormatError(f"{path}: {key} must be an integer >= 1, got "
                                        f"{meta.get(key)!r}")
    return meta


def load(source: str | Path, *, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32, lazy_decoder: bool = True,
         scan: str | None = None, shard: tuple[int, int] | None = None,
         **_ignored) -> Transcoder:
    """The CLT from its directory; every file checked before anything is returned, decoders
    memory-mapped with ``lazy_decoder``. ``shard=(rank, world)`` reads only that rank's features
    (``get_slice``); its joint top-k is then a collective over the ranks."""
    check_dtype(dtype)
    root = Path(source).expanduser()
    meta = _config(root / CONFIG)
    stated = next((meta[key] for key in ("n_layers", "num_layers")
                   if isinstance(meta.get(key), int)), None)
    n_layers, width = encoder_layers(root, stated, str(root / CONFIG)), meta["d_feature"]
    first = root / "W_enc_0.safetensors"
    enc_0 = open_safetensors(first)
    enc_shape = shapes_of(enc_0).get("W_enc_0")
    if enc_shape is None or len(enc_shape) != 2 or enc_shape[0] != width:
        raise TranscoderFormatError(f"{first}: W_enc_0 has shape "
                                    f"{enc_shape}; config.json's d_feature is {width}")
    d_model = enc_shape[1]
    dims = (n_layers, width, d_model)
    for key, axis in DIMENSION_KEYS.items():
        if key in meta and meta[key] != dims[axis]:
            raise TranscoderFormatError(f"{root / CONFIG}: {key} {meta[key]} but the files "
                                        f"hold {dims[axis]}")
    for layer in range(n_layers):
        for name, want in ((f"W_enc_{layer}", {f"W_enc_{layer}": (width, d_model)}),
                           (f"W_dec_{layer}", {f"W_dec_{layer}": (width, n_layers - layer,
                                                                  d_model),
                                               f"W_dec_norm_{layer}": (width,)})):
            got = shapes_of(open_safetensors(root / f"{name}.safetensors"))
            if got != want:
                raise TranscoderFormatError(f"{root / name}.safetensors holds {got}, expected "
                                            f"{want}")
    features = shard_features(width, shard)
    lo, hi = features or (0, width)
    norms_shapes = shapes_of(open_safetensors(root / NORMS))
    if norms_shapes != {"W_dec_norm": (n_layers, width)}:
        raise TranscoderFormatError(f"{root / NORMS} holds {norms_shapes}, expected "
                                    f"W_dec_norm [{n_layers}, {width}]")
    score = read_tensors(root / NORMS, None, features, {"W_dec_norm": 1})["W_dec_norm"]
    for layer in range(n_layers):
        own = read_tensors(root / f"W_dec_{layer}.safetensors", [f"W_dec_norm_{layer}"],
                           features, {f"W_dec_norm_{layer}": 0})
        if not torch.equal(own[f"W_dec_norm_{layer}"], score[layer]):
            raise TranscoderFormatError(f"{root}/W_dec_{layer}.safetensors: W_dec_norm_{layer} "
                                        f"differs from {NORMS}'s row {layer}")
    if (score < 0).any():  # finite: checked as read
        raise TranscoderFormatError(f"{root / NORMS}: decoder norms must be >= 0")
    check_stored_dtypes(first, enc_0)
    disk_dtype = str(enc_0.get_slice("W_enc_0").get_dtype())
    W_enc = torch.stack([read_tensors(root / f"W_enc_{layer}.safetensors", None, features,
                                      {f"W_enc_{layer}": 0})[f"W_enc_{layer}"].to(dtype)
                         for layer in range(n_layers)])
    W_dec, handles = read_decoders(
        [(root / f"W_dec_{layer}.safetensors", f"W_dec_{layer}") for layer in range(n_layers)],
        features, lazy_decoder=lazy_decoder, device=device, dtype=dtype)
    model_name = next((str(meta[key]) for key in MODEL_KEYS if isinstance(meta.get(key), str)),
                      "")
    cfg = transcoder_config(root / CONFIG, model_name, n_layers, d_model, width, INPUT_HOOK,
                            OUTPUT_HOOK, CROSS_LAYER, DTYPE_NAMES[disk_dtype], "joint_topk",
                            n_layers * meta["k"], False, scan)
    zeros = torch.zeros(n_layers, hi - lo)
    return Transcoder(cfg, b_enc=zeros, threshold=None, b_dec=torch.zeros(n_layers, d_model),
                      W_enc=W_enc, W_dec=W_dec, score_weight=score if features is None
                      else score.clone(), dtype=dtype, device=device, source=str(root),
                      features=features, handles=handles)
