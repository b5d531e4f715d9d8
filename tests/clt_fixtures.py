"""Fixture CLTs written in the real on-disk layout with plain safetensors calls (not through
the package's writer), and a dense float64 reference of the CLT maths."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file


def random_clt_tensors(n_layers=3, d_model=32, d_transcoder=48, seed=0, threshold=0.3):
    g = torch.Generator().manual_seed(seed)
    return {
        "W_enc": torch.randn(n_layers, d_transcoder, d_model, generator=g) / d_model**0.5,
        "b_enc": torch.randn(n_layers, d_transcoder, generator=g) * 0.1,
        "threshold": torch.full((n_layers, d_transcoder), threshold)
        + torch.rand(n_layers, d_transcoder, generator=g) * 0.2,
        "b_dec": torch.randn(n_layers, d_model, generator=g) * 0.05,
        "W_dec": [torch.randn(d_transcoder, n_layers - layer, d_model, generator=g) * 0.1
                  for layer in range(n_layers)],
    }


def write_clt(path: Path, tensors: dict, model_name="tiny", dtype=torch.float32) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    n_layers = tensors["W_enc"].shape[0]
    for layer in range(n_layers):
        save_file({f"W_enc_{layer}": tensors["W_enc"][layer].to(dtype).contiguous(),
                   f"b_enc_{layer}": tensors["b_enc"][layer].to(dtype).contiguous(),
                   f"b_dec_{layer}": tensors["b_dec"][layer].to(dtype).contiguous(),
                   f"threshold_{layer}": tensors["threshold"][layer].to(dtype).contiguous()},
                  str(path / f"W_enc_{layer}.safetensors"))
        save_file({f"W_dec_{layer}": tensors["W_dec"][layer].to(dtype).contiguous()},
                  str(path / f"W_dec_{layer}.safetensors"))
    (path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": model_name, "model_kind": "cross_layer_transcoder",
        "feature_input_hook": "hook_resid_mid", "feature_output_hook": "hook_mlp_out"},
        sort_keys=False))
    return path


def dense_reference(tensors: dict, resid_mid: torch.Tensor, dtype=torch.float64):
    """Features [L, P, F] (BOS zeroed) and reconstruction [L, P, D], all dense."""
    n_layers = tensors["W_enc"].shape[0]
    acts = []
    for layer in range(n_layers):
        z = resid_mid[layer].to(dtype) @ tensors["W_enc"][layer].to(dtype).T \
            + tensors["b_enc"][layer].to(dtype)
        acts.append(torch.where(z > tensors["threshold"][layer].to(dtype), z,
                                torch.zeros((), dtype=dtype)))
    acts = torch.stack(acts)
    acts[:, 0] = 0
    recon = []
    for target in range(n_layers):
        out = tensors["b_dec"][target].to(dtype).expand(resid_mid.shape[1], -1).clone()
        for source in range(target + 1):
            out += acts[source] @ tensors["W_dec"][source][:, target - source].to(dtype)
        recon.append(out)
    return acts, torch.stack(recon)
