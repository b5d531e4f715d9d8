"""llamascopium's per-layer transcoders (OpenMOSS, formerly lm-saes; 2.0.0b34's
``SparseAutoEncoder``, ``sae_type: "sae"``), the MLP half of a Llama Scope 2 replacement model
(its attention half is Lorsa: :func:`~..lorsa.load_lorsa`)::

    root/<name>/config.json                 sae_type "sae", hook_point_in/out, act_fn, top_k, ...
    root/<name>/sae_weights.safetensors     W_E [D, F]  b_E [F]  W_D [F, D]  b_D [D]
                                            (jumprelu: activation_function.log_jumprelu_threshold)

one directory per layer (``root`` may also be one such directory), read by their
``hook_point_in`` (``blocks.<l>.ln2.hook_normalized``: the MLP norm's input over its RMS,
*without* the norm's gain, as TransformerLens's ``fold_ln`` gives it) into ``hook_point_out``
(``blocks.<l>.hook_mlp_out``). Directories of other kinds beside them (``sae_type: "lorsa"``)
are left to their own loader.

``sparsity_include_decoder_norm`` (their default): the activation function sees ``pre *
|W_D[f]|`` and the activation is ``pre``. TopK is our ``relu_topk`` ranked by ``score_weight =
|W_D[f]|``; JumpReLU's threshold becomes ``exp(log_threshold) / |W_D[f]|``.
``norm_activation="dataset-wise"`` is folded as their ``standardize_parameters_of_dataset_norm``
folds it (not with JumpReLU, whose threshold their fold leaves unscaled). Refused
(:class:`TranscoderFormatError`, naming the file and field): a GLU encoder, an encoder reading
``x - b_D`` (``apply_decoder_bias_to_pre_encoder``), ``batchtopk``,
token- or batch-wise normalisation, an SAE (one hook in and out), a transcoder whose hooks
name two layers."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..transcoder import Transcoder
from .common import (
    LayerSlicer,
    LayerTensors,
    TranscoderFormatError,
    assemble_set,
    in_layer_order,
    named_layers,
    norm_factor,
    read_json_object,
    read_tensors,
    widened,
)

CONFIG, WEIGHTS = "config.json", "sae_weights.safetensors"
NORM_KEY = "dataset_average_activation_norm."
THRESHOLD = "activation_function.log_jumprelu_threshold"
ACTIVATIONS = {"topk": "relu_topk", "relu": "relu", "jumprelu": "jumprelu"}
#: Their defaults (models/sparse_dictionary.py, models/sae.py) of what a config may leave out.
DEFAULTS = {"act_fn": "relu", "norm_activation": "dataset-wise", "top_k": 50,
            "sparsity_include_decoder_norm": True, "use_decoder_bias": True,
            "use_glu_encoder": False, "apply_decoder_bias_to_pre_encoder": False}


def _config(path: Path) -> dict | None:
    """``path/config.json`` as a dict when it is a llamascopium dictionary's, else None."""
    file = path / CONFIG
    if not (file.is_file() and (path / WEIGHTS).is_file()):
        return None
    meta = read_json_object(file)
    return meta if "sae_type" in meta and "hook_point_in" in meta else None


def _folders(root: Path) -> list[tuple[Path, dict]]:
    """The transcoder directories under ``root`` (or ``root`` itself) with their configs."""
    if not root.is_dir():
        return []
    own = _config(root)
    found = [(root, own)] if own is not None else [
        (sub, meta) for sub in sorted(p for p in root.iterdir() if p.is_dir())
        if (meta := _config(sub)) is not None]
    return [(folder, meta) for folder, meta in found if meta["sae_type"] != "lorsa"]


def is_layout(path: Path) -> bool:
    """A llamascopium transcoder directory, or a directory of them (Lorsas may sit beside)."""
    return path.is_dir() and bool(_folders(path))


