"""Fixture per-layer transcoder sets written in each real on-disk layout with plain library calls
(safetensors, numpy, yaml, json — and sae-lens's own ``save_model`` for its layout), never
through the package's writers, and a dense float64 reference of the maths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import save_file


def random_set(n_layers=3, d_model=32, d_transcoder=48, *, seed=0, skip=False,
               activation="jumprelu", k=None, threshold=0.1) -> dict:
    """Per-layer tensors in the reference orientation: ``W_enc [F, D]``, ``W_dec [F, D]``,
    ``W_skip [D, D]`` (``skip(x) = x @ W_skip.T``)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        layer = {
            "W_enc": torch.randn(d_transcoder, d_model, generator=g) / d_model**0.5,
            "W_dec": torch.randn(d_transcoder, d_model, generator=g) * 0.1,
            "b_enc": torch.randn(d_transcoder, generator=g) * 0.1,
            "b_dec": torch.randn(d_model, generator=g) * 0.05,
        }
        if activation == "jumprelu":
            layer["threshold"] = threshold + torch.rand(d_transcoder, generator=g) * 0.2
        if skip:
            layer["W_skip"] = torch.randn(d_model, d_model, generator=g) * 0.05
        layers.append(layer)
    return {"layers": layers, "activation": activation, "k": k}


def rounded(tensors: dict, dtype: torch.dtype) -> dict:
    """The set as it is after a round trip through ``dtype`` on disk."""
    return {**tensors, "layers": [{k: v.to(dtype).to(torch.float32) for k, v in layer.items()}
                                  for layer in tensors["layers"]]}


def dense_reference(tensors: dict, inputs: torch.Tensor, *, fold_b_dec: bool = False):
    """Features ``[L, P, F]`` (BOS zeroed) and reconstruction ``[L, P, D]`` in float64.
    ``fold_b_dec``: the encoder reads ``x - b_dec`` (legacy sparsify)."""
    acts, recon = [], []
    for layer, t in enumerate(tensors["layers"]):
        d = {k: v.double() for k, v in t.items()}
        x = inputs[layer].double()
        z = (x - d["b_dec"] if fold_b_dec else x) @ d["W_enc"].T + d["b_enc"]
        kind = tensors["activation"]
        if kind == "jumprelu":
            a = torch.where(z > d["threshold"], z, torch.zeros((), dtype=z.dtype))
        elif kind == "relu":
            a = z.clamp(min=0)
        else:
            source = z.clamp(min=0) if kind == "relu_topk" else z
            top = source.topk(tensors["k"], dim=-1)
            a = torch.zeros_like(z).scatter(-1, top.indices, top.values)
        a[0] = 0
        out = a @ d["W_dec"] + d["b_dec"]
        if "W_skip" in d:
            out = out + x @ d["W_skip"].T
        acts.append(a)
        recon.append(out)
    return torch.stack(acts), torch.stack(recon)


def _save(tensors: dict, path: Path, dtype: torch.dtype) -> None:
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path))


def write_circuit_tracer(root: Path, tensors: dict, *, dtype=torch.float32,
                         input_hook="hook_resid_mid", output_hook="hook_mlp_out",
                         files: list[str] | None = None, model_name="tiny", scan=None,
                         transposed_decoder=False, k_in_files=False) -> Path:
    """circuit-tracer's transcoder_set: config.yaml + ``layer_{l}.safetensors`` (native keys:
    ``W_enc [F, D]``, ``W_dec [F, D]`` — ``[D, F]`` with ``transposed_decoder`` —,
    ``activation_function.threshold``, ``W_skip``, ``k``)."""
    root.mkdir(parents=True, exist_ok=True)
    for layer, t in enumerate(tensors["layers"]):
        out = {"W_enc": t["W_enc"], "W_dec": t["W_dec"].T if transposed_decoder else t["W_dec"],
               "b_enc": t["b_enc"], "b_dec": t["b_dec"]}
        if "threshold" in t:
            out["activation_function.threshold"] = t["threshold"]
        if "W_skip" in t:
            out["W_skip"] = t["W_skip"]
        out = {k: v.to(dtype).contiguous() for k, v in out.items()}
        if k_in_files:
            out["k"] = torch.tensor(tensors["k"])
        save_file(out, str(root / f"layer_{layer}.safetensors"))
    meta = {"model_name": model_name, "model_kind": "transcoder_set",
            "feature_input_hook": input_hook, "feature_output_hook": output_hook}
    if tensors["activation"] in ("relu", "topk"):
        meta["activation"] = tensors["activation"]
    if tensors["activation"] == "topk" and not k_in_files:
        meta["k"] = tensors["k"]
    if scan is not None:
        meta["scan"] = scan
    if files is not None:
        meta["transcoders"] = files
    (root / "config.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return root / "config.yaml"


def write_gemmascope(root: Path, tensors: dict, l0s=(41,)) -> Path:
    """GemmaScope: ``layer_{l}/width_16k/average_l0_{N}/params.npz`` with ``W_enc [D, F]``."""
    for layer, t in enumerate(tensors["layers"]):
        for l0 in l0s:
            where = root / f"layer_{layer}" / "width_16k" / f"average_l0_{l0}"
            where.mkdir(parents=True, exist_ok=True)
            np.savez(where / "params.npz", W_enc=t["W_enc"].T.numpy(), W_dec=t["W_dec"].numpy(),
                     b_enc=t["b_enc"].numpy(), b_dec=t["b_dec"].numpy(),
                     threshold=t["threshold"].numpy())
    return root


def write_sae_lens(root: Path, tensors: dict, *, dtype="float32",
                   input_hook="hook_resid_mid", output_hook="hook_mlp_out") -> Path:
    """One sae-lens transcoder directory per layer, written by sae-lens's ``save_model``."""
    from sae_lens.saes.transcoder import (
        JumpReLUSkipTranscoder,
        JumpReLUSkipTranscoderConfig,
        JumpReLUTranscoder,
        JumpReLUTranscoderConfig,
        SkipTranscoder,
        SkipTranscoderConfig,
        Transcoder,
        TranscoderConfig,
    )

    classes = {(True, False): (JumpReLUTranscoder, JumpReLUTranscoderConfig),
               (True, True): (JumpReLUSkipTranscoder, JumpReLUSkipTranscoderConfig),
               (False, False): (Transcoder, TranscoderConfig),
               (False, True): (SkipTranscoder, SkipTranscoderConfig)}
    for layer, t in enumerate(tensors["layers"]):
        jump, skip = "threshold" in t, "W_skip" in t
        cls, cfg_cls = classes[(jump, skip)]
        d_sae, d_model = t["W_enc"].shape
        cfg = cfg_cls.from_dict({
            "d_in": d_model, "d_sae": d_sae, "d_out": d_model, "dtype": dtype, "device": "cpu",
            "apply_b_dec_to_input": False, "normalize_activations": "none",
            "metadata": {"model_name": "tiny", "hook_name": f"blocks.{layer}.{input_hook}",
                         "hook_name_out": f"blocks.{layer}.{output_hook}"}})
        sae = cls(cfg)
        state = {"W_enc": t["W_enc"].T, "W_dec": t["W_dec"], "b_enc": t["b_enc"],
                 "b_dec": t["b_dec"]}
        if jump:
            state["threshold"] = t["threshold"]
        if skip:
            state["W_skip"] = t["W_skip"]
        sae.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in state.items()})
        sae.save_model(str(root / f"transcoder_layer_{layer}"))
    return root


