"""GemmaScope-2 transcoders (``google/gemma-scope-2-{270m,1b,4b,12b,27b}-{pt,it}``, Gemma 3):
per-layer sets (``transcoder_all/layer_{l}_{variant}/``) and the CLT (270m, 1b:
``clt/width_262k_l0_medium_affine/params_layer_{l}.safetensors``). Files, tensors and hooks:
docs/transcoders.md. The model card's ``relu(z) * 1[z > threshold]`` is our ``z * 1[z >
threshold]`` once negative thresholds are raised to 0 (exact, done here); ``W_skip =
affine_skip_connection.T``. Without a config.json (the CLT) the hooks are ``mlp.hook_in`` ->
``hook_mlp_out``, as sae-lens assumes for ``clt`` folders."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import CROSS_LAYER
from ..transcoder import Transcoder, shard_features
from .common import (
    DTYPE_NAMES,
    LayerSlicer,
    LayerTensors,
    TranscoderFormatError,
    assemble_set,
    check_dtype,
    check_shapes,
    check_stored_dtypes,
    existing,
    in_layer_order,
    mmap_tensor,
    named_layers,
    open_safetensors,
    read_decoders,
    read_json_object,
    read_tensors,
    shapes_of,
    transcoder_config,
)

PARAMS = "params.safetensors"
CONFIG = "config.json"
CLT_FILE = re.compile(r"^params_layer_(\d+)\.safetensors$")
LAYER_FOLDER = re.compile(r"^layer_(\d+)_(.+)$")
KEYS = {"w_enc", "b_enc", "threshold", "w_dec", "b_dec"}
SKIP = "affine_skip_connection"
#: The feature axis of each CLT tensor that has one (a shard reads only its part of these).
CLT_AXES = {"w_enc": 1, "b_enc": 0, "threshold": 0, "w_dec": 0}
#: Hugging Face module points (``model.layers.{l}.<module>.output``) -> TransformerLens hooks.
HF_POINTS = {"pre_feedforward_layernorm": ("input", "mlp.hook_in"),
             "post_feedforward_layernorm": ("output", "hook_mlp_out"),
             "mlp": ("output", "mlp.hook_out")}
HF_POINT = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(\w+)\.output$")
DEFAULT_HOOKS = ("mlp.hook_in", "hook_mlp_out")


# ------------------------------------------------------------------------------ detection
def _layer_folders(root: Path) -> dict[str, dict[int, Path]]:
    """``{variant: {layer: folder}}`` of the ``layer_{l}_{variant}/params.safetensors`` folders."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for sub in root.iterdir() if root.is_dir() else ():
        match = LAYER_FOLDER.match(sub.name)
        if match and (sub / PARAMS).exists():
            found.setdefault(match.group(2), []).append((int(match.group(1)), sub))
    return {variant: named_layers(layers) for variant, layers in found.items()}


def _clt_files(root: Path) -> dict[int, Path]:
    return named_layers([(int(m.group(1)), p) for p in root.glob("params_layer_*.safetensors")
                         if (m := CLT_FILE.match(p.name))] if root.is_dir() else {})


def is_layout(path: Path) -> bool:
    """A GemmaScope-2 CLT folder (``params_layer_{l}.safetensors``) or a folder of per-layer
    ``layer_{l}_{variant}/params.safetensors`` folders."""
    return bool(_clt_files(path)) or bool(_layer_folders(path))


# ------------------------------------------------------------------------------ reading
def _read_config(path: Path, kind: str) -> dict:
    """config.json of a jump_relu ``kind`` (its ``type``: ``transcoder`` or ``clt``)."""
    meta = read_json_object(path)
    if meta.get("architecture", "jump_relu") != "jump_relu":
        raise TranscoderFormatError(f"{path}: architecture {meta['architecture']!r}; "
                                    "GemmaScope-2 transcoders are jump_relu")
    if meta.get("type", kind) != kind:
        raise TranscoderFormatError(f"{path}: type {meta.get('type')!r}, not a {kind}")
    return meta


def _hook(meta: dict, field: str, role: str, layer: int | None, where: Path,
          default: str | None = None) -> str:
    """The TransformerLens hook of config.json's ``hf_hook_point_in``/``_out`` (``default``,
    when given, where config.json has no such field)."""
    if default is not None and field not in meta:
        return default
    point = meta.get(field)
    match = HF_POINT.match(point) if isinstance(point, str) else None
    if match is None or match.group(2) not in HF_POINTS \
            or HF_POINTS[match.group(2)][0] != role:
        raise TranscoderFormatError(
            f"{where}: {field} {point!r} is not a module point we read for the transcoder's "
            f"{role} (model.layers.<l>.{{{', '.join(HF_POINTS)}}}.output)")
    if layer is not None and int(match.group(1)) != layer:
        raise TranscoderFormatError(f"{where}: {field} {point!r} is layer {match.group(1)}, "
                                    f"the folder's is {layer}")
    return HF_POINTS[match.group(2)][1]


