"""EleutherAI sparsify TopK transcoders: one directory per hookpoint.

    root/layers.{l}.mlp/cfg.json          k, num_latents, d_in, transcode, skip_connection, ...
    root/layers.{l}.mlp/sae.safetensors   encoder.weight [F, D], encoder.bias [F], W_dec [F, D],
                                          b_dec [D], W_skip [D, D] (skip_connection)

(``h.{l}.mlp`` for GPT-2.) It reads ``mlp.hook_in`` and predicts ``mlp.hook_out``: the ``k``
largest of ``relu(x @ W_enc.T + b_enc)``, decoded plus ``x @ W_skip.T``. Files from before
``transcode`` was stored subtracted ``b_dec`` from the input: folded exactly into ``b_enc``.
``transcode: false`` (a plain SAE) is refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..transcoder import Transcoder, shard_features
from .common import (
    LayerTensors,
    TranscoderFormatError,
    assemble_set,
    check_shapes,
    existing,
    in_layer_order,
    mmap_tensor,
    named_layers,
    open_safetensors,
    read_json_object,
    read_tensors,
    shapes_of,
)

HOOKPOINT = re.compile(r"^(?:.*\.)?(?:layers|h)\.(\d+)\.mlp$")
KEYS = {"encoder.weight", "encoder.bias", "W_dec", "b_dec"}
#: The feature axis of each tensor that has one (a shard reads only its rows of these).
AXES = {"encoder.weight": 0, "encoder.bias": 0, "W_dec": 0}


def _hookpoints(root: Path) -> dict[int, Path]:
    found = []
    for sub in root.iterdir() if root.is_dir() else ():
        match = HOOKPOINT.match(sub.name)
        if match and (sub / "cfg.json").exists():
            found.append((int(match.group(1)), sub))
    return named_layers(found)


def is_layout(path: Path) -> bool:
    return bool(_hookpoints(path))


def _header(weights: Path, skip: bool, width: int | None = None) -> int:
    """The file's feature count (``encoder.weight``'s rows) after checking, from its header,
    that it holds every tensor in a consistent shape — and ``width`` features when given (the
    first layer's): a sharded load reads slices, which alone would hide a wrong width."""
    shapes = shapes_of(open_safetensors(weights))
    names = KEYS | ({"W_skip"} if skip else set())
    missing = sorted(names - set(shapes))
    if missing:
        raise TranscoderFormatError(f"{weights}: missing {', '.join(missing)} (holds "
                                    f"{sorted(shapes)})")
    rows, d_model = shapes["encoder.weight"] if len(shapes["encoder.weight"]) == 2 \
        else (None, None)
    width = rows if width is None else width
    want = {"encoder.weight": (width, d_model), "encoder.bias": (width,),
            "W_dec": (width, d_model), "b_dec": (d_model,)} \
        | ({"W_skip": (d_model, d_model)} if skip else {})
    check_shapes(weights, {name: shapes[name] for name in want}, want,
                 f"the first layer's {width} features")
    return width


def _config(sub: Path) -> dict:
    cfg_file = sub / "cfg.json"
    existing(sub / "sae.safetensors")
    cfg = read_json_object(cfg_file)
    if cfg.get("transcode") is False:
        raise TranscoderFormatError(f"{cfg_file}: transcode is false — a sparse autoencoder, "
                                    "not a transcoder")
    if cfg.get("activation", "topk") != "topk":
        raise TranscoderFormatError(f"{cfg_file}: unknown activation {cfg['activation']!r} "
                                    "(only topk is supported)")
    return cfg


def _read(sub: Path, cfg: dict, lazy_decoder: bool,
          features: tuple[int, int] | None = None) -> LayerTensors:
    """One layer; with ``features=(lo, hi)`` only those rows of ``encoder.weight``,
    ``encoder.bias`` and ``W_dec`` are read (a view of the memory-mapped decoder with
    ``lazy_decoder``)."""
    weights = sub / "sae.safetensors"
    skip = bool(cfg.get("skip_connection", False))
    names = KEYS | ({"W_skip"} if skip else set())
    tensors = read_tensors(weights, sorted(names - ({"W_dec"} if lazy_decoder else set())),
                           features, AXES)
    handles = []
    if lazy_decoder:
        tensors["W_dec"], mapped = mmap_tensor(weights, "W_dec", features)
        handles.append(mapped)
    b_enc = tensors["encoder.bias"]
    if "transcode" not in cfg:  # the input was x - b_dec: fold it into the encoder's bias
        W = tensors["encoder.weight"]
        b_enc = b_enc.double() - W.double() @ tensors["b_dec"].double()  # kept in float64
    return LayerTensors(str(weights), W_enc=tensors["encoder.weight"], W_dec=tensors["W_dec"],
                        b_enc=b_enc, b_dec=tensors["b_dec"], W_skip=tensors.get("W_skip"),
                        handles=handles)


def load(source: str | Path, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", lazy_decoder: bool = True,
         model_name: str = "", scan: str | None = None,
         shard: tuple[int, int] | None = None, **_ignored) -> Transcoder:
    """A per-layer TopK set from a sparsify run directory (one subdirectory per layer's MLP).
    ``shard=(rank, world)`` reads only that rank's features (``get_slice``); its top-k is then a
    collective over the ranks."""
    root = Path(source).expanduser()
    found = _hookpoints(root)
    if not found:
        raise TranscoderFormatError(f"{root}: no <layers|h>.<l>.mlp directories with cfg.json")
    layers, ks = [], set()
    features = width = None
    for sub in in_layer_order(found, f"{root}: no transcoder"):
        cfg = _config(sub)
        if shard is not None:
            width = _header(sub / "sae.safetensors", bool(cfg.get("skip_connection", False)),
                            width)
            features = features or shard_features(width, shard)
        layers.append(_read(sub, cfg, lazy_decoder, features))
        ks.add(cfg.get("k"))
    if len(ks) != 1 or not isinstance(next(iter(ks)), int):
        raise TranscoderFormatError(f"{root}: layers disagree on k or lack it: "
                                    f"{sorted(ks, key=str)}")
    run_config = root / "config.json"
    if not model_name and run_config.exists():
        model_name = str(json.loads(run_config.read_text()).get("model", ""))
    return assemble_set(
        layers, model_name=model_name, activation="relu_topk", k=ks.pop(),
        feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out", scan=scan,
        source=str(root), dtype=dtype, device=device, lazy_decoder=lazy_decoder,
        features=features, d_transcoder=width)
