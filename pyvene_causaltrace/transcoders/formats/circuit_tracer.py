"""circuit-tracer's transcoder configs: a ``config.yaml`` naming a per-layer set or a CLT.

    model_kind: transcoder_set            # or cross_layer_transcoder (mntss files beside it,
    model_name: google/gemma-2-2b         #   or GemmaScope-2 params_layer_{l} files listed)
    feature_input_hook: ln2.hook_normalized
    feature_output_hook: hook_mlp_out
    activation: topk                      # optional (default: jumprelu with thresholds, else
    k: 64                                 #   relu); scan: optional, default the hub reference
    transcoders:                          # optional, in layer order (default: layer_{l}.
      - hf://org/repo/layer_0.safetensors?revision=main   #   safetensors beside the config)
      - local/path/layer_1.safetensors                     # relative to the config

Per-layer files are circuit-tracer's (``W_dec`` ``[F, D]``, or ``[D, F]`` in older files, told
apart by the biases), GemmaScope-2's (lowercase ``w_enc``: :mod:`.gemmascope2`) or GemmaScope's
``.npz`` (:mod:`.gemmascope`); the old list-of-dicts form (``{id, layer, filepath}``) is read
too. Tensors per layout: docs/transcoders.md."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from ...errors import InputError
from ..config import ACTIVATIONS, CROSS_LAYER, MODEL_KINDS, TRANSCODER_SET
from ..transcoder import Transcoder, shard_features
from . import gemmascope2, mntss
from .common import (
    SETTING_TENSORS,
    LayerSlicer,
    LayerTensors,
    TranscoderFormatError,
    assemble_set,
    check_weight,
    hub_file,
    hub_snapshot,
    in_layer_order,
    mmap_tensor,
    named_layers,
    open_safetensors,
    read_features,
    read_yaml_mapping,
    reading,
    refuse_shard,
    resolve_reference,
    shapes_of,
)
from .gemmascope import read_npz

CONFIG = "config.yaml"
REQUIRED = ("model_kind", "feature_input_hook", "feature_output_hook")


def _config_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return path
    if path.is_dir() and (path / CONFIG).exists():
        return path / CONFIG
    return None


def _parsed(path: Path):
    """The YAML of ``path``'s config: None without one, ``...`` when it does not parse."""
    config = _config_file(path)
    try:
        return None if config is None else yaml.safe_load(config.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        return ...


def is_layout(path: Path) -> bool:
    """A circuit-tracer config (or a directory holding one) that is not an mntss CLT directory
    (those :mod:`.mntss` reads). A ``config.yaml`` that does not parse is taken as one, so that
    loading it says what is wrong with it (no other layout has a ``config.yaml``)."""
    meta = _parsed(path)
    return meta is ... or isinstance(meta, dict) and meta.get("model_kind") in MODEL_KINDS


def lists_files(path: Path) -> bool:
    """Whether ``path``'s config lists its files (``transcoders``): then other layouts' files
    beside it are the ones it names, not a second transcoder."""
    meta = _parsed(path)
    return isinstance(meta, dict) and meta.get("transcoders") is not None


def read_config(config: Path) -> dict:
    meta = read_yaml_mapping(config)
    missing = [key for key in REQUIRED if key not in meta]
    if missing:
        raise TranscoderFormatError(f"{config} lacks {', '.join(missing)}")
    if meta["model_kind"] not in MODEL_KINDS:
        raise TranscoderFormatError(f"{config}: model_kind {meta['model_kind']!r} is not one of "
                                    f"{', '.join(MODEL_KINDS)}")
    return meta


# --------------------------------------------------------------------- per-layer files
_RENAMES = {"activation_function.threshold": "threshold"}
_KNOWN = {"W_enc", "W_dec", "b_enc", "b_dec", "threshold", "W_skip", "k"}


def _native_shapes(path: Path, handle) -> dict[str, tuple[int, ...]]:
    """A circuit-tracer file's tensor shapes by our names; unknown or missing names raise."""
    shapes = {_RENAMES.get(key, key): shape for key, shape in shapes_of(handle).items()}
    unknown = sorted(set(shapes) - _KNOWN)
    missing = sorted({"W_enc", "W_dec", "b_enc", "b_dec"} - set(shapes))
    if unknown or missing:
        raise TranscoderFormatError(f"{path}: " + "; ".join(
            part for part in (f"missing {', '.join(missing)}" if missing else "",
                              f"unknown tensors {', '.join(unknown)}" if unknown else "") if part))
    return shapes


def read_layer_file(path: Path, *, lazy_decoder: bool = True,
                    features: tuple[int, int] | None = None) -> tuple[LayerTensors, int | None]:
    """One per-layer safetensors file in our orientation, and its ``k`` (None if absent), after
    checking every full shape from the header; with ``features=(lo, hi)`` only those features of
    a circuit-tracer file are read, through ``get_slice`` (rows of an ``[F, D]`` tensor, columns
    of a ``[D, F]`` one; the decoder a view of its memory map with ``lazy_decoder``)."""
    handle = open_safetensors(path)
    if "w_enc" in handle.keys():  # GemmaScope-2: oriented by name, not by shape
        if features is not None:
            raise InputError(f"{path}: GemmaScope-2 files are not read in slices")
        return gemmascope2.read_layer(path, lazy_decoder=lazy_decoder), None
    shapes = _native_shapes(path, handle)
    d_transcoder, d_model = shapes["b_enc"][0], shapes["b_dec"][0]
    oriented = {(d_transcoder, d_model), (d_model, d_transcoder)}
    want = {"W_enc": oriented, "W_dec": oriented, "b_enc": {(d_transcoder,)},
            "b_dec": {(d_model,)}, "threshold": {(d_transcoder,)}, "W_skip": {(d_model, d_model)}}
    wrong = {name: shape for name, shape in shapes.items() if name in want
             and tuple(shape) not in want[name]}
    if wrong:
        raise TranscoderFormatError(
            f"{path}: shapes {wrong} disagree with b_enc/b_dec (d_transcoder {d_transcoder}, "
            f"d_model {d_model}; W_enc and W_dec are [F, D] or [D, F])")
    names = {_RENAMES.get(key, key): key for key in handle.keys()}
    tensors, handles = {}, []
    with reading(path):
        for ours, theirs in names.items():
            shape = tuple(shapes[ours])
            transposed = ours in ("W_enc", "W_dec") and shape == (d_model, d_transcoder) \
                and d_model != d_transcoder
            if ours in SETTING_TENSORS:  # k: a setting, not a weight
                tensors[ours] = handle.get_tensor(theirs)
            elif ours in ("b_dec", "W_skip"):
                tensors[ours] = check_weight(handle.get_tensor(theirs), path, theirs)
            elif transposed:  # [D, F]: columns; rows of a transposed map are not rows
                tensors[ours] = check_weight(
                    read_features(handle, theirs, features, 1).T.contiguous(), path, theirs)
            elif ours == "W_dec" and lazy_decoder:
                tensors[ours], mapped = mmap_tensor(path, theirs, features)
                handles.append(mapped)
            else:  # a view of the file's map (only these rows are read): assemble_set copies
                tensors[ours] = check_weight(read_features(handle, theirs, features), path,
                                             theirs)
    k = tensors.pop("k", None)
    layer = LayerTensors(str(path), W_enc=tensors["W_enc"], W_dec=tensors["W_dec"],
                         b_enc=tensors["b_enc"], b_dec=tensors["b_dec"],
                         threshold=tensors.get("threshold"), W_skip=tensors.get("W_skip"),
                         handles=handles)
    return layer, None if k is None else int(k.reshape(-1)[0])


def _widths(path: Path) -> tuple[int, int] | None:
    """``(d_transcoder, d_model)`` of a circuit-tracer safetensors file from its header, or
    None for a file read whole (``.npz``, GemmaScope-2)."""
    if path.suffix == ".npz":
        return None
    handle = open_safetensors(path)
    if "w_enc" in handle.keys():
        return None
    shapes = _native_shapes(path, handle)
    return shapes["b_enc"][0], shapes["b_dec"][0]


def _slice_plan(files: list[Path], shard) -> tuple[tuple[int, int], int] | None:
    """``(features, d_transcoder)`` for reading every file in slices, after checking from the
    headers that every layer has layer 0's widths; None when some file is read whole."""
    widths = [_widths(path) for path in files]
    if any(w is None for w in widths):
        return None
    for index, (path, got) in enumerate(zip(files, widths, strict=True)):
        if got != widths[0]:
            raise TranscoderFormatError(
                f"{path} (layer {index}): d_transcoder {got[0]}, d_model {got[1]} disagree "
                f"with layer 0 (d_transcoder {widths[0][0]}, d_model {widths[0][1]})")
    return shard_features(widths[0][0], shard), widths[0][0]


def _layer_files(meta: dict, config: Path, hub: tuple[str, str | None, str] | None) -> list[Path]:
    entries = meta.get("transcoders")
    if entries is None:  # circuit-tracer's default: layer_{l}.safetensors beside the config
        if hub is not None:
            repo, revision, sub = hub
            root = hub_snapshot(repo, revision, [f"{sub}layer_*.safetensors"]) / sub
        else:
            root = config.parent
        found = named_layers([(int(p.stem.removeprefix("layer_")), p)
                              for p in root.glob("layer_*.safetensors")
                              if p.stem.removeprefix("layer_").isdecimal()])
        if not found:
            raise TranscoderFormatError(f"{config}: no 'transcoders' list and no "
                                        "layer_<l>.safetensors files beside it")
        return in_layer_order(found, f"{root}: missing layer_<l>.safetensors")
    if not isinstance(entries, list) or not entries:
        raise TranscoderFormatError(f"{config}: 'transcoders' must be a list of files")
    if all(isinstance(e, dict) for e in entries):  # the old {id, layer, filepath} form
        layers = [e.get("layer") for e in entries]
        if sorted(layers) != list(range(len(layers))):
            raise TranscoderFormatError(f"{config}: transcoders for layers {sorted(layers)}; "
                                        f"expected 0..{len(layers) - 1}")
        entries = [e["filepath"] for e in sorted(entries, key=lambda e: e["layer"])]
    paths = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise TranscoderFormatError(f"{config}: transcoders[{index}] is not a path")
        ref, _, query = entry.partition("?revision=")
        if query and ref.startswith("hf://"):
            parts = ref.removeprefix("hf://").split("/")
            ref = f"hf://{parts[0]}/{parts[1]}@{query}/" + "/".join(parts[2:])
        paths.append(resolve_reference(ref, config.parent))
    return paths


def load(source: str | Path, *, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32, lazy_decoder: bool = True,
         lazy_encoder: bool = False, revision: str | None = None,
         shard: tuple[int, int] | None = None) -> Transcoder:
    """A transcoder from a circuit-tracer config: a local ``config.yaml`` (or its directory) or
    a hub reference ``org/repo[/subfolder][@revision]``; ``shard=(rank, world)`` keeps that
    rank's features (module docstring)."""
    local = Path(str(source)).expanduser()
    hub = None
    config = _config_file(local) if local.exists() else None
    if config is None:
        if local.exists():
            raise TranscoderFormatError(f"{local} has no {CONFIG}")
        ref, _, at = str(source).partition("@")
        parts = ref.strip("/").split("/")
        if len(parts) < 2:
            raise TranscoderFormatError(f"{source!r} is neither a local path nor a hub "
                                        "reference org/repo[/subfolder][@revision]")
        repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
        sub = f"{sub}/" if sub else ""
        hub = (repo, at or revision, sub)
        config = hub_file(repo, f"{sub}{CONFIG}", at or revision)
    meta = read_config(config)
    scan = meta.get("scan")
    if scan is None and hub is not None:
        scan = hub[0] + (f"//{hub[2].rstrip('/')}" if hub[2] else "") \
            + (f"@{hub[1]}" if hub[1] else "")
    if meta["model_kind"] == CROSS_LAYER and meta.get("transcoders") is not None:
        # GemmaScope-2's CLT: its params_layer_{l} files listed in layer order
        return gemmascope2.load_clt(
            _layer_files(meta, config, hub), device=device, dtype=dtype,
            lazy_decoder=lazy_decoder, scan=None if scan is None else str(scan),
            model_name=str(meta.get("model_name") or ""),
            feature_input_hook=meta["feature_input_hook"],
            feature_output_hook=meta["feature_output_hook"], shard=shard)
    if meta["model_kind"] == CROSS_LAYER:
        root = config.parent
        if hub is not None:
            repo, rev, sub = hub
            root = hub_snapshot(repo, rev, [f"{sub}*.safetensors", f"{sub}{CONFIG}"]) / sub
        clt = mntss.load_from_disk(root, device=device, dtype=dtype, lazy_decoder=lazy_decoder,
                                   lazy_encoder=lazy_encoder, shard=shard)
        if scan is not None:
            clt.cfg = replace(clt.cfg, scan=str(scan))
        return clt
    assert meta["model_kind"] == TRANSCODER_SET
    files = _layer_files(meta, config, hub)
    plan = None if shard is None else _slice_plan(files, shard)
    slicer = LayerSlicer(shard if plan is None else None)  # files read whole: cut one by one
    layers, ks = [], set()
    for path in files:
        layer, k = (read_npz(path), None) if path.suffix == ".npz" else read_layer_file(
            path, lazy_decoder=lazy_decoder, features=None if plan is None else plan[0])
        layers.append(slicer(layer))
        ks.add(k)
    has_threshold = any(layer.threshold is not None for layer in layers)
    activation = meta.get("activation") or ("jumprelu" if has_threshold else "relu")
    activation = {"jump_relu": "jumprelu", "jumprelu": "jumprelu"}.get(activation, activation)
    k = meta.get("k")
    ks.discard(None)
    if k is not None and ks and ks != {k}:
        raise TranscoderFormatError(f"{config}: k {k!r}, but the files hold k "
                                    f"{sorted(ks)}")
    if k is None and activation == "topk":
        if len(ks) != 1:
            raise TranscoderFormatError(f"{config}: activation topk needs k (the config's or "
                                        f"the files'); found {sorted(ks) or 'none'}")
        k = ks.pop()
    if meta.get("k") is not None and activation in ACTIVATIONS \
            and not activation.endswith("topk"):
        raise TranscoderFormatError(f"{config}: k {meta['k']!r} but activation {activation!r}"
                                    f"{'' if meta.get('activation') else ' (the default)'}: "
                                    "a top-k set says activation: topk")
    if has_threshold and activation in ACTIVATIONS and activation != "jumprelu":
        raise TranscoderFormatError(f"{config}: activation {activation!r}, but the files hold "
                                    "JumpReLU thresholds (activation_function.threshold), "
                                    "which circuit-tracer applies: read as such, they are lost")
    return assemble_set(
        layers, model_name=str(meta.get("model_name") or ""), activation=activation, k=k,
        feature_input_hook=meta["feature_input_hook"],
        feature_output_hook=meta["feature_output_hook"],
        scan=None if scan is None else str(scan), source=str(config if hub is None else source),
        dtype=dtype, device=device, lazy_decoder=lazy_decoder, **(
            slicer.options if plan is None else {"features": plan[0], "d_transcoder": plan[1]}))


def save(transcoder: Transcoder, path: str | Path) -> None:
    """Write a per-layer set as circuit-tracer's layout: ``config.yaml`` (its ``transcoders``
    the relative ``layer_{l}.safetensors`` files) and one native file per layer, in the set's
    on-disk dtype."""
    cfg = transcoder.cfg
    refuse_shard(transcoder)
    if cfg.cross_layer:
        raise InputError("a cross-layer transcoder is written in the mntss layout")
    if transcoder.score_weight is not None:
        raise InputError(f"this {cfg.activation} set ranks its features by weights "
                         "(score_weight, e.g. llamascopium's decoder norms) that circuit-tracer's "
                         "layout cannot hold: written there it would pick other features")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg.disk_dtype)
    ids = torch.arange(cfg.d_transcoder)
    for layer in range(cfg.n_layers):
        tensors = {"W_enc": transcoder.encoder_weight(layer),
                   "W_dec": transcoder.decoder_rows(layer, ids)[:, 0],
                   "b_enc": transcoder.b_enc[layer], "b_dec": transcoder.b_dec[layer]}
        if cfg.activation == "jumprelu":
            tensors["activation_function.threshold"] = transcoder.threshold[layer]
        if transcoder.W_skip is not None:
            tensors["W_skip"] = transcoder.W_skip[layer]
        tensors = {k: v.to(dtype).contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, str(root / f"layer_{layer}.safetensors"))
    meta = {"model_name": cfg.model_name, "model_kind": TRANSCODER_SET,
            "feature_input_hook": cfg.feature_input_hook,
            "feature_output_hook": cfg.feature_output_hook, "activation": cfg.activation}
    if cfg.k is not None:
        meta["k"] = cfg.k
    if cfg.scan is not None:
        meta["scan"] = cfg.scan
    meta["transcoders"] = [f"layer_{layer}.safetensors" for layer in range(cfg.n_layers)]
    (root / CONFIG).write_text(yaml.safe_dump(meta, sort_keys=False))