def _check_keys(path: Path, shapes: dict, skip: bool | None) -> bool:
    """The file holds exactly the GemmaScope-2 tensors (with or without the affine skip, as
    ``skip`` says when known); returns whether it has the skip."""
    have_skip = SKIP in shapes
    missing, unknown = sorted(KEYS - set(shapes)), sorted(set(shapes) - KEYS - {SKIP})
    if missing or unknown or (skip is not None and skip != have_skip):
        parts = [f"missing {', '.join(missing)}" if missing else "",
                 f"unknown tensors {', '.join(unknown)}" if unknown else "",
                 f"{SKIP} {'absent' if skip else 'present'} while its config or folder name "
                 f"says {'affine' if skip else 'no affine skip'}"
                 if skip is not None and skip != have_skip else ""]
        raise TranscoderFormatError(f"{path}: " + "; ".join(p for p in parts if p)
                                    + f" (holds {sorted(shapes)})")
    return have_skip


#: What a GemmaScope-2 file's shapes disagree with, in its refusal.
ORIENTATION = "GemmaScope-2's orientation (w_enc is [d_model, width], w_dec [width, ...])"


def _skip(meta: dict, folder: Path) -> bool | None:
    """Whether the files hold the affine skip: config.json's ``affine_connection``, else True
    for a folder named ``*_affine`` (None: not known)."""
    affine = meta.get("affine_connection")
    if affine is not None:
        return bool(affine)
    return True if folder.name.endswith("_affine") else None


def read_layer(path: Path, *, lazy_decoder: bool = True, skip: bool | None = None
               ) -> LayerTensors:
    """One per-layer ``params.safetensors`` in our orientation: ``W_enc = w_enc.T``, ``W_dec =
    w_dec``, thresholds below 0 raised to 0, ``W_skip = affine_skip_connection.T``."""
    shapes = shapes_of(open_safetensors(path))
    has_skip = _check_keys(path, shapes, skip)
    d_model, width = shapes["w_enc"] if len(shapes["w_enc"]) == 2 else (None, None)
    want = {"w_enc": (d_model, width), "b_enc": (width,), "threshold": (width,),
            "w_dec": (width, d_model), "b_dec": (d_model,)} \
        | ({SKIP: (d_model, d_model)} if has_skip else {})
    check_shapes(path, shapes, want, ORIENTATION)
    tensors = read_tensors(path, sorted(set(want) - ({"w_dec"} if lazy_decoder else set())))
    handles = []
    if lazy_decoder:
        tensors["w_dec"], mapped = mmap_tensor(path, "w_dec")
        handles.append(mapped)
    return LayerTensors(str(path), W_enc=tensors["w_enc"].T, W_dec=tensors["w_dec"],
                        b_enc=tensors["b_enc"], b_dec=tensors["b_dec"],
                        threshold=tensors["threshold"].clamp(min=0),
                        W_skip=tensors[SKIP].T if has_skip else None, handles=handles)


def _variant_folders(root: Path, variant: str | None) -> list[Path]:
    variants = _layer_folders(root)
    if variant is None:
        if len(variants) != 1:
            raise TranscoderFormatError(
                f"{root} holds {len(variants)} variants of each layer "
                f"({', '.join(sorted(variants)) or 'none'}): pass variant=<one of them>")
        variant = next(iter(variants))
    if variant not in variants:
        raise TranscoderFormatError(f"{root}: no layer_<l>_{variant} folders (variants: "
                                    f"{', '.join(sorted(variants))})")
    return in_layer_order(variants[variant], f"{root}: variant {variant} has no folder")


def load(source: str | Path | list, *, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32, lazy_decoder: bool = True,
         variant: str | None = None, scan: str | None = None,
         feature_input_hook: str | None = None, feature_output_hook: str | None = None,
         shard: tuple[int, int] | None = None, **_ignored) -> Transcoder:
    """A GemmaScope-2 transcoder: a CLT folder (``params_layer_{l}.safetensors``), a folder of
    per-layer folders (``variant`` picks e.g. ``width_16k_l0_small_affine`` when it holds
    several), or a list of per-layer folders in layer order. Hooks come from each config.json (or
    the keyword arguments). ``shard=(rank, world)``: a per-layer set's slice is cut as each layer
    is read (one whole layer at a time); the CLT's slices alone are read (:func:`load_clt`)."""
    if not isinstance(source, list | tuple):
        root = Path(source).expanduser()
        if not root.exists():
            raise TranscoderFormatError(f"missing path {root}")
        if _clt_files(root):
            return load_clt(
                root, device=device, dtype=dtype, lazy_decoder=lazy_decoder, scan=scan,
                feature_input_hook=feature_input_hook,
                feature_output_hook=feature_output_hook, shard=shard)
        folders = _variant_folders(root, variant)
    else:
        folders = [Path(str(f)).expanduser() for f in source]
    layers, hooks, names = [], set(), set()
    slicer = LayerSlicer(shard)
    for layer, folder in enumerate(folders):
        config = existing(folder / CONFIG)
        meta = _read_config(config, "transcoder")
        hooks.add((feature_input_hook or _hook(meta, "hf_hook_point_in", "input", layer, config),
                   feature_output_hook
                   or _hook(meta, "hf_hook_point_out", "output", layer, config)))
        names.add(str(meta.get("model_name") or ""))
        layers.append(slicer(read_layer(folder / PARAMS, lazy_decoder=lazy_decoder,
                                        skip=_skip(meta, folder))))
    if len(hooks) != 1:
        raise TranscoderFormatError(f"{source}: the layers' config.json name different hooks "
                                    f"{sorted(hooks)}")
    (input_hook, output_hook), = hooks
    return assemble_set(
        layers, model_name=sorted(names)[-1], activation="jumprelu",
        feature_input_hook=input_hook, feature_output_hook=output_hook, scan=scan,
        source=str(source), dtype=dtype, device=device, lazy_decoder=lazy_decoder,
        **slicer.options)


