"""Lorsa fixtures written as llamascopium 2.0.0b34 writes them, and its forward, transcribed.

``write_peer_lorsa`` mirrors ``SparseDictionary.save_checkpoint`` + ``save_hyperparameters``
(models/sparse_dictionary.py:179-184, 251-282): ``config.json`` is the config's ``model_dump``
(every field, ours unread among them) and ``sae_weights.safetensors`` the full state dict, its
buffers (``mask``, ``IGNORE``, ``rotary_sin``, ``rotary_cos``) and
``dataset_average_activation_norm.<hook>`` scalars included. ``peer_forward`` is their
``normalize_activations`` -> ``encode`` (the SDPA path, models/lorsa.py:703-762) -> ``decode``
-> denormalise, written from their code, not from ours.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


def peer_config(layer: int = 0, d_model: int = 32, n_qk: int = 4, d_qk: int = 8,
                expansion: float = 2.0, **changes) -> dict:
    cfg = {"sae_type": "lorsa", "d_model": d_model, "expansion_factor": expansion,
           "use_decoder_bias": True, "act_fn": "topk", "norm_activation": "dataset-wise",
           "sparsity_include_decoder_norm": True, "top_k": 5, "use_triton_kernel": False,
           "sparsity_threshold_for_triton_spmm_kernel": 0.996, "jumprelu_threshold_window": 2.0,
           "hook_point_in": f"blocks.{layer}.ln1.hook_normalized",
           "hook_point_out": f"blocks.{layer}.hook_attn_out", "n_qk_heads": n_qk,
           "d_qk_head": d_qk, "positional_embedding_type": "rotary", "rotary_dim": d_qk,
           "rotary_base": 10000, "rotary_adjacent_pairs": True, "rotary_scale": 1,
           "use_NTK_by_parts_rope": False, "NTK_by_parts_factor": 1.0,
           "NTK_by_parts_low_freq_factor": 1.0, "NTK_by_parts_high_freq_factor": 1.0,
           "old_context_len": 2048, "n_ctx": 64, "attn_scale": None, "use_post_qk_ln": False,
           "normalization_type": None, "eps": 1e-6}
    cfg.update(changes)
    return cfg


def peer_tensors(cfg: dict, seed: int = 0, qk_heads: int | None = None) -> dict:
    """Random weights of ``cfg``'s shapes (``qk_heads``: fewer QK heads stored, as a
    checkpoint may hold)."""
    g = torch.Generator().manual_seed(seed)
    d, dq = cfg["d_model"], cfg["d_qk_head"]
    qk, ov = qk_heads or cfg["n_qk_heads"], int(d * cfg["expansion_factor"])
    out = {"W_Q": torch.randn(qk, d, dq, generator=g) / d ** 0.5,
           "W_K": torch.randn(qk, d, dq, generator=g) / d ** 0.5,
           "W_V": torch.randn(ov, d, generator=g) / d ** 0.5,
           "W_O": torch.randn(ov, d, generator=g) / d ** 0.5,
           "b_Q": torch.randn(qk, dq, generator=g) * 0.1,
           "b_K": torch.randn(qk, dq, generator=g) * 0.1,
           "b_V": torch.randn(ov, generator=g) * 0.1, "b_D": torch.randn(d, generator=g) * 0.1}
    if cfg["use_post_qk_ln"]:
        out["ln_q.w"] = 1 + 0.3 * torch.randn(qk, dq, generator=g)
        out["ln_k.w"] = 1 + 0.3 * torch.randn(qk, dq, generator=g)
    return out


def _sin_cos(cfg: dict, dtype=torch.float32):
    pos = torch.arange(cfg["n_ctx"], dtype=torch.float32)
    dim = torch.arange(cfg["rotary_dim"] // 2, dtype=torch.float32)
    freq = cfg["rotary_base"] ** (dim / (cfg["rotary_dim"] / 2))
    freq = freq.repeat_interleave(2) if cfg["rotary_adjacent_pairs"] else torch.cat([freq, freq])
    angles = pos[:, None] / freq[None, :]
    return torch.sin(angles).to(dtype), torch.cos(angles).to(dtype)


def write_peer_lorsa(folder: Path, cfg: dict, tensors: dict,
                     norms: tuple[float, float] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=4))
    sin, cos = _sin_cos(cfg)
    state = {k: v.contiguous() for k, v in tensors.items()}
    state.update({"mask": torch.ones(cfg["n_ctx"], cfg["n_ctx"]).tril().bool(),
                  "IGNORE": torch.tensor(-torch.inf), "rotary_sin": sin, "rotary_cos": cos})
    norm_in, norm_out = norms or (float("nan"), float("nan"))  # torch.empty: garbage, unread
    state[f"dataset_average_activation_norm.{cfg['hook_point_in']}"] = torch.tensor(norm_in)
    state[f"dataset_average_activation_norm.{cfg['hook_point_out']}"] = torch.tensor(norm_out)
    save_file(state, str(folder / "sae_weights.safetensors"), {"version": "2.0.0b34"})
    return folder


def _rotary(x, cfg, sin, cos):  # models/lorsa.py:864-904
    p = x.size(1)
    r = cfg["rotary_dim"]
    x_rot, x_pass = x[..., :r], x[..., r:]
    flip = x_rot.clone()
    if cfg["rotary_adjacent_pairs"]:
        flip[..., ::2] = -x_rot[..., 1::2]
        flip[..., 1::2] = x_rot[..., ::2]
    else:
        n = r // 2
        flip[..., :n] = -x_rot[..., n:]
        flip[..., n:] = x_rot[..., :n]
    rotated = x_rot * cos[None, :p, None, :] + flip * sin[None, :p, None, :]
    return torch.cat([rotated, x_pass], dim=-1)


def _rms(x, w, eps):  # RMSNormPerHead, models/lorsa.py:1046-1052
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w


def peer_forward(cfg: dict, tensors: dict, x: torch.Tensor,
                 norms: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(feature_acts, reconstruction)`` of ``x [B, P, D]``, as llamascopium computes them
    (acts in its normalised units when ``norms`` are given)."""
    t = dict(tensors)
    n_qk = cfg["n_qk_heads"]
    for k in ("W_Q", "W_K", "b_Q", "b_K", "ln_q.w", "ln_k.w"):  # load_full_state_dict
        if k in t and t[k].size(0) != n_qk:
            t[k] = torch.repeat_interleave(t[k], n_qk // t[k].size(0), dim=0)
    d = cfg["d_model"]
    f_in = f_out = 1.0
    if norms is not None:  # compute_norm_factor, dataset-wise
        f_in, f_out = math.sqrt(d) / norms[0], math.sqrt(d) / norms[1]
    x = x * f_in
    q = torch.einsum("bsd,Qdq->bsQq", x, t["W_Q"]) + t["b_Q"]
    k = torch.einsum("bsd,Kdk->bsKk", x, t["W_K"]) + t["b_K"]
    v = torch.einsum("bsd,Vd->bsV", x, t["W_V"]) + t["b_V"]
    if cfg["use_post_qk_ln"]:
        q, k = _rms(q, t["ln_q.w"], cfg["eps"]), _rms(k, t["ln_k.w"], cfg["eps"])
    if cfg["positional_embedding_type"] == "rotary":
        sin, cos = _sin_cos(cfg)
        q, k = _rotary(q, cfg, sin, cos), _rotary(k, cfg, sin, cos)
    scale = cfg["attn_scale"] or cfg["d_qk_head"] ** 0.5
    value = v.reshape(*k.shape[:3], -1).permute(0, 2, 1, 3)
    z = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), value,
                                       scale=1 / scale, is_causal=True)
    hidden_pre = z.permute(0, 2, 1, 3).reshape(*v.shape)
    norm = t["W_O"].norm(p=2, dim=1)
    if cfg["sparsity_include_decoder_norm"]:
        hidden_pre = hidden_pre * norm
    acts = hidden_pre * hidden_pre.gt(0)
    if cfg["act_fn"] == "topk":
        idx = acts.topk(cfg["top_k"], dim=-1).indices
        acts = acts * torch.zeros_like(acts, dtype=torch.bool).scatter_(-1, idx, True)
    if cfg["sparsity_include_decoder_norm"]:
        acts = acts / norm
    out = torch.einsum("bps,sd->bpd", acts, t["W_O"]) + t["b_D"]
    return acts, out / f_out
