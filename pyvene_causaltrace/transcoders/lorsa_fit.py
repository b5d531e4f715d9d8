"""A quick Lorsa fit: one Lorsa per chosen layer, started from the layer's own attention.

Start (:func:`attention_init`): QK head ``h`` is the model's head ``h`` (its query and key
projections with the pre-attention norm's gain folded in, the key/value head its group shares;
rotary as the model's, checked against its ``inv_freq``), so the patterns are the model's. Each
head's OV circuit ``W_V^h W_O^h`` (rank ``head_dim``) is split by SVD into rank-1 parts, each
part twice, with opposite signs (``relu(a) v - relu(-a) v = a v``): with ``2 * head_dim`` OV
heads per QK head and no TopK the Lorsa *is* the attention layer (tests check it). Then TopK
keeps ``top_k`` of them per position, and Adam trains the OV side (``W_V``, ``b_V``, ``W_O``,
``b_D``) on the reconstruction's squared error, QK held at the model's (fast; the paper trains
QK too).

    lorsa, report = fit_lorsa(model, tokenizer, texts, layers=[3, 4], top_k=64, steps=300)
    save_lorsa(lorsa[3], "out/L3", model_name="smollm2-135m")
"""

from __future__ import annotations

import torch
from torch import nn

from ..bound import BoundModel, bind
from ..errors import InputError
from .hooks import hook_states
from .lorsa import INPUT_HOOK, OUTPUT_HOOK, Lorsa, LorsaConfig, LorsaSet, lorsa_fvu


def _rope_base(model: nn.Module, head_dim: int) -> float:
    """The model's rotary base, from its ``inv_freq`` buffer, refused unless its frequencies
    are llamascopium's plain ``base ** (-2i / dim)`` (no scaled variants)."""
    found = [b for name, b in model.named_buffers() if name.endswith("inv_freq")]
    if not found:
        raise InputError("the model has no rotary inv_freq buffer: a Lorsa is fitted here on "
                         "rotary models")
    inv = found[0].double()
    if inv.numel() != head_dim // 2:
        raise InputError(f"the model's rotary covers {2 * inv.numel()} of {head_dim} dims")
    base = float(inv[1] ** (-head_dim / 2))
    base = float(round(base)) if abs(base - round(base)) < 1e-3 * base else base
    want = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=inv.device)
                    / head_dim)
    if not torch.allclose(inv, want, rtol=1e-5):
        raise InputError("the model's rotary frequencies are scaled (not base ** (-2i/dim)); "
                         "llamascopium's rotary_base cannot state them")
    return base