def load_clt(source: str | Path | list, *, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, lazy_decoder: bool = True,
             scan: str | None = None, model_name: str = "",
             feature_input_hook: str | None = None,
             feature_output_hook: str | None = None,
             shard: tuple[int, int] | None = None) -> Transcoder:
    """The GemmaScope-2 CLT from its folder, or from its ``params_layer_{l}`` files in layer order
    (circuit-tracer's config lists them). Every file is checked first; decoders stay memory-mapped
    with ``lazy_decoder``; ``shard=(rank, world)`` reads only that rank's features."""
    check_dtype(dtype)
    if isinstance(source, list | tuple):
        files, root = [Path(str(f)) for f in source], None
    else:
        root = Path(source).expanduser()
        files = in_layer_order(_clt_files(root),
                               f"{root}: missing params_layer_<l>.safetensors")
    folder = root if root is not None else files[0].parent
    config = folder / CONFIG
    meta = _read_config(config, "clt") if config.exists() else {}
    input_hook = feature_input_hook or _hook(meta, "hf_hook_point_in", "input", None, config,
                                             DEFAULT_HOOKS[0])
    output_hook = feature_output_hook or _hook(meta, "hf_hook_point_out", "output", None,
                                               config, DEFAULT_HOOKS[1])
    skip = _skip(meta, folder)
    n_layers = len(files)
    shapes = [shapes_of(open_safetensors(path)) for path in files]
    skip = _check_keys(files[0], shapes[0], skip)
    if len(shapes[0]["w_enc"]) != 2:
        raise TranscoderFormatError(f"{files[0]}: w_enc has shape {shapes[0]['w_enc']}")
    d_model, width = shapes[0]["w_enc"]
    first = open_safetensors(files[0])
    check_stored_dtypes(files[0], first)
    disk_dtype = str(first.get_slice("w_enc").get_dtype())
    first_targets = []
    for layer, (path, shape) in enumerate(zip(files, shapes, strict=True)):
        _check_keys(path, shape, skip)
        targets = shape["w_dec"][1] if len(shape["w_dec"]) == 3 else None
        if targets not in (n_layers, n_layers - layer):
            raise TranscoderFormatError(
                f"{path}: w_dec has shape {shape['w_dec']}; with {n_layers} layer files it "
                f"must be [{width}, {n_layers}, {d_model}] (or [{width}, {n_layers - layer}, "
                f"{d_model}])")
        first_targets.append(layer if targets == n_layers else 0)
        check_shapes(path, shape, {
            "w_enc": (d_model, width), "b_enc": (width,), "threshold": (width,),
            "b_dec": (d_model,), "w_dec": (width, targets, d_model)}
            | ({SKIP: (d_model, d_model)} if skip else {}), ORIENTATION)
    features = shard_features(width, shard)
    names = ["w_enc", "b_enc", "threshold", "b_dec"] + ([SKIP] if skip else [])
    tensors = [read_tensors(path, names, features, CLT_AXES) for path in files]
    W_dec, handles = read_decoders([(path, "w_dec") for path in files], features,
                                   lazy_decoder=lazy_decoder, device=device, dtype=dtype,
                                   first_targets=first_targets)
    cfg = transcoder_config(source, model_name or str(meta.get("model_name") or ""), n_layers,
                            d_model, width, input_hook, output_hook, CROSS_LAYER,
                            DTYPE_NAMES.get(disk_dtype, disk_dtype), "jumprelu", None, skip,
                            scan)
    return Transcoder(
        cfg, b_enc=torch.stack([t["b_enc"].to(dtype) for t in tensors]),
        threshold=torch.stack([t["threshold"].to(dtype).clamp(min=0) for t in tensors]),
        b_dec=torch.stack([t["b_dec"].to(dtype) for t in tensors]),
        W_enc=torch.stack([t["w_enc"].to(dtype).T for t in tensors]), W_dec=W_dec,
        W_skip=[t[SKIP].to(dtype).T for t in tensors] if skip else None,
        dtype=dtype, device=device, source=str(source if root is None else root),
        features=features, handles=handles)