def _layer(meta: dict, file: Path) -> int:
    layers = []
    for key in ("hook_point_in", "hook_point_out"):
        found = re.fullmatch(r"blocks\.(\d+)\.(.+)", str(meta.get(key)))
        if found is None:
            raise TranscoderFormatError(f"{file}: {key} must be 'blocks.<layer>.<hook>', got "
                                        f"{meta.get(key)!r}")
        layers.append(int(found.group(1)))
    if meta["hook_point_in"] == meta["hook_point_out"]:
        raise TranscoderFormatError(f"{file}: hook_point_in = hook_point_out: an SAE, not a "
                                    "transcoder")
    if layers[0] != layers[1]:
        raise TranscoderFormatError(f"{file}: hook_point_in names layer {layers[0]}, "
                                    f"hook_point_out layer {layers[1]}: not a per-layer "
                                    "transcoder")
    return layers[0]


def _check(meta: dict, file: Path) -> dict:
    """The config with their defaults filled in; what we cannot represent refused."""
    meta = DEFAULTS | meta
    refusals = {
        "sae_type": (meta["sae_type"] != "sae", "only 'sae' (per-layer transcoders) is read "
                     "here; 'lorsa' is load_lorsa's, cross-layer kinds are not supported"),
        "use_glu_encoder": (meta["use_glu_encoder"], "a GLU encoder has no counterpart here"),
        "apply_decoder_bias_to_pre_encoder": (
            meta["apply_decoder_bias_to_pre_encoder"] and meta["use_decoder_bias"],
            "their encoder reads x - b_D, which is not read here"),
        "act_fn": (meta["act_fn"] not in ACTIVATIONS,
                   f"known: {', '.join(ACTIVATIONS)} (batchtopk selects over a batch)"),
        "norm_activation": (meta["norm_activation"] not in ("inference", "dataset-wise"),
                            "token- or batch-wise input scaling is not a fixed map"),
    }
    if meta["act_fn"] == "jumprelu" and meta["norm_activation"] == "dataset-wise":
        # their fold scales b_E and W_D but not the threshold: folded and unfolded disagree
        refusals["norm_activation"] = (True, "with jumprelu, their own fold changes which "
                                       "features fire; fold it with their save_pretrained("
                                       "fold_activation_scale=True) to choose theirs")
    for key, (refused, why) in refusals.items():
        if refused:
            raise TranscoderFormatError(f"{file}: {key} {meta[key]!r}: {why}")
    if meta["act_fn"] == "topk" and not (isinstance(meta["top_k"], int) and meta["top_k"] >= 1):
        raise TranscoderFormatError(f"{file}: top_k must be an integer >= 1, got "
                                    f"{meta['top_k']!r}")
    return meta


def _check_widths(meta: dict, shape: torch.Size, file: Path) -> None:
    """Refuse a config whose ``d_model``, ``d_sae`` (``d_model * expansion_factor``) or TopK
    ``top_k`` disagree with ``W_E [D, F]`` (their strict loader refuses such a file; we read
    the tensors)."""
    d_model, width = shape
    fields = {"d_model": (meta.get("d_model"), d_model)}
    if isinstance(meta.get("d_model"), int) and isinstance(meta.get("expansion_factor"),
                                                            int | float):
        fields["expansion_factor"] = (int(meta["d_model"] * meta["expansion_factor"]), width)
    for key, (said, held) in fields.items():
        if said is not None and said != held:
            raise TranscoderFormatError(f"{file}: {key} {meta[key]!r} gives {said}; W_E "
                                        f"{list(shape)} holds {held}")
    if meta["act_fn"] == "topk" and meta["top_k"] > width:
        raise TranscoderFormatError(f"{file}: top_k {meta['top_k']} is more than the {width} "
                                    "features W_E holds")


