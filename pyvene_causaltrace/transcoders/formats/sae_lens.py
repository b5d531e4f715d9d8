"""sae-lens transcoders in, and sae-lens views of our transcoders out (the only module that imports
sae_lens, and only when called).

**In** (:func:`load`, :func:`load_release`): one sae-lens transcoder per layer, read by sae-lens
itself, assembled into a per-layer set (negative JumpReLU thresholds raised to 0, exactly).

**Out** (:func:`to_sae_lens`): layer ``l``'s view of a CLT has the exact encoder and the slice
``W_dec[l][:, target - l]`` plus ``b_dec[target]``; the views over ``l <= t`` summed (``b_dec[t]``
once) are the CLT's reconstruction of layer ``t`` (nothing summed over targets, thresholds kept,
unlike sae-lens's mntss loader). Through the converters:

    JumpReLUTranscoder.load_from_disk(clt_dir, converter=disk_converter(layer=3))
    JumpReLUTranscoder.from_pretrained("org/clt-repo", "layer_3", converter=hub_converter)"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError
from ...finite import check_weight
from ..transcoder import Transcoder
from .common import (
    LayerSlicer,
    LayerTensors,
    TranscoderFormatError,
    assemble_set,
    check_stored_dtypes,
    existing,
    in_layer_order,
    named_layers,
    open_safetensors,
    refuse_shard,
)
from .mntss import from_pretrained, load_from_disk


def _cfg_and_state(transcoder: Transcoder, layer: int, target: int | None,
                   device: str, dtype: str = "float32") -> tuple[dict, dict]:
    refuse_shard(transcoder)
    target = layer if target is None else target
    if not 0 <= layer <= target < layer + transcoder.cfg.n_targets(layer) <= transcoder.n_layers:
        raise InputError(f"layer {layer}'s features do not write layer {target}")
    if transcoder.cfg.activation not in ("jumprelu", "relu"):
        raise InputError(f"sae-lens has no {transcoder.cfg.activation} transcoder")
    torch_dtype = getattr(torch, dtype)
    features = torch.arange(transcoder.cfg.d_transcoder)
    rows = transcoder.decoder_rows(layer, features)[:, target - layer]
    state = {
        "W_enc": transcoder.encoder_weight(layer).T.contiguous(),
        "b_enc": transcoder.b_enc[layer],
        "threshold": transcoder.threshold[layer],
        "W_dec": rows.contiguous(),
        "b_dec": transcoder.b_dec[target],
    }
    skip = transcoder.W_skip is not None and target == layer  # a skip reads its own layer's input
    if skip:
        state["W_skip"] = transcoder.W_skip[layer]
    state = {k: v.detach().to(device, torch_dtype).clone() for k, v in state.items()}
    cfg = {
        "architecture": "jumprelu_skip_transcoder" if skip else "jumprelu_transcoder",
        "d_in": transcoder.cfg.d_model, "d_sae": transcoder.cfg.d_transcoder,
        "d_out": transcoder.cfg.d_model,
        "dtype": dtype, "device": device, "apply_b_dec_to_input": False,
        "normalize_activations": "none",
        "metadata": {
            "model_name": transcoder.cfg.model_name,
            "hook_name": f"blocks.{layer}.{transcoder.cfg.feature_input_hook}",
            "hook_name_out": f"blocks.{target}.{transcoder.cfg.feature_output_hook}",
            "neuronpedia_id": None,
            "sae_lens_version": version("sae-lens"),  # a 6.x config: no pre-6.0 rewriting
        },
    }
    return cfg, state


def to_sae_lens(transcoder: Transcoder, layer: int, target: int | None = None,
                device: str = "cpu"):
    """A sae-lens ``JumpReLUTranscoder`` (``JumpReLUSkipTranscoder`` with a skip path) for
    ``layer`` (see module docstring)."""
    # sae_lens takes seconds to import: only when called
    from sae_lens.saes.transcoder import (
        JumpReLUSkipTranscoder,
        JumpReLUSkipTranscoderConfig,
        JumpReLUTranscoder,
        JumpReLUTranscoderConfig,
    )

    cfg, state = _cfg_and_state(transcoder, layer, target, device)
    if "W_skip" in state:
        sae = JumpReLUSkipTranscoder(JumpReLUSkipTranscoderConfig.from_dict(cfg))
    else:
        sae = JumpReLUTranscoder(JumpReLUTranscoderConfig.from_dict(cfg))
    sae.load_state_dict(state)
    return sae


def disk_converter(layer: int, target: int | None = None):
    """A sae-lens disk converter for ``SAE.load_from_disk(clt_dir, converter=...)``."""

    def convert(path: str | Path, device: str = "cpu",
                cfg_overrides: dict[str, Any] | None = None) -> tuple[dict, dict]:
        dtype = (cfg_overrides or {}).get("dtype") or "float32"
        return _cfg_and_state(load_from_disk(path), layer, target, device, dtype)

    return convert


def hub_converter(repo_id: str, folder_name: str, device: str = "cpu",
                  force_download: bool = False, cfg_overrides: dict[str, Any] | None = None):
    """A sae-lens hub converter: ``folder_name`` is ``"layer_<l>"`` or
    ``"layer_<l>_to_<t>"``. Returns ``(cfg, state_dict, None)``."""
    parts = folder_name.removeprefix("layer_").split("_to_")
    layer = int(parts[0])
    target = int(parts[1]) if len(parts) > 1 else None
    dtype = (cfg_overrides or {}).get("dtype") or "float32"
    cfg, state = _cfg_and_state(from_pretrained(repo_id), layer, target, device, dtype)
    return cfg, state, None


# ------------------------------------------------------------------------------------- in
TRANSCODER_ARCHITECTURES = ("transcoder", "skip_transcoder", "jumprelu_transcoder",
                            "jumprelu_skip_transcoder")


def is_layout(path: Path) -> bool:
    """A directory of sae-lens transcoder directories (``cfg.json`` + ``sae_weights.safetensors``
    each)."""
    return path.is_dir() and any((sub / "cfg.json").exists()
                                 and (sub / "sae_weights.safetensors").exists()
                                 for sub in path.iterdir() if sub.is_dir())


def _layer_of(hook: str | None, origin: str) -> int:
    parts = (hook or "").split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdecimal():
        raise TranscoderFormatError(f"{origin}: hook_name {hook!r} does not name a layer "
                                    "(blocks.<l>.<hook>)")
    layer = int(parts[1])
    named_layers({layer: f"{origin} (hook_name {hook!r})"})
    return layer


def _read(sae, origin: str, slicer: LayerSlicer, weights: str | None = None
          ) -> tuple[int, LayerTensors, dict]:
    """(layer, tensors in our orientation, hooks) of one sae-lens transcoder, cut to a rank's
    slice at once by ``slicer`` (the SAE object and its whole tensors are dropped before the
    next is read); its tensors are checked (NaN/inf, dtype) naming ``weights``, the file they
    came from (else ``origin``)."""
    architecture = sae.cfg.architecture()
    if architecture not in TRANSCODER_ARCHITECTURES:
        raise TranscoderFormatError(f"{origin}: architecture {architecture!r} is not a "
                                    f"transcoder ({', '.join(TRANSCODER_ARCHITECTURES)})")
    for setting, plain in (("normalize_activations", "none"), ("reshape_activations", "none")):
        value = getattr(sae.cfg, setting, plain)
        if value != plain:  # sae-lens rescales (or reshapes) the input first: we would not
            raise TranscoderFormatError(f"{origin}: {setting} {value!r} (sae-lens transforms "
                                        f"the input before encoding); only {plain!r} is read")
    meta = sae.cfg.metadata
    hooks = {"input": meta.hook_name, "output": getattr(meta, "hook_name_out", None)}
    if hooks["output"] is None:
        raise TranscoderFormatError(f"{origin}: the config has no metadata.hook_name_out")
    layer = _layer_of(hooks["input"], origin)
    if _layer_of(hooks["output"], origin) != layer:
        raise TranscoderFormatError(f"{origin}: reads layer {layer} but writes "
                                    f"{hooks['output']!r}")
    state = {k: check_weight(v.detach().cpu(), weights or origin, k)
             for k, v in sae.state_dict().items()}
    threshold = state.get("threshold")
    if threshold is not None:
        threshold = threshold.clamp(min=0)  # relu(z) * 1[z > t] == z * 1[z > max(t, 0)]
    tensors = LayerTensors(origin, W_enc=state["W_enc"].T.contiguous(), W_dec=state["W_dec"],
                           b_enc=state["b_enc"], b_dec=state["b_dec"], threshold=threshold,
                           W_skip=state.get("W_skip"))
    activation = "jumprelu" if threshold is not None else "relu"
    return layer, slicer(tensors), {**hooks, "activation": activation,
                                    "model_name": getattr(meta, "model_name", None) or ""}


def _assemble(entries: list[tuple[int, LayerTensors, dict]], *, scan: str | None, source: str,
              dtype: torch.dtype, device: str | torch.device,
              slicer: LayerSlicer | None = None) -> Transcoder:
    """A set from each transcoder's ``(layer, tensors, info)`` (:func:`_read`, cut by
    ``slicer`` as each was read)."""
    layers = {}
    for layer, tensors, info in entries:
        origin = tensors.origin
        if layer in layers:
            raise TranscoderFormatError(f"{origin}: a second transcoder for layer {layer} "
                                        f"(first: {layers[layer][0].origin})")
        layers[layer] = (tensors, info)
    ordered = in_layer_order(layers, f"{source}: no transcoder")
    infos = [info for _, info in ordered]
    activations = sorted({info["activation"] for info in infos})
    if len(activations) > 1:
        raise TranscoderFormatError(f"{source}: layers mix activations {activations}")
    hooks = {role: {info[role].split(".", 2)[2] for info in infos} for role in ("input", "output")}
    if any(len(names) > 1 for names in hooks.values()):
        raise TranscoderFormatError(f"{source}: layers read or write different hooks {hooks}")
    return assemble_set([tensors for tensors, _ in ordered],
                        model_name=infos[0]["model_name"], activation=infos[0]["activation"],
                        feature_input_hook=hooks["input"].pop(),
                        feature_output_hook=hooks["output"].pop(), scan=scan, source=source,
                        dtype=dtype, device=device, lazy_decoder=False,
                        **(slicer.options if slicer is not None else {}))


def load(source: str | Path | list, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", scan: str | None = None,
         sae_ids: list[str] | None = None, shard: tuple[int, int] | None = None,
         **_ignored) -> Transcoder:
    """A per-layer set from sae-lens transcoder directories: ``source`` is a directory holding one
    per layer (the layer comes from each ``hook_name``) or a list of them, each read by
    ``SAE.load_from_disk``; or a sae-lens release's name (:func:`load_release`, with ``sae_ids``).
    ``shard=(rank, world)``: each is cut to the rank's slice before the next is read."""
    from sae_lens import SAE  # takes seconds to import: only when called

    if isinstance(source, str) and not Path(source).expanduser().exists():
        return load_release(source, sae_ids, dtype=dtype, device=device, shard=shard)
    if isinstance(source, list | tuple):
        dirs = [Path(p).expanduser() for p in source]
    else:
        root = Path(source).expanduser()
        dirs = sorted(sub for sub in root.iterdir() if (sub / "cfg.json").exists())
    if not dirs:
        raise TranscoderFormatError(f"{source}: no sae-lens transcoder directories")
    entries, slicer = [], LayerSlicer(shard)
    for path in dirs:
        existing(path / "cfg.json")
        weights = existing(path / "sae_weights.safetensors")
        check_stored_dtypes(weights, open_safetensors(weights))  # sae-lens would cast it
        try:
            sae = SAE.load_from_disk(str(path), device="cpu")
        except (KeyError, ValueError, RuntimeError, OSError) as error:
            raise TranscoderFormatError(f"{path}: sae-lens could not load it: {error}") from None
        entries.append(_read(sae, str(path), slicer, str(weights)))
        del sae
    return _assemble(entries, scan=scan, source=str(source), dtype=dtype, device=device,
                     slicer=slicer)


