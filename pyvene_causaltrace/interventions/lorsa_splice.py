"""``lorsa_splice``: a layer's attention output replaced by its Lorsa's reconstruction.

Two registered interventions per layer, built by :func:`lorsa_splice_representations`, sharing
a :class:`~.splice_session.SpliceSession` as ``clt_splice``'s do:

- ``role="encode"`` on the layer's residual stream entering attention (the pre-attention
  norm's input): the Lorsa's input (``ln1.hook_normalized``: normalised, before the gain) and
  its OV-head activations, kept in the session; the value passes unchanged;
- ``role="decode"`` on the attention output (``hook_attn_out``): positions ``>= from_position``
  replaced by ``acts @ W_O + b_D`` plus one error term: with ``add_error`` the frozen
  ``(out - recon).detach()`` (the forward is the original one), a fixed ``error`` ``[1, P, D]``
  (the clean run's, :func:`clean_lorsa_errors`), or none (the reconstruction alone).

With ``leaves=True`` (the attribution graph's local replacement model,
:mod:`~..attribution.lorsa_nodes`) the encoder reads its input with the norm's statistic
frozen, fixes the QK patterns and the TopK active set at this (the clean) run, and keeps
each active OV head's activation as an autograd leaf (:class:`LorsaHeads`); the decoder
writes ``acts @ W_O + b_D`` (``b_D`` a leaf constant) plus the error ``out - recon`` as a
leaf: the value is the model's own output, and the gradient reaches the heads, the error
and ``b_D``. Every position is spliced (BOS's heads are zero, its output all error).

``heads_off`` (OV heads whose activations are zeroed before the decoder) is the splice's
ablation: with a fixed clean error, zeroing head ``h`` changes the output by exactly
``-act_h * W_O[h]``. The Lorsa is held by reference or by the path it was loaded from
(``source``: serialised, read once per session). Composable with ``clt_splice`` (another
session, other sites) in one forward or one spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..bound import BoundModel, bind
from ..distributed import current
from ..errors import InputError, SpecError
from ..locations import resolve_layers
from ..pyvene_boundary.calls import pyvene_call
from ..transcoders.hooks import hook_component, hook_value, norm_settings
from ..transcoders.lorsa import (
    INPUT_HOOK,
    OUTPUT_HOOK,
    LorsaSet,
    check_lorsa_fits,
    load_lorsa,
    lorsa_states,
)
from .spec_entry import Site, SpecContext
from .splice_session import SpliceIntervention, SpliceSession

#: Why a Lorsa shard's leaf splice is refused outside a distributed run.
LORSA_SUM_ALONE = ("this Lorsa is one rank's shard of its OV heads (load_lorsa(..., shard=)): "
                   "alone it reconstructs the layer's attention from a part of its heads, which "
                   "gives wrong numbers; run it under torchrun with every rank holding its shard "
                   "(attribute), or load the whole Lorsa")

__all__ = ["LorsaHeads", "LorsaSplice", "clean_lorsa_errors", "lorsa_splice_representations"]


@dataclass
class LorsaHeads:
    """One layer's active OV heads in a leaf-mode splice: position, head (its global id) and
    value (an autograd leaf) of each, nonzero order; ``pattern`` ``[n_qk, P, P]`` the clean
    run's QK patterns, ``group`` OV heads per QK head, ``w_v`` ``[n, D]`` the heads' value rows.
    A Lorsa sharded by OV head keeps this rank's heads (every rank's QK patterns)."""

    position: torch.Tensor
    head: torch.Tensor
    value: torch.Tensor
    pattern: torch.Tensor
    group: int
    w_v: torch.Tensor


class LorsaSplice(SpliceIntervention):
    """One role of a Lorsa splice at one layer (module docstring)."""

    registered_name = "lorsa_splice"
    tensor_fields = ("error",)
    spec_unique = True
    _holds, _load = "a Lorsa", staticmethod(load_lorsa)  # the clt property reads it by path

    def _setup(self, role: str, lorsa_layer: int, from_position: int = 1,
               add_error: bool = False, reset: bool = False, source: str | None = None,
               error: torch.Tensor | None = None, normalize: dict | None = None,
               session: str | None = None, error_from: str | None = None,
               heads_off: list[int] | None = None, leaves: bool = False) -> None:
        source = source if source is not None else self._source_of()
        self._check_roles(role, from_position, error, add_error, error_from)
        if leaves and (error is not None or add_error or heads_off):
            raise InputError("a leaf-mode Lorsa splice keeps its error as a leaf: no error, "
                             "add_error or heads_off with it")
        self._set_tensor("error", error)
        self._config = {"role": role, "lorsa_layer": int(lorsa_layer),
                        "from_position": int(from_position), "add_error": bool(add_error),
                        "reset": bool(reset), "source": source,
                        "normalize": None if normalize is None else dict(normalize),
                        "session": self._session_id(session, source), "error_from": error_from,
                        "heads_off": sorted(int(h) for h in heads_off or []),
                        "leaves": bool(leaves)}

    # -- spec entry ------------------------------------------------------------------------
    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False, "required": ["lorsa"], "properties": {
            "type": True,
            "lorsa": {"type": "string", "minLength": 1,
                      "description": "A llamascopium Lorsa directory (config.json + "
                                     "sae_weights.safetensors) or a directory of them."},
            "layers": {"$ref": "#/$defs/layers", "default": "all",
                       "description": "Spliced layers: among those the Lorsa set has."},
            "from_position": {"type": "integer", "minimum": 0, "default": 1,
                              "description": "First spliced position; 1 leaves BOS alone."},
            "add_error": {"type": "boolean", "default": False,
                          "description": "Add the frozen error so the forward is exact."},
            "error": {"enum": ["clean"],
                      "description": "Hold each layer's error at the clean run's (out - recon "
                                     "on the prompt), so turning heads off changes the output "
                                     "by what they wrote."},
            "heads_off": {"type": "array", "items": {"type": "integer", "minimum": 0},
                          "uniqueItems": True,
                          "description": "OV heads zeroed at every spliced layer."}}}

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        key = ("lorsa", entry["lorsa"])
        if key not in ctx.cache:
            try:
                ctx.cache[key] = load_lorsa(entry["lorsa"], device=ctx.bound.device)
            except (OSError, ValueError) as error:
                raise SpecError(ctx.path(index, "lorsa"), str(error)) from None
        lorsa = ctx.cache[key]
        try:
            check_lorsa_fits(ctx.bound, lorsa)
        except InputError as error:
            raise SpecError(ctx.path(index, "lorsa"), str(error)) from None
        layers = resolve_layers(entry.get("layers", "all"), ctx.bound.n_layers,
                                ctx.path(index, "layers"))
        missing = sorted(set(layers) - set(lorsa.layers))
        if entry.get("layers", "all") == "all":
            layers = sorted(lorsa.layers)
        elif missing:
            raise SpecError(ctx.path(index, "layers"), f"no Lorsa for layer(s) {missing}; the "
                                                       f"set has {sorted(lorsa.layers)}")
        heads = entry.get("heads_off", [])
        for layer in layers:
            if heads and max(heads) >= lorsa[layer].cfg.n_ov_heads:
                raise SpecError(ctx.path(index, "heads_off"), f"head {max(heads)} is outside "
                                f"layer {layer}'s {lorsa[layer].cfg.n_ov_heads} OV heads")
        errors = None
        if entry.get("error") == "clean":
            errors = clean_lorsa_errors(ctx.model, lorsa,
                                        ctx.prompt.input_ids.to(ctx.bound.device),
                                        entry.get("from_position", 1))
        reps = lorsa_splice_representations(
            ctx.model, lorsa, layers=layers, from_position=entry.get("from_position", 1),
            add_error=entry.get("add_error", False), errors=errors, heads_off=heads)
        return [Site(index, rep["component"], rep["intervention"].config()["lorsa_layer"],
                     where=ctx.path(index, "lorsa"), made=rep["intervention"]) for rep in reps]

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        return site.made

    def to_spec(self, site: Site) -> dict[str, Any]:
        config = self._config
        if self.error is not None and config["error_from"] is None:
            raise InputError("this splice holds an error tensor of its caller's; a spec can "
                             "name only the clean run's errors ('error': 'clean')")
        return {"type": self.registered_name, "lorsa": config["source"],
                "layers": [config["lorsa_layer"]], "from_position": config["from_position"],
                "add_error": config["add_error"],
                **({"error": "clean"} if config["error_from"] else {}),
                **({"heads_off": config["heads_off"]} if config["heads_off"] else {})}

    # -- the forward ---------------------------------------------------------------------------
    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        config, session = self._config, self.session
        layer, start = config["lorsa_layer"], config["from_position"]
        self._whole_sequence(base.shape[1])
        if config["role"] == "encode" and config["reset"]:
            session.clear()
        if config.get("leaves"):
            return self._leaf_forward(base, layer, start)
        if config["role"] == "encode":
            x = hook_value(base, config["normalize"])
            acts = self.clt[layer].encode(x)
            acts = torch.cat([torch.zeros_like(acts[:, :start]), acts[:, start:]], dim=1)
            if config["heads_off"]:
                acts = acts.clone()
                acts[..., config["heads_off"]] = 0
            session.acts[layer] = session.encoded[layer] = acts
            session.inputs[layer] = x
            return base
        if layer not in session.acts:
            raise InputError(f"the Lorsa decoder of layer {layer} needs its encoder, placed "
                             "before it in the same forward")
        _refuse_partial_attention(base, layer)
        recon = self.clt[layer].decode(session.acts[layer]).to(base.dtype)
        held = self.error
        if config["add_error"]:
            recon = recon + (base - recon).detach()
        elif held is not None:
            if held.shape[-2] < base.shape[1]:
                raise InputError(f"the fixed error of layer {layer} covers {held.shape[-2]} "
                                 f"positions and the sequence has {base.shape[1]}")
            recon = recon + held[..., :base.shape[1], :].to(base.dtype)
        return torch.cat([base[:, :start], recon[:, start:]], dim=1)


    def _leaf_forward(self, base: torch.Tensor, layer: int, start: int) -> torch.Tensor:
        """The leaf mode (module docstring); leaves in ``session.leaves``: ``heads``,
        ``inputs``, ``errors`` and ``b_D`` by layer."""
        leaves = self.session.leaves
        if not leaves:
            leaves.update({"heads": {}, "inputs": {}, "errors": {}, "b_D": {}})
        lorsa = self.clt[layer]
        if self._config["role"] == "encode":
            x = hook_value(base, self._config["normalize"], frozen=True)
            with torch.no_grad():
                pattern, _ = lorsa.attention(x)
                acts = lorsa.encode(x, pattern)
                acts[:, :start] = 0
                _, position, head = acts.nonzero(as_tuple=True)
            value = acts[0, position, head].detach().requires_grad_(True)
            leaves["heads"][layer] = LorsaHeads(position, head + lorsa.head_offset, value,
                                                pattern[0], lorsa.cfg.group, lorsa.W_V[head])
            leaves["inputs"][layer] = x
            return base
        heads = leaves["heads"][layer]
        bias = lorsa.b_D if lorsa.cfg.use_decoder_bias else lorsa.W_O.new_zeros(lorsa.cfg.d_model)
        leaves["b_D"][layer] = bias = bias.detach().clone().requires_grad_(True)
        acts = heads.value.new_zeros(base.shape[1], lorsa.n_local)
        acts = acts.index_put((heads.position, heads.head - lorsa.head_offset), heads.value)
        written = acts.to(lorsa.dtype) @ lorsa.W_O
        if lorsa.heads is not None:  # a shard: every rank's heads write this layer
            written = _summed_over_ranks(written, layer)
        recon = (written + bias)[None].to(base.dtype)
        error = (base - recon).detach().requires_grad_(True)
        leaves["errors"][layer] = error
        spliced = recon + error
        return base.detach() + (spliced - spliced.detach())


def _refuse_partial_attention(base: torch.Tensor, layer: int) -> None:
    """Refuse a forward whose attention is not plain causal over what the splice is handed
    (read from the announced call's ``cache`` and ``attention_mask``; none announced, nothing
    to read): earlier positions held in a KV cache (``generate``'s steps), or a mask that
    hides earlier positions other than a sliding window's (padding). A Lorsa attends over
    every earlier position it is handed: its reconstruction there would be another
    sequence's."""
    call = pyvene_call()
    kwargs = {} if call is None else call.kwargs
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    held, n_pos = (cache.get_seq_length(layer) if hasattr(cache, "get_seq_length") else 0,
                   base.shape[1])
    if held > n_pos:
        raise InputError(f"layer {layer}'s attention is handed {n_pos} of the {held} "
                         "positions (the rest in its KV cache, a cached generation step); a "
                         "Lorsa splice attends over every position: generate with "
                         "use_cache=False, or run the whole sequence")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2:] == (n_pos, n_pos):
        kept = mask if mask.dtype == torch.bool else mask == 0  # additive: 0 where attended
        back = torch.arange(n_pos, device=mask.device)
        back = back[:, None] - back[None, :]  # how far back each key is
        hidden = (back >= 0) & ~kept
        # the model's sliding window hides every key from some distance on (the Lorsa's own
        # attention is not the model's: that is no concern of its); padding hides others
        window = back.expand_as(hidden)[hidden].min() if hidden.any() else None
        if window is not None and not torch.equal(hidden, (back >= window).expand_as(hidden)):
            raise InputError(f"layer {layer}'s attention mask hides earlier positions (padding); "
                             "a Lorsa splice attends over every earlier position: run each "
                             "prompt alone, unpadded")