def read_layer(folder: Path, meta: dict) -> tuple[LayerTensors, torch.Tensor | None]:
    """One layer in our orientation, folded (module docstring), and its ranking weights (the
    decoder norms: TopK under ``sparsity_include_decoder_norm``; else None)."""
    file = folder / WEIGHTS
    names = ["W_E", "b_E", "W_D"] + (["b_D"] if meta["use_decoder_bias"] else []) \
        + ([THRESHOLD] if meta["act_fn"] == "jumprelu" else [])
    if meta["norm_activation"] == "dataset-wise":
        names += [NORM_KEY + meta[key] for key in ("hook_point_in", "hook_point_out")]
    tensors = read_tensors(file, names)
    W_E, W_D = tensors["W_E"], tensors["W_D"]
    if W_E.dim() != 2 or W_D.shape != W_E.T.shape:
        raise TranscoderFormatError(f"{file}: W_E {list(W_E.shape)} and W_D "
                                    f"{list(W_D.shape)} are not [D, F] and [F, D]")
    _check_widths(meta, W_E.shape, file)
    b_E = tensors["b_E"]
    b_D = tensors.get("b_D", torch.zeros(W_E.shape[0], dtype=W_E.dtype))
    if meta["norm_activation"] == "dataset-wise":  # models/sae.py, standardize_parameters_...
        into, out = (norm_factor(file, NORM_KEY + meta[key], tensors, W_E.shape[0])
                     for key in ("hook_point_in", "hook_point_out"))
        b_E, b_D, W_D = (widened(b_E) / into, widened(b_D) / out,  # not in bf16 (lorsa's)
                         widened(W_D) * (into / out))
    norm = W_D.norm(dim=1) if meta["sparsity_include_decoder_norm"] else None
    threshold = None
    if meta["act_fn"] == "jumprelu":
        threshold = tensors[THRESHOLD].exp()
        threshold = threshold / norm if norm is not None else threshold
    layer = LayerTensors(str(file), W_enc=W_E.T.contiguous(), W_dec=W_D, b_enc=b_E, b_dec=b_D,
                         threshold=threshold)
    return layer, norm if meta["act_fn"] == "topk" else None


def load(source: str | Path, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", model_name: str | None = None,
         scan: str | None = None, shard: tuple[int, int] | None = None,
         **_ignored) -> Transcoder:
    """The per-layer set in ``source`` (module docstring), every layer's config checked
    alike; ``model_name`` defaults to their ``lm_config.json``'s."""
    root = Path(source).expanduser()
    folders = _folders(root)
    if not folders:
        raise TranscoderFormatError(f"{root}: no llamascopium transcoder here (config.json with "
                                    f"sae_type 'sae' and {WEIGHTS})")
    by_layer, metas = {}, {}
    for folder, meta in folders:
        meta = _check(meta, folder / CONFIG)
        layer = _layer(meta, folder / CONFIG)
        if layer in by_layer:
            raise TranscoderFormatError(f"{folder / CONFIG}: layer {layer} again (also "
                                        f"{by_layer[layer]})")
        by_layer[layer], metas[layer] = folder, meta
    named_layers({layer: str(folder) for layer, folder in by_layer.items()})
    order = in_layer_order(by_layer, f"{root}: no transcoder directory")
    first = metas[0]
    for layer in range(1, len(order)):
        for key in ("act_fn", "top_k", "sparsity_include_decoder_norm"):
            if metas[layer][key] != first[key]:
                raise TranscoderFormatError(f"{order[layer] / CONFIG}: {key} "
                                            f"{metas[layer][key]!r}, layer 0's {first[key]!r}")
        for key in ("hook_point_in", "hook_point_out"):
            if metas[layer][key].split(".", 2)[2] != first[key].split(".", 2)[2]:
                raise TranscoderFormatError(f"{order[layer] / CONFIG}: {key} "
                                            f"{metas[layer][key]!r}; layer 0 reads "
                                            f"{first[key]!r}")
    slicer = LayerSlicer(shard)
    layers, weights = [], []
    for layer, folder in enumerate(order):
        tensors, weight = read_layer(folder, metas[layer])
        layers.append(slicer(tensors))
        if weight is not None:
            weights.append(layers[-1].W_dec.norm(dim=1))  # the slice's own rows
    if model_name is None:
        lm = order[0] / "lm_config.json"
        model_name = str(read_json_object(lm).get("model_name") or "") if lm.is_file() else ""
    return assemble_set(
        layers, model_name=model_name, activation=ACTIVATIONS[first["act_fn"]],
        k=first["top_k"] if first["act_fn"] == "topk" else None,
        feature_input_hook=first["hook_point_in"].split(".", 2)[2],
        feature_output_hook=first["hook_point_out"].split(".", 2)[2], scan=scan,
        source=str(root), dtype=dtype, device=device, lazy_decoder=False,
        score_weight=torch.stack(weights) if weights else None, **slicer.options)