@torch.no_grad()
def attention_init(bound: BoundModel, layer: int, *, top_k: int, n_ctx: int = 2048,
                   per_qk_head: int | None = None) -> Lorsa:
    """Layer ``layer``'s attention as a Lorsa (module docstring): ``per_qk_head`` OV heads per
    QK head (default ``2 * head_dim``, exact without TopK; fewer keeps the largest parts)."""
    attn, norm = bound.module("attn", layer), bound.module("pre_attn_norm", layer)
    if bound.adapter.norm_kind != "rms" or any(hasattr(attn, name) for name in ("q_norm",
                                                                                 "k_norm")):
        raise InputError("the fit starts from a plain RMS-normed attention without q/k norms")
    try:
        projections = [getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    except AttributeError:
        raise InputError("the fit reads q_proj, k_proj, v_proj and o_proj from the attention "
                         "module; this model has other names") from None
    q_proj, k_proj, v_proj, o_proj = projections
    config = getattr(bound.model, "config", None)
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if window is not None and window < n_ctx and (types is None
                                                  or types[layer] == "sliding_attention"):
        raise InputError(f"layer {layer} attends over a sliding window of {window} tokens; a "
                         f"Lorsa attends over every earlier position (n_ctx {n_ctx}), so its "
                         "start would not be the layer")
    heads, dh, d = bound.n_heads, bound.head_dim, bound.d_model
    kv = bound.kv_width // dh
    rep = heads // kv
    per = per_qk_head or 2 * dh
    on = {"device": bound.device}  # every tensor made here: where the model is
    gain = norm.weight.float()
    W_Q = (gain[:, None] * q_proj.weight.float().T).view(d, heads, dh).permute(1, 0, 2)
    W_K = (gain[:, None] * k_proj.weight.float().T).view(d, -1, dh).permute(1, 0, 2)
    W_K = W_K.repeat_interleave(rep, dim=0)

    def bias(proj, shape):
        return proj.bias.float().view(shape) if proj.bias is not None else torch.zeros(shape, **on)

    b_Q, b_K = bias(q_proj, (heads, dh)), bias(k_proj, (kv, dh)).repeat_interleave(rep, 0)
    W_v = (gain[:, None] * v_proj.weight.float().T).view(d, -1, dh)
    b_v = bias(v_proj, (kv, dh))
    W_o = o_proj.weight.float().T.view(heads, dh, d)
    b_D = bias(o_proj, (d,)).clone()
    W_V, W_O = torch.zeros(heads * per, d, **on), torch.zeros(heads * per, d, **on)
    g = torch.Generator(**on).manual_seed(layer)
    for h in range(heads):
        ov = W_v[:, h // rep] @ W_o[h]  # [d, d], rank dh
        b_D += b_v[h // rep] @ W_o[h]   # a value bias passes softmax unchanged
        u, s, vt = torch.linalg.svd(ov.double())
        parts = min(per // 2, dh)
        root = s[:parts].sqrt()
        for sign, offset in ((1, 0), (-1, parts)):
            rows = slice(h * per + offset, h * per + offset + parts)
            W_V[rows] = sign * (u[:, :parts] * root).T.float()
            W_O[rows] = sign * (vt[:parts].T * root).T.float()
        spare = per - 2 * parts  # heads beyond the exact split start small and random
        if spare > 0:
            rows = slice(h * per + 2 * parts, (h + 1) * per)
            W_V[rows] = torch.randn(spare, d, generator=g, **on) / d ** 0.5
            W_O[rows] = torch.randn(spare, d, generator=g, **on) * 1e-3
    cfg = LorsaConfig(layer=layer, d_model=d, n_ov_heads=heads * per, n_qk_heads=heads,
                      d_qk_head=dh, rotary_dim=dh, n_ctx=n_ctx, top_k=top_k, act_fn="topk",
                      rotary=True, rotary_base=_rope_base(bound.model, dh),
                      rotary_adjacent_pairs=False)  # transformers' rotate_half
    tensors = {"W_Q": W_Q, "W_K": W_K, "W_V": W_V, "W_O": W_O, "b_Q": b_Q, "b_K": b_K,
               "b_V": torch.zeros(heads * per, **on), "b_D": b_D}
    return Lorsa(cfg, {k: v.contiguous() for k, v in tensors.items()})


def _states(bound: BoundModel, tokenizer, texts: list[str], length: int) -> dict:
    xs, ys = [], []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :length].to(bound.device)
        if ids.shape[1] == length:
            states = hook_states(bound, ids, {"x": INPUT_HOOK, "y": OUTPUT_HOOK})
            xs.append(states["x"])
            ys.append(states["y"])
    if len(xs) < 2:
        raise InputError(f"fewer than 2 texts have {length} tokens: give longer texts or a "
                         "smaller length")
    return {"x": torch.stack(xs, 1).float(), "y": torch.stack(ys, 1).float()}  # [L, N, T, D]


def fit_lorsa(model: nn.Module | BoundModel, tokenizer, texts: list[str], *, layers: list[int],
              held_out: list[str], top_k: int, per_qk_head: int | None = None,
              steps: int = 300, lr: float = 1e-3, batch: int = 16, length: int = 64,
              seed: int = 0) -> tuple[LorsaSet, dict]:
    """Fit a Lorsa at each of ``layers`` on ``texts`` (each cut to ``length`` tokens; shorter
    ones are skipped) and report the held-out FVU (:func:`~.lorsa.lorsa_fvu`) at the start
    and at the end, per layer."""
    bound = bind(model)
    states = _states(bound, tokenizer, texts, length)
    start = {layer: attention_init(bound, layer, top_k=top_k, per_qk_head=per_qk_head,
                                   n_ctx=max(2048, length)) for layer in layers}
    before = lorsa_fvu(bound, tokenizer, LorsaSet(start), held_out)
    fitted = {}
    g = torch.Generator(bound.device).manual_seed(seed)  # the batches drawn where they are used
    for layer, lorsa in start.items():
        x, y = states["x"][layer], states["y"][layer]
        with torch.no_grad():
            patterns = torch.cat([lorsa.attention(x[i:i + batch])[0]
                                  for i in range(0, len(x), batch)])
        params = {k: v.detach().clone().requires_grad_(k in ("W_V", "b_V", "W_O", "b_D"))
                  for k, v in lorsa.tensors().items()}
        trained = Lorsa(lorsa.cfg, params)
        optim = torch.optim.Adam([p for p in params.values() if p.requires_grad], lr=lr)
        scale = (y[:, 1:] - y[:, 1:].mean((0, 1))).pow(2).mean()
        for _ in range(steps):
            pick = torch.randint(len(x), (min(batch, len(x)),), generator=g, device=g.device)
            recon = trained.decode(trained.encode(x[pick], pattern=patterns[pick]))
            loss = (recon[:, 1:] - y[pick, 1:]).pow(2).mean() / scale
            optim.zero_grad()
            loss.backward()
            optim.step()
        fitted[layer] = Lorsa(lorsa.cfg, {k: v.detach() for k, v in params.items()})
    result = LorsaSet(fitted)
    after = lorsa_fvu(bound, tokenizer, result, held_out)
    return result, {"fvu_start": before, "fvu": after, "n_texts": int(states["x"].shape[1]),
                    "length": length, "steps": steps, "top_k": top_k,
                    "n_ov_heads": next(iter(fitted.values())).cfg.n_ov_heads}
