"""sae-lens views of our CLTs (the only module that imports sae_lens, and only when called).

A CLT is not one sae-lens object: feature ``f`` of layer ``l`` writes into every layer
``t >= l``. :func:`to_sae_lens` gives a per-layer ``JumpReLUTranscoder`` whose *encoder is
exact* (same W_enc, b_enc, threshold for ``hook_resid_mid`` of layer ``l``) and whose *decoder is
one slice of the cross-layer decoder*: ``W_dec[l][:, target - l]``, i.e. what layer ``l``'s
features write into layer ``target``'s ``hook_mlp_out`` (``target = l`` by default), plus
``b_dec[target]``. Summing these views over source layers ``l <= t`` (with ``b_dec[t]`` once) is
the CLT's reconstruction of layer ``t``; one view alone is not. sae-lens's JumpReLU computes
``relu(z) * 1[z > threshold]``, the same as ours whenever thresholds are >= 0 (they are in every
published CLT).

sae-lens's own loading entry points read our directories through the converters:

    JumpReLUTranscoder.load_from_disk(clt_dir, converter=disk_converter(layer=3))
    JumpReLUTranscoder.from_pretrained("org/clt-repo", "layer_3", converter=hub_converter)

Unlike sae-lens's built-in mntss loader, nothing is summed over target layers and thresholds are
kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .loaders import from_pretrained, load_from_disk
from .transcoder import CrossLayerTranscoder


def _sae_lens_version() -> str:
    from importlib.metadata import version

    return version("sae-lens")


def _cfg_and_state(clt: CrossLayerTranscoder, layer: int, target: int | None,
                   device: str, dtype: str = "float32") -> tuple[dict, dict]:
    target = layer if target is None else target
    if not 0 <= layer <= target < clt.n_layers:
        raise ValueError(f"need 0 <= layer <= target < {clt.n_layers}, got {layer}, {target}")
    torch_dtype = getattr(torch, dtype)
    rows = clt.decoder_rows(layer, torch.arange(clt.cfg.d_transcoder))[:, target - layer]
    state = {
        "W_enc": clt.encoder_weight(layer).T.contiguous(),
        "b_enc": clt.b_enc[layer],
        "threshold": clt.threshold[layer],
        "W_dec": rows.contiguous(),
        "b_dec": clt.b_dec[target],
    }
    state = {k: v.detach().to(device, torch_dtype).clone() for k, v in state.items()}
    cfg = {
        "architecture": "jumprelu_transcoder",
        "d_in": clt.cfg.d_model, "d_sae": clt.cfg.d_transcoder, "d_out": clt.cfg.d_model,
        "dtype": dtype, "device": device, "apply_b_dec_to_input": False,
        "normalize_activations": "none",
        "metadata": {
            "model_name": clt.cfg.model_name,
            "hook_name": f"blocks.{layer}.{clt.cfg.feature_input_hook}",
            "hook_name_out": f"blocks.{target}.{clt.cfg.feature_output_hook}",
            "neuronpedia_id": None,
            "sae_lens_version": _sae_lens_version(),  # a 6.x config: no pre-6.0 rewriting
        },
    }
    return cfg, state


def to_sae_lens(clt: CrossLayerTranscoder, layer: int, target: int | None = None,
                device: str = "cpu"):
    """A sae-lens ``JumpReLUTranscoder`` for ``layer`` (see module docstring)."""
    from sae_lens.saes.transcoder import JumpReLUTranscoder, JumpReLUTranscoderConfig

    cfg, state = _cfg_and_state(clt, layer, target, device)
    transcoder = JumpReLUTranscoder(JumpReLUTranscoderConfig.from_dict(cfg))
    transcoder.load_state_dict(state)
    return transcoder


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
