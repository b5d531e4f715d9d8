"""Lorsa (low-rank sparse attention, arXiv 2504.20938): attention features, in llamascopium's
layout (2.0.0b34's ``LowRankSparseAttention``: docs/transcoders.md, "Lorsa: attention features";
the file and line of theirs each convention follows is noted beside the code).

One Lorsa replaces one layer's attention output. ``n_qk_heads`` QK heads, each shared by a group
of ``n_ov_heads / n_qk_heads`` rank-1 OV heads (OV head ``h`` uses QK head ``h // group``):

    q = x @ W_Q + b_Q, k = x @ W_K + b_K      [P, n_qk, d_qk] (optional per-head RMS norm,
                                              then rotary over the first rotary_dim dims)
    pattern = softmax(causal(q . k / attn_scale))                     [n_qk, P, P]
    pre[p, h] = sum_k pattern[h // group, p, k] * (x[k] @ W_V[h] + b_V[h])
    acts = TopK_h(relu(pre * |W_O[h]|)) / |W_O[h]|   (the k largest per position; relu: no TopK;
                                              without sparsity_include_decoder_norm no |W_O|)
    out = acts @ W_O + b_D

``x`` is the input hook's value (``ln1.hook_normalized``: the residual stream normalised, before
the norm's gain, as TransformerLens's folded model gives it), ``out`` is ``hook_attn_out``.

On disk a Lorsa is a directory: ``config.json`` (LorsaConfig's fields) and
``sae_weights.safetensors``; a set is a directory of such directories, one per layer.
:func:`load_lorsa` reads the configs and the files' headers (names, shapes, dtypes checked);
a layer's tensors are read the first time it is used.

Sharded by OV head (docs/transcoders.md, "Lorsa sharded by OV head"): ``load_lorsa(...,
shard=(rank, world))`` or :meth:`Lorsa.shard` keeps OV heads :func:`head_range` of each layer
(``W_V``, ``W_O``, ``b_V``: only those rows are read from the file); the QK side (``W_Q``,
``W_K``, their biases and norms) and ``b_D`` stay whole on every rank, so a range need not
hold whole QK groups. A shard's ``encode`` gives its heads (local ids; global = local +
``head_offset``), its TopK a collective over the ranks, ties to the lower global id (only
there may it differ from the whole's ``torch.topk``); outside a distributed run a TopK shard
refuses to encode. ``decode(acts, partial=True)`` is its part of ``acts @ W_O``, without ``b_D``.

    lorsa = load_lorsa("path/to/lorsa-dir-or-set")    # LorsaSet: lorsa[layer] -> Lorsa
    acts = lorsa[3].encode(x)                          # [B, P, n_ov_heads]
    fvu = lorsa_fvu(model, tokenizer, lorsa, texts)    # {layer: FVU}
    part = load_lorsa("path", shard=(rank, world))     # OV heads head_range(...) per layer
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import distributed
from ..arguments import NonNegativeInt, checked
from ..atomic import replacing, write_text
from ..bound import BoundModel, bind
from ..errors import InputError, TranscoderFormatError, TranscoderMismatchError
from .formats.common import (
    check_dtype,
    norm_factor,
    open_safetensors,
    read_json_object,
    read_tensors,
    widened,
)
from .hooks import hook_site, hook_states
from .lorsa_checks import check_lorsa_model, fitted_on
from .lorsa_config import (
    HEAD_TENSORS,
    INPUT_HOOK,
    LORSA_SHARD_ALONE,
    OUTPUT_HOOK,
    PEER_DEFAULTS,
    LorsaConfig,
    head_range,
)

WEIGHTS = ("sae_weights.safetensors", "checkpoints/pruned.safetensors",
           "checkpoints/final.safetensors")
NORM_KEY = "dataset_average_activation_norm."
#: Buffers their state dict holds (their strict loader needs them; we recompute them).
BUFFERS = ("mask", "IGNORE", "rotary_sin", "rotary_cos")

def _rotate(x: torch.Tensor, cfg: LorsaConfig, sin: torch.Tensor,
            cos: torch.Tensor) -> torch.Tensor:
    """Rotary over the first rotary_dim dims (models/lorsa.py:525-575, 864-904)."""
    rot, rest = x[..., :cfg.rotary_dim], x[..., cfg.rotary_dim:]
    flip = torch.empty_like(rot)
    if cfg.rotary_adjacent_pairs:
        flip[..., ::2], flip[..., 1::2] = -rot[..., 1::2], rot[..., ::2]
    else:
        n = rot.shape[-1] // 2
        flip[..., :n], flip[..., n:] = -rot[..., n:], rot[..., :n]
    return torch.cat([rot * cos + flip * sin, rest], dim=-1)


def rotary_tables(cfg: LorsaConfig, n_pos: int, dtype: torch.dtype,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin, cos)`` ``[n_pos, rotary_dim]`` as llamascopium computes them (float32, then
    ``dtype``)."""
    high = torch.float64 if dtype == torch.float64 else torch.float32
    pos = torch.arange(n_pos, dtype=high, device=device)
    dim = torch.arange(cfg.rotary_dim // 2, dtype=high, device=device)
    freq = cfg.rotary_base ** (dim / (cfg.rotary_dim / 2))
    freq = (freq.repeat_interleave(2) if cfg.rotary_adjacent_pairs else freq.repeat(2))
    angles = pos[:, None] / freq[None, :]
    return torch.sin(angles).to(dtype), torch.cos(angles).to(dtype)


class Lorsa(nn.Module):
    """One layer's Lorsa (module docstring): weights as buffers, read from ``path`` the first
    time they are used unless given. ``heads=(lo, hi)`` makes it a shard: ``W_V``, ``W_O`` and
    ``b_V`` hold OV heads ``[lo, hi)`` alone, ``cfg`` describes the whole."""

    def __init__(self, cfg: LorsaConfig, tensors: dict[str, torch.Tensor] | None = None, *,
                 path: Path | None = None, dtype: torch.dtype = torch.float32,
                 device=None, heads: tuple[int, int] | None = None) -> None:
        super().__init__()
        if heads is not None:
            lo, hi = heads
            if not 0 <= lo < hi <= cfg.n_ov_heads:
                raise InputError(f"heads {heads} is not a range [lo, hi) within the Lorsa's "
                                 f"{cfg.n_ov_heads} OV heads")
            heads = (int(lo), int(hi))
        self.cfg, self.path, self.dtype, self._device = cfg, path, dtype, device
        self.heads = heads
        self._loaded = False
        if tensors is not None:
            self._take(tensors)

    def _take(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.cfg.shapes():
            if name in HEAD_TENSORS and tensors[name].shape[0] != self.n_local:
                raise InputError(f"{name} holds {tensors[name].shape[0]} OV heads; this Lorsa "
                                 f"{'shard ' if self.heads else ''}holds {self.n_local}")
            self.register_buffer(name.replace(".", "_"),
                                 tensors[name].to(device=self._device, dtype=self.dtype))
        self._loaded = True

    def load(self) -> Lorsa:
        """Read the weights (once; a shard's OV-head rows alone)."""
        if not self._loaded:
            self._take(_read_weights(self.cfg, self.path, self.heads))
        return self

    @property
    def n_local(self) -> int:
        """OV heads this object holds (``cfg.n_ov_heads`` unless a shard)."""
        return self.cfg.n_ov_heads if self.heads is None else self.heads[1] - self.heads[0]

    @property
    def head_offset(self) -> int:
        """Global id of local OV head 0 (0 unless a shard)."""
        return 0 if self.heads is None else self.heads[0]

    def shard(self, rank: int, world: int) -> Lorsa:
        """OV heads :func:`head_range` ``(n_ov_heads, rank, world)`` (module docstring): not
        yet read, it will read only their rows; read, a copy of them; the QK side and ``b_D``
        shared."""
        if self.heads is not None:
            raise InputError(f"this Lorsa is already a shard (OV heads {self.heads}); shard the "
                             "whole Lorsa")
        lo, hi = head_range(self.cfg.n_ov_heads, rank, world)
        tensors = None if not self._loaded else {
            name: t[lo:hi].clone() if name in HEAD_TENSORS else t
            for name, t in self.tensors().items()}
        return Lorsa(self.cfg, tensors, path=self.path, dtype=self.dtype, device=self._device,
                     heads=(lo, hi))

    def resident_bytes(self) -> int:
        """Bytes of the weights this object holds (read now if not yet)."""
        return sum(t.nbytes for t in self.tensors().values())

    def queries_keys(self, x: torch.Tensor, frozen: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[B, P, n_qk, d_qk]`` after the post-QK norm and rotary;
        ``frozen``: the norm's statistic a constant for autograd (QK tracing)."""
        self.load()
        cfg = self.cfg
        x = x.to(self.dtype)
        q = torch.einsum("bpd,hde->bphe", x, self.W_Q) + self.b_Q
        k = torch.einsum("bpd,hde->bphe", x, self.W_K) + self.b_K
        if cfg.use_post_qk_ln:  # RMSNormPerHead, models/lorsa.py:1046-1052
            q, k = (_head_rms(t, w, cfg.eps, frozen)
                    for t, w in ((q, self.ln_q_w), (k, self.ln_k_w)))
        n_pos = x.shape[1]
        if n_pos > cfg.n_ctx:
            raise InputError(f"the sequence has {n_pos} positions; this Lorsa's n_ctx is "
                             f"{cfg.n_ctx}")
        if cfg.rotary:
            sin, cos = (t[:, None] for t in rotary_tables(cfg, n_pos, self.dtype, x.device))
            q, k = _rotate(q, cfg, sin, cos), _rotate(k, cfg, sin, cos)
        return q, k

    def attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pattern [B, n_qk, P, P], v [B, P, n_ov])`` of input ``x [B, P, D]``."""
        q, k = self.queries_keys(x)
        v = x.to(self.dtype) @ self.W_V.T + self.b_V
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / self.cfg.attn_scale
        causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return scores.softmax(-1), v

    def hidden_pre(self, x: torch.Tensor, pattern: torch.Tensor | None = None) -> torch.Tensor:
        """OV heads' pre-activations ``[B, P, n_ov]`` (models/lorsa.py:918-934); ``pattern``:
        the QK heads' patterns held (a fit's, or the clean run's), else computed from ``x``."""
        if pattern is None:
            pattern, v = self.attention(x)
        else:
            self.load()
            v = x.to(self.dtype) @ self.W_V.T + self.b_V
        b, p, _ = v.shape
        group = self.cfg.group
        if self.heads is None:
            grouped = v.view(b, p, self.cfg.n_qk_heads, group)
            return torch.einsum("bhqk,bkhg->bqhg", pattern, grouped).reshape(b, p, -1)
        # a shard: its heads padded to the whole QK groups they fall in, those groups' patterns
        lo, hi = self.heads
        first, last = lo // group, (hi - 1) // group + 1
        padded = v.new_zeros(b, p, (last - first) * group)
        padded[..., lo - first * group:hi - first * group] = v
        grouped = padded.view(b, p, last - first, group)
        out = torch.einsum("bhqk,bkhg->bqhg", pattern[:, first:last], grouped).reshape(b, p, -1)
        return out[..., lo - first * group:hi - first * group]

    def encode(self, x: torch.Tensor, pattern: torch.Tensor | None = None) -> torch.Tensor:
        """OV-head activations ``[B, P, n_ov]`` (a shard's ``n_local``, local ids): ReLU, then
        the top_k per position (topk; a shard's a collective, module docstring)."""
        pre = self.hidden_pre(x, pattern)
        norm = self.W_O.norm(dim=1) if self.cfg.sparsity_include_decoder_norm else None
        scored = pre * norm if norm is not None else pre
        scored = scored * scored.gt(0)  # utils/math.py topk after relu (sparse_dictionary:729)
        if self.cfg.act_fn == "topk":
            k = min(self.cfg.top_k, self.cfg.n_ov_heads)
            if self.heads is None:
                chosen = scored.topk(k, dim=-1).indices
                mask = torch.zeros_like(scored, dtype=torch.bool).scatter_(-1, chosen, True)
            else:
                mask = self._topk_over_ranks(scored, k)
            scored = scored * mask
        # a dead head (W_O row zero) scores relu(pre * 0) = 0: its activation 0, not 0 / 0
        return scored if norm is None else scored / norm.masked_fill(norm == 0, 1)

    def _topk_over_ranks(self, scored: torch.Tensor, k: int) -> torch.Tensor:
        """Bool like ``scored [..., n_local]``: this shard's heads among each position's ``k``
        best of every rank's (:func:`~..distributed.topk_over_ranks`)."""
        ranks = distributed.current()
        if ranks is None:
            raise InputError(LORSA_SHARD_ALONE.format(k=k))
        ids = torch.arange(self.n_local, device=scored.device) + self.head_offset
        keep = distributed.topk_over_ranks(ranks, scored.detach().reshape(-1, self.n_local), ids,
                                           k, f"layer {self.cfg.layer}'s Lorsa TopK over ranks")
        return keep.reshape(scored.shape)

    def decode(self, acts: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """``acts @ W_O + b_D`` ``[B, P, D]`` (models/lorsa.py:765-782); ``partial``: without
        ``b_D``, a shard's part of the sum (summed over every shard, plus ``b_D`` once)."""
        self.load()
        if acts.shape[-1] != self.n_local:
            raise InputError(f"acts hold {acts.shape[-1]} OV heads; this Lorsa "
                             f"{'shard ' if self.heads else ''}holds {self.n_local}")
        if self.heads is not None and not partial:
            raise InputError("a Lorsa shard's OV heads are a part of the layer's: its decode is "
                             "partial (decode(acts, partial=True), summed over every shard, plus "
                             "b_D once); load the whole Lorsa for the whole reconstruction")
        out = acts.to(self.dtype) @ self.W_O
        return out + self.b_D if self.cfg.use_decoder_bias and not partial else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every weight by its file name (a shard's OV-head rows alone)."""
        self.load()
        return {name: getattr(self, name.replace(".", "_")) for name in self.cfg.shapes()}


def _head_rms(x: torch.Tensor, weight: torch.Tensor, eps: float,
              frozen: bool = False) -> torch.Tensor:
    xf = x.float()
    root = (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return (xf / (root.detach() if frozen else root) * weight.float()).to(x.dtype)


def _weights_file(folder: Path) -> Path:
    for name in WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    other = [p.name for p in folder.glob("sae_weights.*")]
    raise TranscoderFormatError(f"{folder}: no {WEIGHTS[0]}" + (
        f" ({', '.join(other)} is not read: save it as safetensors)" if other else ""))


def _check_header(cfg: LorsaConfig, path: Path) -> None:
    """Names, shapes and dtypes from the header alone; a truncated file fails here."""
    handle = open_safetensors(path)
    shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    for name, shape in cfg.shapes().items():
        if name not in shapes:
            raise TranscoderFormatError(f"{path}: missing tensor {name}")
        stored = shapes[name]
        # a checkpoint may hold fewer QK heads, repeated on load (models/lorsa.py:970-978)
        fewer = name in ("W_Q", "W_K", "b_Q", "b_K", "ln_q.w", "ln_k.w") and stored[1:] == \
            shape[1:] and stored[0] >= 1 and shape[0] % stored[0] == 0
        if stored != shape and not fewer:
            raise TranscoderFormatError(f"{path}: tensor {name} has shape {list(stored)}; the "
                                        f"config.json gives {list(shape)}")
        code = str(handle.get_slice(name).get_dtype())
        if code not in ("F32", "F16", "BF16", "F64"):
            raise TranscoderFormatError(f"{path}: tensor {name} is stored as {code}, not floats")


def _read_weights(cfg: LorsaConfig, path: Path,
                  heads: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    tensors = read_tensors(path, names=list(cfg.shapes()), features=heads,
                           axes=dict.fromkeys(HEAD_TENSORS, 0))
    for name in ("W_Q", "W_K", "b_Q", "b_K", "ln_q.w", "ln_k.w"):
        if name in tensors and tensors[name].shape[0] != cfg.n_qk_heads:
            tensors[name] = tensors[name].repeat_interleave(
                cfg.n_qk_heads // tensors[name].shape[0], dim=0)
    norms = read_tensors(path, names=[f"{NORM_KEY}{cfg.peer['hook_point_in']}",
                                      f"{NORM_KEY}{cfg.peer['hook_point_out']}"]) \
        if cfg.peer.get("norm_activation", PEER_DEFAULTS["norm_activation"]) == "dataset-wise" \
        else None
    if norms is not None:  # standardize_parameters_of_dataset_norm, models/lorsa.py:621-640
        into, out = (norm_factor(path, f"{NORM_KEY}{cfg.peer[key]}", norms, cfg.d_model)
                     for key in ("hook_point_in", "hook_point_out"))
        for name in ("W_Q", "W_K", "W_V"):  # in float32 at least: bf16 rounded twice flips TopK
            tensors[name] = widened(tensors[name]) * into
        tensors["W_O"] = widened(tensors["W_O"]) / out
        if "b_D" in tensors:
            tensors["b_D"] = widened(tensors["b_D"]) / out
    return tensors


@dataclass
class LorsaSet:
    """Lorsas by layer, read from ``source`` (a Lorsa directory or a directory of them);
    ``fitted_on``: the fingerprint of the model ``fit-lorsa`` fitted them on
    (:func:`~.lorsa_checks.fitted_on`)."""

    layers: dict[int, Lorsa]
    source: str | None = None
    model_name: str | None = None
    fitted_on: str | None = None

    def __getitem__(self, layer: int) -> Lorsa:
        if layer not in self.layers:
            raise InputError(f"no Lorsa for layer {layer}; this set has layers "
                             f"{sorted(self.layers)}")
        return self.layers[layer].load()

    @property
    def d_model(self) -> int:
        return next(iter(self.layers.values())).cfg.d_model

    @property
    def sharded(self) -> bool:
        """Whether its Lorsas are shards of their OV heads (:meth:`shard`)."""
        return any(one.heads is not None for one in self.layers.values())

    def shard(self, rank: int, world: int) -> LorsaSet:
        """Every layer's :meth:`Lorsa.shard` (module docstring)."""
        return LorsaSet({layer: one.shard(rank, world) for layer, one in self.layers.items()},
                        source=self.source, model_name=self.model_name,
                        fitted_on=self.fitted_on)


def _read_one(folder: Path, dtype: torch.dtype, device) -> tuple[Lorsa, str | None]:
    cfg = LorsaConfig.from_peer(read_json_object(folder / "config.json"), folder / "config.json")
    weights = _weights_file(folder)
    _check_header(cfg, weights)
    lm = folder / "lm_config.json"
    name = read_json_object(lm).get("model_name") if lm.is_file() else None
    return Lorsa(cfg, path=weights, dtype=dtype, device=device), name


@checked
def load_lorsa(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device | None = None,
               shard: tuple[int, int] | None = None) -> LorsaSet:
    """A Lorsa directory (config.json + sae_weights.safetensors) or a directory of them (one
    per layer; directories of other ``sae_type`` beside them are skipped), checked and lazy
    (module docstring). Refusals are :class:`~..errors.TranscoderFormatError` naming the file
    and field. ``shard=(rank, world)``: each layer's OV heads :func:`head_range` alone (module
    docstring)."""
    check_dtype(dtype)
    root = Path(path).expanduser()
    if (root / "config.json").is_file():
        folders = [root]
    else:
        folders = sorted(p.parent for p in root.glob("*/config.json")) if root.is_dir() else []
        # the other dictionaries of a replacement model beside them (sae_type "sae": their
        # transcoders, load_transcoder's) are left out
        folders = [f for f in folders
                   if read_json_object(f / "config.json").get("sae_type", "lorsa") == "lorsa"]
        if not folders:
            raise TranscoderFormatError(f"{root}: no Lorsa here (a directory with config.json, "
                                        "or directories of them)")
    layers: dict[int, Lorsa] = {}
    names, fits = set(), []
    for folder in folders:
        lorsa, name = _read_one(folder, dtype, device)
        layer = lorsa.cfg.layer
        if layer in layers:
            raise TranscoderFormatError(f"{folder / 'config.json'}: hook_point_in names layer "
                                        f"{layer}, as {layers[layer].path.parent} does")
        layers[layer] = lorsa
        names.add(name)
        fits.append(fitted_on(folder, layer))
    widths = {lorsa.cfg.d_model for lorsa in layers.values()}
    if len(widths) > 1:
        raise TranscoderFormatError(f"{root}: the Lorsas' d_model differ ({sorted(widths)})")
    known = {name for name in names if name}
    if len(known) > 1:  # None here would skip check_lorsa_model's name check for every layer
        raise TranscoderFormatError(f"{root}: the Lorsas' lm_config.json name different models "
                                    f"({', '.join(sorted(known))})")
    model_name = known.pop() if known else None
    found = LorsaSet(dict(sorted(layers.items())), source=str(root), model_name=model_name,
                     fitted_on=fits[0] if all(fit == fits[0] for fit in fits) else None)
    return found if shard is None else found.shard(*shard)


@checked
def save_lorsa(lorsa: Lorsa, folder: str | Path, model_name: str | None = None) -> Path:
    """Write ``lorsa`` as llamascopium does (config.json, sae_weights.safetensors with the
    buffers its strict loader wants, lm_config.json when ``model_name`` is given)."""
    from safetensors.torch import save_file  # reason: only writers need it

    if lorsa.heads is not None:
        raise InputError(f"this Lorsa is a shard (OV heads {lorsa.heads}): save the whole Lorsa")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = lorsa.cfg
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in lorsa.tensors().items()}
    sin, cos = rotary_tables(cfg, cfg.n_ctx, torch.float32)
    tensors.update({"mask": torch.ones(cfg.n_ctx, cfg.n_ctx, dtype=torch.bool).tril(),
                    "IGNORE": torch.tensor(float("-inf")), "rotary_sin": sin,
                    "rotary_cos": cos})
    for key in ("hook_point_in", "hook_point_out"):  # unused in inference mode; written as theirs
        tensors[f"{NORM_KEY}{cfg.to_peer()[key]}"] = torch.tensor(math.sqrt(cfg.d_model))
    write_text(json.dumps(cfg.to_peer(), indent=4), folder / "config.json")
    with replacing(folder / WEIGHTS[0]) as out:
        save_file(tensors, str(out))
    if model_name is not None:
        write_text(json.dumps({"model_name": model_name}, indent=4), folder / "lm_config.json")
    return folder


def check_lorsa_fits(bound: BoundModel, lorsa: LorsaSet) -> None:
    """Refuse (:class:`~..errors.TranscoderMismatchError`, naming the file and field) a Lorsa
    of another width, model name or head width (:mod:`.lorsa_checks`), or a layer the bound
    model does not have."""
    for layer, one in lorsa.layers.items():
        where = one.path.parent / "config.json" if one.path is not None else f"layer {layer}"
        if one.cfg.d_model != bound.d_model:
            raise TranscoderMismatchError(f"{where}: d_model is {one.cfg.d_model}; the model's "
                                          f"is {bound.d_model}: a Lorsa of another model")
        if layer >= bound.n_layers:
            raise TranscoderMismatchError(f"{where}: hook_point_in names layer {layer}; the "
                                          f"model has {bound.n_layers} layers")
    check_lorsa_model(bound, lorsa)
    if bound.adapter.post_attn_norm is not None:
        raise TranscoderMismatchError("this model normalises its attention output before the "
                                      "residual add; Lorsa is read on models without one")
    for hook in (INPUT_HOOK, OUTPUT_HOOK):
        hook_site(hook)


def lorsa_states(model, lorsa: LorsaSet, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"input", "output"}`` ``[L, P, D]``: every layer's Lorsa input and attention output."""
    return hook_states(model, ids, {"input": INPUT_HOOK, "output": OUTPUT_HOOK})


@torch.no_grad()
@checked
def lorsa_fvu(model: nn.Module | BoundModel, tokenizer, lorsa: LorsaSet, texts: list[str],
              from_position: NonNegativeInt = 1) -> dict[int, float]:
    """The pairing check: per layer, the fraction of the attention output's variance (about
    its mean, positions ``>= from_position`` of every text) the Lorsa's reconstruction misses.
    A Lorsa paired with its model gives well under 1; one of another model, about 1 or more."""
    bound = bind(model)
    check_lorsa_fits(bound, lorsa)
    errors = {layer: [] for layer in lorsa.layers}
    outputs = {layer: [] for layer in lorsa.layers}
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"].to(bound.device)
        states = lorsa_states(bound, lorsa, ids)
        for layer in lorsa.layers:
            out = states["output"][layer, from_position:].float()
            recon = lorsa[layer](states["input"][layer][None])[0, from_position:].float()
            errors[layer].append(out - recon)
            outputs[layer].append(out)
    result = {}
    for layer in lorsa.layers:
        out, err = torch.cat(outputs[layer]), torch.cat(errors[layer])
        result[layer] = float(err.pow(2).sum() / (out - out.mean(0)).pow(2).sum())
    return result


__all__ = ["INPUT_HOOK", "OUTPUT_HOOK", "Lorsa", "LorsaConfig", "LorsaSet", "check_lorsa_fits",
           "head_range", "load_lorsa", "lorsa_fvu", "lorsa_states", "rotary_tables",
           "save_lorsa"]
