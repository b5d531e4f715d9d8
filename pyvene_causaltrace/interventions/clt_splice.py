"""``clt_splice``: run a transcoder (cross-layer or a per-layer set) inside the model.

A splice is two registered interventions per layer, built by :func:`clt_splice_representations`:

- ``role="encode"`` on the transcoder's input hook (``hook_resid_mid``, or the MLP's normalised
  input): computes the layer's features (zero before ``from_position``) and keeps them, with the
  hook's value (for a skip path), in the splice's :class:`SpliceSession`;
- ``role="decode"`` on its output hook (``hook_mlp_out``): replaces positions
  ``>= from_position`` by ``b_dec[t] + sum_{l writing t} a_l @ W_dec[l][:, t - l] + skip_t(x_t)``
  plus one error term: with ``add_error`` the frozen ``(out - recon).detach()`` (the forward is
  the original one, gradients flow through the features); a fixed ``error`` ``[1, P, D]`` (the
  clean run's, :func:`clean_errors`: ablating features changes the output, the part the
  dictionary misses stays); or, with ``live_error``, the hook's own value plus what changed
  features change, ``out + sum_l (a'_l - a_l) @ W_dec`` (the model itself wherever no feature
  changed, as circuit-tracer's feature interventions run). A fixed error with ``live_error``
  covers the prompt's positions and the live one every later (generated) position; without
  ``live_error`` a sequence longer than the fixed error is refused.

With ``leaves=True`` (the attribution graph's local replacement model) each layer's active
features are one autograd leaf vector (:class:`ActiveFeatures`, cut from the residual stream),
and the decoder builds every position from them, a ``b_dec`` leaf, the skip path of the live
input and the error ``out - recon`` as a leaf constant: the forward is the original one, and
``torch.autograd.grad`` on the leaves gives each feature's, error's and bias's direct effect.
The encoder keeps its input live so each feature's pre-activation can be a gradient target.
Features before ``from_position`` are zero, but the decoder covers every position (the error
carries BOS exactly).

A ``joint_topk`` transcoder ranks features over all layers at once, so its splice holds a fixed
``selection`` (:func:`clean_selection`) and is refused without one (docs/transcoders.md).
``feature_ablate`` (:mod:`.feature_ablate`) sits on the input hook after the encoder. The
default ``from_position=1`` never splices BOS (no dictionary is trained on the attention sink,
and splicing it wrecks the model); without a BOS callers splice from 0
(:func:`~..prompts.first_position`).

One splice's interventions share a :class:`SpliceSession` (pass ``session=``, or read
``splice_session(reps)``), never stored on the transcoder; how interventions built one by one or
loaded find it again, and their transcoder by its path: :mod:`.splice_session`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..bound import BoundModel, bind
from ..distributed import current
from ..errors import InputError, SpecError
from ..locations import resolve_layers
from ..transcoders.formats import load_transcoder
from ..transcoders.hooks import hook_value, norm_settings, transcoder_states
from ..transcoders.transcoder import check_fits
from .feature_ablate import FeatureAblate
from .spec_entry import Site, SpecContext
from .splice_math import (
    SHARD_ALONE,
    ActiveFeatures,
    ablation_change,
    joint_selection,
    leaf_writes,
    reconstruct,
    summed_over_ranks,
)
from .splice_session import SpliceIntervention, SpliceSession

# FeatureAblate and the splice's shared base used to live here: they stay importable from here
__all__ = ["ActiveFeatures", "CLTSplice", "FeatureAblate", "SpliceSession", "clean_errors",
           "clean_selection", "clt_splice_representations", "splice_session"]


def splice_session(representations: list[dict]) -> SpliceSession:
    """The session of the splice in ``representations`` (from
    :func:`clt_splice_representations`)."""
    for rep in representations:
        intervention = rep["intervention"]
        if isinstance(intervention, SpliceIntervention):
            return intervention.session
    raise InputError("no clt_splice among these representations")


class CLTSplice(SpliceIntervention):
    """One role of a CLT splice at one layer (see module docstring)."""

    registered_name = "clt_splice"
    tensor_fields = ("error",)

    def _setup(self, role: str, clt_layer: int, from_position: int = 1, add_error: bool = False,
               reset: bool = False, leaves: bool = False, source: str | None = None,
               error: torch.Tensor | None = None, normalize: dict | None = None,
               session: str | None = None, live_error: bool = False,
               error_from: str | None = None) -> None:
        source = source if source is not None else self._source_of()
        self._check_roles(role, from_position, error, add_error, error_from)
        if live_error and (add_error or leaves):
            raise InputError("live_error replaces add_error (and leaf mode's error): give one")
        self._set_tensor("error", error)
        self._config = {"role": role, "clt_layer": int(clt_layer),
                        "from_position": int(from_position), "add_error": bool(add_error),
                        "reset": bool(reset), "leaves": bool(leaves), "source": source,
                        "normalize": None if normalize is None else dict(normalize),
                        "session": self._session_id(session, source),
                        "live_error": bool(live_error), "error_from": error_from}

    # -- spec entry: one entry is the whole splice (every layer's encoder and decoder, with the
    # spec's feature_ablate entries after their layer's encoder), sharing one session
    spec_unique = True

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False, "required": ["clt"], "properties": {
            "type": True,
            "clt": {"type": "string", "minLength": 1,
                    "description": "The transcoder: an mntss CLT directory, a circuit-tracer "
                                   "config.yaml, a GemmaScope / sae-lens / sparsify directory, "
                                   "or a hub id (layout detected)."},
            "layers": {"$ref": "#/$defs/layers", "default": "all"},
            "from_position": {"type": "integer", "minimum": 0, "default": 1,
                              "description": "First spliced position; 1 leaves BOS alone."},
            "add_error": {"type": "boolean", "default": False,
                          "description": "Add the frozen error so the forward is exact."},
            "error": {"enum": ["clean", "live"],
                      "description": "The error term when features are changed "
                                     "(feature_ablate): 'clean' holds each layer's error at the "
                                     "clean run's (out - recon on the prompt), 'live' keeps the "
                                     "model's own MLP output plus what the changed features "
                                     "change (circuit-tracer's feature interventions). Absent: "
                                     "the reconstruction alone (or add_error's)."}}}

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        key = ("transcoder", entry["clt"])
        if key not in ctx.cache:  # read once per run
            try:
                ctx.cache[key] = load_transcoder(entry["clt"], device=ctx.bound.device)
            except (OSError, ValueError) as error:
                raise SpecError(ctx.path(index, "clt"), str(error)) from None
        clt = ctx.cache[key]
        layers = resolve_layers(entry.get("layers", "all"), clt.n_layers,
                                ctx.path(index, "layers"))
        from_position = entry.get("from_position", 1)
        ablations = []
        for k, item in enumerate(ctx.spec.interventions):
            if item.type == "feature_ablate":
                _check_ablation(item.fields, ctx.path(k), clt, layers, from_position,
                                ctx.prompt.seq_len)
                ablations.append(dict(item.fields))
        error = entry.get("error")
        selection = None
        if clt.cfg.joint:  # the clean prompt's joint top-k, held fixed (module docstring)
            selection = clean_selection(ctx.model, clt, ctx.prompt.input_ids.to(ctx.bound.device))
        reps = clt_splice_representations(
            ctx.model, clt, layers=layers, from_position=from_position,
            add_error=entry.get("add_error", False), ablations=ablations,
            live_error=error is not None, error_from="clean" if error == "clean" else None,
            selection=selection)
        return [Site(index, rep["component"], rep["intervention"].config()["clt_layer"],
                     where=ctx.path(index, "clt"), made=rep["intervention"]) for rep in reps]

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        made = site.made
        config = made.config() if isinstance(made, CLTSplice) else {}
        if config.get("error_from") == "clean" and config["role"] == "decode":
            # the clean run's errors, computed once for the whole splice
            key = ("clean_errors", config["source"], config["from_position"])
            if key not in ctx.cache:
                ctx.cache[key] = clean_errors(ctx.model, made.clt,
                                              ctx.prompt.input_ids.to(ctx.bound.device),
                                              config["from_position"])
            made._set_tensor("error", ctx.cache[key][config["clt_layer"]])
        return made

    def to_spec(self, site: Site) -> dict[str, Any]:
        config = self._config
        error = config["error_from"] or ("live" if config["live_error"] else None)
        if self.error is not None and config["error_from"] is None:
            raise InputError("this splice holds an error tensor of its caller's; a spec can "
                             "name only the clean run's errors ('error': 'clean')")
        return {"type": self.registered_name, "clt": config["source"],
                "layers": [config["clt_layer"]], "from_position": config["from_position"],
                "add_error": config["add_error"], **({"error": error} if error else {})}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        clt, layer = self.clt, self._config["clt_layer"]
        start = self._config["from_position"]
        session = self.session
        self._whole_sequence(base.shape[1])
        if self._config["reset"] and self._config["role"] == "encode":
            session.clear()
        if self._config["leaves"]:
            if not session.leaves:
                session.leaves.update({"features": {}, "writes": {}, "errors": {}, "inputs": {}})
            return self._leaf_forward(base, clt, layer, start, session.leaves)
        if self._config["role"] == "encode":
            x = self._input(base)
            acts = clt.encode(x, layer, joint_selection(clt, session, layer, x))
            acts = torch.cat([torch.zeros_like(acts[:, :start]), acts[:, start:]], dim=1)
            session.acts[layer] = session.encoded[layer] = acts
            session.inputs[layer] = x
            return base
        if layer not in session.inputs:
            raise InputError(f"the decoder of layer {layer} needs its encoder, placed before "
                             "it in the same forward")
        n_pos, held = base.shape[1], self.error
        live = None
        if self._config["live_error"]:
            change = ablation_change(clt, layer, session)
            live = base if change is None else base + change.to(base.dtype)
            if held is None:
                return torch.cat([base[:, :start], live[:, start:]], dim=1)
        elif held is not None and held.shape[-2] < n_pos:
            raise InputError(f"the fixed error of layer {layer} covers {held.shape[-2]} "
                             f"positions and the sequence has {n_pos}: give the error of this "
                             "sequence, or live_error=True for the positions past it")
        recon = reconstruct(clt, layer, session, base)
        if self._config["add_error"]:
            recon = recon + (base - recon).detach()
        elif held is not None:
            n_held = min(held.shape[-2], n_pos)
            recon = recon[:, :n_held] + held[..., :n_held, :].to(base.dtype)
            if live is not None and n_held < n_pos:
                recon = torch.cat([recon, live[:, n_held:]], dim=1)
        return torch.cat([base[:, :start], recon[:, start:]], dim=1)

    def _input(self, base: torch.Tensor, frozen: bool = False) -> torch.Tensor:
        """The transcoder's input from the hook's value: itself, or normalised before the
        norm's gain (``ln2.hook_normalized``; frozen statistic in leaf mode)."""
        return hook_value(base, self._config.get("normalize"), frozen)

    def _leaf_forward(self, base: torch.Tensor, transcoder, layer: int, start: int,
                      leaves: dict) -> torch.Tensor:
        if self._config["role"] == "encode":
            x = self._input(base, frozen=True)
            with torch.no_grad():
                chosen = joint_selection(transcoder, self.session, layer, x)
                acts = transcoder.encode(x, layer, chosen)
                acts[:, :start] = 0
                row, position, feature = acts.nonzero(as_tuple=True)
            value = acts[row, position, feature].detach().requires_grad_(True)
            active = ActiveFeatures(
                row, position, feature, value, functools.partial(transcoder.decoder_rows, layer),
                transcoder.cfg.n_targets(layer) * transcoder.cfg.d_model * value.element_size())
            leaves["features"][layer] = active
            leaves["writes"][layer] = leaf_writes(active, base.shape[:2],
                                              transcoder.cfg.n_targets(layer),
                                              transcoder.cfg.d_model)
            leaves["inputs"][layer] = x
            if "b_dec" not in leaves:
                leaves["b_dec"] = transcoder.b_dec.detach().clone().requires_grad_(True)
            return base
        recon = leaves["b_dec"][layer].expand(base.shape)
        recon = recon + transcoder.skip(leaves["inputs"][layer], layer)
        written = None
        for source_layer in transcoder.cfg.sources(layer):
            if leaves["writes"].get(source_layer) is not None:
                part = leaves["writes"][source_layer][layer - source_layer]
                written = part if written is None else written + part
        if transcoder.features is not None:  # a shard: every rank's features write this layer
            written = summed_over_ranks(written, recon, layer)
        if written is not None:
            recon = recon + written
        recon = recon.to(base.dtype)
        error = (base - recon).detach().requires_grad_(True)
        leaves["errors"][layer] = error
        spliced = recon + error
        # the value is the model's own output exactly (recon + (base - recon) rounds); the
        # gradient is the splice's: a forward that does not depend on how recon was summed
        return base.detach() + (spliced - spliced.detach())