def release_ids(release: str) -> list[str]:
    """The ids of a sae-lens release, from sae-lens's pretrained directory."""
    # sae_lens takes seconds to import: only when called
    from sae_lens.loading.pretrained_saes_directory import get_pretrained_saes_directory

    directory = get_pretrained_saes_directory()
    if release not in directory:
        raise TranscoderFormatError(f"{release!r} is not a sae-lens release")
    return list(directory[release].saes_map)


def load_release(release: str, sae_ids: list[str] | None = None, *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 shard: tuple[int, int] | None = None) -> Transcoder:
    """A per-layer set from a sae-lens release, one ``SAE.from_pretrained(release, id)`` per
    layer (the hub cache serves it offline). ``sae_ids`` default: every id of the release, which
    must then hold one transcoder per layer (GemmaScope's holds several L0s per layer: choose)."""
    from sae_lens import SAE  # takes seconds to import: only when called

    ids = release_ids(release) if sae_ids is None else list(sae_ids)
    entries, slicer = [], LayerSlicer(shard)
    for sae_id in ids:
        try:
            sae = SAE.from_pretrained(release, sae_id, device="cpu")
        except (KeyError, ValueError, OSError) as error:
            raise TranscoderFormatError(f"{release}/{sae_id}: sae-lens could not load it: "
                                        f"{error}") from None
        entries.append(_read(sae, f"{release}/{sae_id}", slicer))
        del sae
    try:
        return _assemble(entries, scan=release, source=release, dtype=dtype, device=device,
                         slicer=slicer)
    except TranscoderFormatError as error:
        if sae_ids is None and "second transcoder" in str(error):
            raise TranscoderFormatError(f"{release} holds several transcoders per layer; pass "
                                        "sae_ids=[one per layer] (see release_ids)") from None
        raise