def write_sparsify(root: Path, tensors: dict, *, dtype=torch.float32, legacy=False,
                   prefix="layers") -> Path:
    """sparsify: ``{prefix}.{l}.mlp/cfg.json`` + ``sae.safetensors`` (``encoder.weight``,
    ``encoder.bias``, ``W_dec [F, D]``, ``b_dec``, ``W_skip``); ``legacy`` omits ``transcode``
    (files from before it was stored: the encoder then read ``x - b_dec``)."""
    for layer, t in enumerate(tensors["layers"]):
        where = root / f"{prefix}.{layer}.mlp"
        where.mkdir(parents=True, exist_ok=True)
        d_sae, d_model = t["W_enc"].shape
        cfg = {"activation": "topk", "expansion_factor": d_sae // d_model,
               "normalize_decoder": True, "num_latents": d_sae, "k": tensors["k"],
               "multi_topk": False, "skip_connection": "W_skip" in t, "d_in": d_model}
        if not legacy:
            cfg["transcode"] = True
        (where / "cfg.json").write_text(json.dumps(cfg))
        out = {"encoder.weight": t["W_enc"], "encoder.bias": t["b_enc"], "W_dec": t["W_dec"],
               "b_dec": t["b_dec"]}
        if "W_skip" in t:
            out["W_skip"] = t["W_skip"]
        _save(out, where / "sae.safetensors", dtype)
    (root / "config.json").write_text(json.dumps({"model": "tiny"}))
    return root


# ------------------------------------------------------------------------ ByteDance files
def bytedance_tensors(n_layers=3, d_model=32, width=48, k=4, seed=0):
    """A ByteDance joint TopK CLT's tensors: ``k`` per layer, ``n_layers * k`` kept jointly."""
    g = torch.Generator().manual_seed(seed)
    W_enc = [torch.randn(width, d_model, generator=g) / d_model**0.5 for _ in range(n_layers)]
    # decoder scales differ by layer, so the joint ranking differs from a per-layer one
    W_dec = [torch.randn(width, n_layers - layer, d_model, generator=g) * 0.1 * (layer + 1)
             for layer in range(n_layers)]
    return {"W_enc": W_enc, "W_dec": W_dec, "k": k}


def write_bytedance(root: Path, t: dict) -> Path:
    """``t`` in ByteDance's layout (per-layer W_enc/W_dec files, decoder norms, config.json)."""
    root.mkdir(parents=True, exist_ok=True)
    n_layers = len(t["W_enc"])
    norms = torch.stack([w.flatten(1).norm(dim=1) for w in t["W_dec"]])
    for layer in range(n_layers):
        save_file({f"W_enc_{layer}": t["W_enc"][layer].contiguous()},
                  str(root / f"W_enc_{layer}.safetensors"))
        save_file({f"W_dec_{layer}": t["W_dec"][layer].contiguous(),
                   f"W_dec_norm_{layer}": norms[layer].contiguous()},
                  str(root / f"W_dec_{layer}.safetensors"))
    save_file({"W_dec_norm": norms.contiguous()}, str(root / "W_dec_norm.safetensors"))
    save_file({"resid_mid_l2": torch.ones(n_layers), "mlp_out_l2": torch.ones(n_layers)},
              str(root / "factors.safetensors"))
    (root / "config.json").write_text(json.dumps({
        "base_model": "Qwen/Qwen3-8B-Base", "n_layers": n_layers,
        "d_model": t["W_enc"][0].shape[1], "d_feature": t["W_enc"][0].shape[0],
        "k": t["k"]}))
    return root