def _check_ablation(entry: dict, path: str, transcoder, layers: list[int], from_position: int,
                    n_pos: int) -> None:
    """A spec's feature_ablate entry names a spliced layer, features the transcoder has and
    spliced positions of the prompt (otherwise it would act nowhere, without a word)."""
    if entry["clt_layer"] not in layers:
        raise SpecError(f"{path}.clt_layer", f"layer {entry['clt_layer']} is not spliced (the "
                                             f"clt_splice entry splices layers {layers})")
    features = entry["features"]
    if features != "all" and max(features) >= transcoder.cfg.d_transcoder:
        raise SpecError(f"{path}.features", f"feature {max(features)} is outside the "
                                            f"transcoder's {transcoder.cfg.d_transcoder} per layer")
    for position in entry.get("positions") or []:
        if position >= n_pos:
            raise SpecError(f"{path}.positions", f"position {position} is outside the prompt's "
                                                 f"{n_pos} tokens")
        if position < from_position:
            raise SpecError(f"{path}.positions", f"position {position} is before the splice's "
                                                 f"from_position {from_position}, which it "
                                                 "leaves alone")


def clean_errors(model, transcoder, input_ids: torch.Tensor,
                 from_position: int = 1) -> torch.Tensor:
    """The clean run's transcoder error ``out - recon`` per layer, ``[L, 1, P, D]``, for a
    splice with a fixed error that starts at ``from_position`` (features before it zero)."""
    states = transcoder_states(model, transcoder, input_ids)
    inputs = states["input"].to(transcoder.dtype)
    acts = transcoder.encode_all(inputs, zero_bos=False)
    acts[:, :from_position] = 0
    recon = transcoder.reconstruct(acts, inputs)
    return (states["output"] - recon.to(states["output"].dtype))[:, None]


