"""What a Lorsa is, apart from its weights: llamascopium's ``config.json`` read and checked
(:class:`LorsaConfig`), and written back (:meth:`LorsaConfig.to_peer`); how a shard splits
the OV heads (:func:`head_range`). The maths and the loader: :mod:`.lorsa`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, TranscoderFormatError
from .hooks import hook_name
from .transcoder import feature_range

#: llamascopium's defaults of the LorsaConfig fields a config.json may leave out
#: (models/lorsa.py:45-73, models/sparse_dictionary.py:104-133).
PEER_DEFAULTS = {"positional_embedding_type": "rotary", "rotary_base": 10000,
                 "rotary_adjacent_pairs": True, "rotary_scale": 1, "use_NTK_by_parts_rope": False,
                 "attn_scale": None, "use_post_qk_ln": False, "normalization_type": None,
                 "eps": 1e-6, "use_decoder_bias": True, "act_fn": "relu",
                 "norm_activation": "dataset-wise", "sparsity_include_decoder_norm": True,
                 "top_k": 50}
REQUIRED = ("sae_type", "d_model", "expansion_factor", "hook_point_in", "hook_point_out",
            "n_qk_heads", "d_qk_head", "rotary_dim", "n_ctx")
#: The kind of value each field read here must hold (``None`` allowed where its default is).
FIELD_KINDS = {**{key: "int" for key in ("d_model", "n_qk_heads", "d_qk_head", "rotary_dim",
                                          "n_ctx", "top_k")},
               **{key: "number" for key in ("expansion_factor", "rotary_base", "rotary_scale",
                                            "eps", "attn_scale")},
               **{key: "bool" for key in ("rotary_adjacent_pairs", "use_NTK_by_parts_rope",
                                          "use_post_qk_ln", "use_decoder_bias",
                                          "sparsity_include_decoder_norm")},
               **{key: "str" for key in ("sae_type", "hook_point_in", "hook_point_out",
                                         "act_fn", "positional_embedding_type",
                                         "norm_activation")}}
#: Where it reads and writes, as TransformerLens names them.
INPUT_HOOK, OUTPUT_HOOK = "ln1.hook_normalized", "hook_attn_out"
#: The tensors with one row per OV head: what a shard holds a slice of
#: (:mod:`.lorsa`, "Sharded by OV head").
HEAD_TENSORS = ("W_V", "W_O", "b_V")
#: Why a TopK shard refuses to encode outside a distributed run.
LORSA_SHARD_ALONE = ("this Lorsa is one rank's shard of its OV heads (Lorsa.shard, "
                     "load_lorsa(..., shard=)) and its TopK ranks them against the other ranks' "
                     "heads: alone it cannot tell which {k} are kept; encode it under torchrun "
                     "with every rank holding its shard (attribute), or load the whole Lorsa")


def head_range(n_ov_heads: int, rank: int, world: int) -> tuple[int, int]:
    """OV heads ``[lo, hi)`` that rank ``rank`` of ``world`` holds: contiguous, the first
    ``n_ov_heads % world`` ranks one more (:func:`~.transcoder.feature_range`'s split).

    >>> [head_range(45, rank, 2) for rank in range(2)]
    [(0, 23), (23, 45)]"""
    if isinstance(world, int) and not isinstance(world, bool) and world > n_ov_heads:
        raise InputError(f"world={world} ranks cannot share n_ov_heads={n_ov_heads} OV heads: "
                         "some would hold none")
    return feature_range(n_ov_heads, rank, world)


def _check_kinds(cfg: dict, where: Path) -> None:
    """Refuse a field of the wrong kind (a string where a number belongs), naming it."""
    for key, kind in FIELD_KINDS.items():
        value = cfg.get(key)
        if value is None and PEER_DEFAULTS.get(key, 0) is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "number": number and math.isfinite(value),
              "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
        if not ok:
            what = {"int": "a whole number", "number": "a finite number", "bool": "true or false",
                    "str": "a string"}[kind]
            raise TranscoderFormatError(f"{where}: field {key} must be {what}, got {value!r}")


def _layer_of(hook: str, where: Path, name: str) -> int:
    found = re.fullmatch(r"blocks\.(\d+)\.(.+)", str(hook))
    if found is None:
        raise TranscoderFormatError(f"{where}: {name} must be 'blocks.<layer>.<hook>', got "
                                    f"{hook!r}")
    return int(found.group(1))


@dataclass(frozen=True)
class LorsaConfig:
    """One layer's Lorsa, from llamascopium's ``config.json`` (:meth:`from_peer`)."""

    layer: int
    d_model: int
    n_ov_heads: int
    n_qk_heads: int
    d_qk_head: int
    rotary_dim: int
    n_ctx: int
    top_k: int
    act_fn: str = "topk"
    rotary: bool = True
    rotary_base: float = 10000.0
    rotary_adjacent_pairs: bool = True
    attn_scale: float | None = None
    use_post_qk_ln: bool = False
    eps: float = 1e-6
    use_decoder_bias: bool = True
    sparsity_include_decoder_norm: bool = True
    peer: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_ov_heads", "n_qk_heads", "d_qk_head", "n_ctx", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        if self.n_ov_heads % self.n_qk_heads:
            raise InputError(f"n_ov_heads ({self.n_ov_heads}) must be a multiple of "
                             f"n_qk_heads ({self.n_qk_heads})")
        if self.act_fn not in ("topk", "relu"):
            raise InputError(f"act_fn {self.act_fn!r}: Lorsa is read with topk or relu "
                             "(jumprelu's threshold and batchtopk's batch are not per position)")
        if self.rotary and not (0 < self.rotary_dim <= self.d_qk_head and self.rotary_dim % 2 == 0):
            raise InputError(f"rotary_dim must be even and in 1..d_qk_head={self.d_qk_head}, "
                             f"got {self.rotary_dim}")
        if self.attn_scale is None:  # models/lorsa.py:104-105
            object.__setattr__(self, "attn_scale", self.d_qk_head ** 0.5)
        # a negative scale attends to the least similar keys; a base <= 0 or eps < 0 gives NaN
        limits = {"attn_scale": (self.attn_scale, 0.0), "eps": (self.eps, None)}
        if self.rotary:
            limits["rotary_base"] = (self.rotary_base, 0.0)
        for name, (value, floor) in limits.items():
            if not (value > floor if floor is not None else value >= 0):
                raise InputError(f"{name} must be {'> 0' if floor is not None else '>= 0'}, "
                                 f"got {value!r}")

    @property
    def group(self) -> int:
        return self.n_ov_heads // self.n_qk_heads

    @classmethod
    def from_peer(cls, raw: dict, where: Path) -> LorsaConfig:
        """Read llamascopium's config.json fields; refusals name ``where`` and the field."""
        missing = [key for key in REQUIRED if key not in raw]
        if missing:
            raise TranscoderFormatError(f"{where}: missing field(s) {', '.join(missing)}")
        if raw["sae_type"] != "lorsa":
            raise TranscoderFormatError(f"{where}: sae_type is {raw['sae_type']!r}, not 'lorsa'")
        cfg = {**PEER_DEFAULTS, **raw}
        _check_kinds(cfg, where)
        n_ov = cfg["d_model"] * cfg["expansion_factor"]
        if n_ov != int(n_ov):
            raise TranscoderFormatError(f"{where}: d_model x expansion_factor ({n_ov:g}) is the "
                                        "number of OV heads: it must be a whole number")
        refusals = {"positional_embedding_type": ("rotary", "none"), "rotary_scale": (1,),
                    "use_NTK_by_parts_rope": (False,), "norm_activation": ("dataset-wise",
                                                                           "inference")}
        for key, allowed in refusals.items():
            if cfg[key] not in allowed:
                raise TranscoderFormatError(f"{where}: {key}={cfg[key]!r} is not read here "
                                            f"(read: {allowed})")
        if cfg["use_post_qk_ln"] and cfg["normalization_type"] != "RMS":  # models/lorsa.py:202-205
            raise TranscoderFormatError(f"{where}: use_post_qk_ln needs normalization_type "
                                        f"'RMS', got {cfg['normalization_type']!r}")
        layer = _layer_of(cfg["hook_point_in"], where, "hook_point_in")
        if _layer_of(cfg["hook_point_out"], where, "hook_point_out") != layer:
            raise TranscoderFormatError(f"{where}: hook_point_in {cfg['hook_point_in']!r} and "
                                        f"hook_point_out {cfg['hook_point_out']!r} name "
                                        "different layers")
        for key, want in (("hook_point_in", INPUT_HOOK), ("hook_point_out", OUTPUT_HOOK)):
            if hook_name(cfg[key]) != want:
                raise TranscoderFormatError(f"{where}: {key} must be blocks.<layer>.{want}, got "
                                            f"{cfg[key]!r}")
        try:
            return cls(layer=layer, d_model=cfg["d_model"],
                       n_ov_heads=int(cfg["d_model"] * cfg["expansion_factor"]),  # d_sae
                       n_qk_heads=cfg["n_qk_heads"], d_qk_head=cfg["d_qk_head"],
                       rotary_dim=cfg["rotary_dim"], n_ctx=cfg["n_ctx"], top_k=cfg["top_k"],
                       act_fn=cfg["act_fn"], rotary=cfg["positional_embedding_type"] == "rotary",
                       rotary_base=float(cfg["rotary_base"]),
                       rotary_adjacent_pairs=bool(cfg["rotary_adjacent_pairs"]),
                       attn_scale=cfg["attn_scale"], use_post_qk_ln=bool(cfg["use_post_qk_ln"]),
                       eps=float(cfg["eps"]), use_decoder_bias=bool(cfg["use_decoder_bias"]),
                       sparsity_include_decoder_norm=bool(cfg["sparsity_include_decoder_norm"]),
                       peer=dict(raw))
        except (InputError, TypeError) as error:
            raise TranscoderFormatError(f"{where}: {error}") from None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape (models/lorsa.py:131-139, 1033)."""
        qk, ov, d, dq = self.n_qk_heads, self.n_ov_heads, self.d_model, self.d_qk_head
        out = {"W_Q": (qk, d, dq), "W_K": (qk, d, dq), "W_V": (ov, d), "W_O": (ov, d),
               "b_Q": (qk, dq), "b_K": (qk, dq), "b_V": (ov,)}
        if self.use_decoder_bias:
            out["b_D"] = (d,)
        if self.use_post_qk_ln:
            out.update({"ln_q.w": (qk, dq), "ln_k.w": (qk, dq)})
        return out

    def to_peer(self) -> dict:
        """The config.json llamascopium writes for this Lorsa (``model_dump``)."""
        ours = {"sae_type": "lorsa", "d_model": self.d_model,
                "expansion_factor": self.n_ov_heads / self.d_model,
                "hook_point_in": f"blocks.{self.layer}.{INPUT_HOOK}",
                "hook_point_out": f"blocks.{self.layer}.{OUTPUT_HOOK}",
                "n_qk_heads": self.n_qk_heads, "d_qk_head": self.d_qk_head,
                "rotary_dim": self.rotary_dim, "n_ctx": self.n_ctx, "top_k": self.top_k,
                "act_fn": self.act_fn,
                "positional_embedding_type": "rotary" if self.rotary else "none",
                "rotary_base": int(self.rotary_base),
                "rotary_adjacent_pairs": self.rotary_adjacent_pairs,
                "attn_scale": self.attn_scale, "use_post_qk_ln": self.use_post_qk_ln,
                "normalization_type": "RMS" if self.use_post_qk_ln else None, "eps": self.eps,
                "use_decoder_bias": self.use_decoder_bias, "norm_activation": "inference",
                "sparsity_include_decoder_norm": self.sparsity_include_decoder_norm}
        return {**PEER_DEFAULTS, **{k: v for k, v in self.peer.items()
                                    if k not in ("norm_activation",)}, **ours}


__all__ = ["HEAD_TENSORS", "INPUT_HOOK", "LORSA_SHARD_ALONE", "OUTPUT_HOOK", "PEER_DEFAULTS",
           "REQUIRED", "LorsaConfig", "head_range"]