def _summed_over_ranks(written: torch.Tensor, layer: int) -> torch.Tensor:
    """What every rank's OV heads write (one sum over ranks): the value the sum, the gradient
    this rank's head leaves' alone (as a sharded transcoder's features', :mod:`.splice_math`)."""
    ranks = current()
    if ranks is None:
        raise InputError(LORSA_SUM_ALONE)
    total = ranks.all_reduce(written, f"summing layer {layer}'s Lorsa output over ranks")
    return total + (written - written.detach())


@torch.no_grad()
def clean_lorsa_errors(model, lorsa: LorsaSet, input_ids: torch.Tensor,
                       from_position: int = 1) -> dict[int, torch.Tensor]:
    """The clean run's ``out - recon`` per spliced layer, ``{layer: [1, P, D]}``, features
    before ``from_position`` zero (as the splice encodes them)."""
    states = lorsa_states(model, lorsa, input_ids)
    out = {}
    for layer in lorsa.layers:
        acts = lorsa[layer].encode(states["input"][layer][None])
        acts[:, :from_position] = 0
        recon = lorsa[layer].decode(acts)
        out[layer] = states["output"][layer][None] - recon.to(states["output"].dtype)
    return out


def lorsa_splice_representations(
    model: nn.Module | BoundModel, lorsa: LorsaSet, *, layers: list[int] | None = None,
    from_position: int = 1, add_error: bool = False,
    errors: dict[int, torch.Tensor] | None = None, heads_off: list[int] | None = None,
    session: SpliceSession | None = None, leaves: bool = False,
) -> list[dict]:
    """pyvene representation dicts that splice ``lorsa`` into ``model`` at ``layers`` (all the
    set has, by default): an encoder per layer, then the decoders (module docstring).
    ``errors`` (:func:`clean_lorsa_errors`) holds the clean run's errors fixed; ``heads_off``
    zeroes those OV heads at every spliced layer; ``leaves=True``: the attribution graph's
    leaf mode (module docstring)."""
    bound = bind(model)
    check_lorsa_fits(bound, lorsa)
    layers = sorted(lorsa.layers) if layers is None else sorted(layers)
    missing = sorted(set(layers) - set(lorsa.layers))
    if missing:
        raise InputError(f"no Lorsa for layer(s) {missing}; the set has {sorted(lorsa.layers)}")
    if add_error and errors is not None:
        raise InputError("add_error makes the forward the original one; errors= replaces it")
    for layer in layers:  # a negative head would wrap to another one
        n_ov = lorsa.layers[layer].cfg.n_ov_heads
        for head in heads_off or []:
            if not 0 <= head < n_ov:
                raise InputError(f"heads_off {head} is outside layer {layer}'s {n_ov} OV heads "
                                 f"(0..{n_ov - 1})")
    session = SpliceSession() if session is None else session
    common = {"clt": lorsa, "session": session, "from_position": from_position,
              "add_error": add_error, "heads_off": heads_off,
              "error_from": "clean" if errors is not None else None, "leaves": leaves}
    out = [{"component": hook_component(bound.adapter, INPUT_HOOK, layer),
            "intervention": LorsaSplice(role="encode", lorsa_layer=layer, reset=index == 0,
                                        normalize=norm_settings(bound, INPUT_HOOK, layer),
                                        **common)}
           for index, layer in enumerate(layers)]
    out.extend({"component": hook_component(bound.adapter, OUTPUT_HOOK, layer),
                "intervention": LorsaSplice(role="decode", lorsa_layer=layer, **common,
                                            error=None if errors is None else errors[layer])}
               for layer in layers)
    return out