def clean_selection(model, transcoder, input_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[L, P, F]``: the features a ``joint_topk`` transcoder keeps on the clean run of
    ``input_ids [1, P]`` (its joint top-k over every layer's input at each position), for a
    splice that holds them fixed (a shard's ``[L, P, n_local]``: a collective over the ranks)."""
    with torch.no_grad():
        inputs = transcoder_states(model, transcoder, input_ids[:1])["input"]
        return transcoder.joint_selection(inputs.to(transcoder.dtype))


def clt_splice_representations(
    model: nn.Module | BoundModel, transcoder, *, layers: list[int] | None = None,
    from_position: int = 1,
    add_error: bool = False, ablations: list[dict] | None = None, leaves: bool = False,
    errors: torch.Tensor | None = None, session: SpliceSession | None = None,
    live_error: bool = False, error_from: str | None = None,
    selection: torch.Tensor | None = None,
) -> list[dict]:
    """pyvene representation dicts that splice ``transcoder`` into ``model`` at ``layers`` (all by
    default), with ``ablations`` (``feature_ablate`` keyword dicts with ``clt_layer``) after
    their layer's encoder; ``leaves=True``: the attribution graph's leaf-mode splice. The error
    term (module docstring): ``add_error``, ``errors`` (``[L, 1, P, D]``, :func:`clean_errors`)
    and/or ``live_error``; ``error_from="clean"`` says ``errors`` are the clean run's, so a spec
    can name them. The interventions share ``session`` (a new :class:`SpliceSession` by default;
    :func:`splice_session` finds it); a ``joint_topk`` transcoder needs ``selection`` (bool
    ``[L, P, F]``, :func:`clean_selection`)."""
    if leaves and ablations:
        raise InputError("a leaf-mode splice does not take ablations")
    bound = bind(model)
    check_fits(bound, transcoder)
    if transcoder.features is not None and not (leaves and current() is not None):
        raise InputError(SHARD_ALONE if current() is None else
                         "a transcoder sharded by feature splices the attribution graph's "
                         "local replacement model only (attribute under torchrun); steering, "
                         "checks and specs take the whole transcoder")
    session = SpliceSession() if session is None else session
    if selection is not None:
        if not transcoder.cfg.joint:
            raise InputError(f"selection= is for a joint_topk transcoder; this one is "
                             f"{transcoder.cfg.activation}, selected per layer")
        want = (transcoder.n_layers, transcoder.n_local)  # a shard's part: its features
        if selection.dtype != torch.bool or (selection.shape[0], selection.shape[-1]) != want:
            raise InputError(f"selection must be bool [L, P, F] with L, F = {want}, got "
                             f"{selection.dtype} {tuple(selection.shape)}")
        session.selection = selection
    layers = list(range(transcoder.n_layers)) if layers is None else sorted(layers)
    for ablation in ablations or []:
        if ablation.get("clt_layer") not in layers:
            raise InputError(f"an ablation names layer {ablation.get('clt_layer')!r}, which is "
                             f"not spliced (layers {layers})")
    common = {"clt": transcoder, "session": session, "from_position": from_position,
              "add_error": add_error or leaves, "leaves": leaves, "live_error": live_error,
              "error_from": error_from}
    out = []
    for index, layer in enumerate(layers):
        hooks = transcoder.cfg.hf_hooks(bound.adapter, layer)
        out.append({"component": hooks["input"], "intervention": CLTSplice(
            role="encode", clt_layer=layer, reset=index == 0, **common,
            normalize=norm_settings(bound, transcoder.cfg.feature_input_hook, layer))})
        out.extend({"component": hooks["input"], "intervention": FeatureAblate(
            clt=transcoder, session=session, **ablation)}
            for ablation in ablations or [] if ablation["clt_layer"] == layer)
    out.extend({"component": transcoder.cfg.hf_hooks(bound.adapter, layer)["output"],
                "intervention": CLTSplice(role="decode", clt_layer=layer, **common,
                                          error=None if errors is None else errors[layer])}
               for layer in layers)
    return out
