"""The local replacement model: the original forward, rebuilt so it is linear in its leaves.

Built only from registered interventions, applied by our hook runner
(:func:`~pyvene_causaltrace.runtime.intervened`, pyvene's numbers without an ``IntervenableModel``):

- ``gradient_leaf`` on the embedding output(s): token nodes;
- ``clt_splice`` in leaf mode at every layer: active features and ``b_dec`` as leaves, every
  MLP output = reconstruction + skip path + error, the error a leaf constant; a ``joint_topk``
  transcoder's features are those its joint top-k keeps on the clean run
  (:func:`~..interventions.clt_splice.clean_selection`), held fixed, valued from the live input;
- with ``freeze=True``: ``frozen_layernorm`` on every residual-path norm, ``frozen_attention``
  on every attention module.

The forward value is the clean model's (to float rounding), before any final logit soft-cap
(not linear; the graph explains the pre-cap logits, as circuit-tracer's does). Under the freezes
the logits are linear in the leaves plus the model's additive constants (biases, ``b_dec``), so
``sum_i x_i * d target / d x_i`` over them equals the target exactly: the closure check.
Inside :func:`~pyvene_causaltrace.pyvene_boundary.user_edits.applied_interventions`, each user
intervention ``f(x) = A x + c`` keeps its linear part in the forward and its constant ``c =
f(0)`` becomes a leaf: ``run.steering``, the graph's steering nodes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ..applier import Call, Edit, Site, applying, reader
from ..arguments import checked
from ..bound import BoundModel, bind
from ..distributed import current
from ..errors import InputError
from ..interventions.clt_splice import (
    SHARD_ALONE,
    ActiveFeatures,
    SpliceSession,
    clean_selection,
    clt_splice_representations,
)
from ..interventions.frozen import FrozenAttention, FrozenLayerNorm, frozen_qk_norms
from ..interventions.leaf import GradientLeaf
from ..interventions.lorsa_splice import lorsa_splice_representations
from ..pyvene_boundary.steering import SteeringLeaf, collect_steering
from ..runtime import intervened
from ..transcoders.lorsa import LorsaSet
from ..transcoders.transcoder import Transcoder, check_fits
from .lorsa_nodes import lorsa_leaves
from .reading import Layout
from .settings import AttributionSettings
from .sharded import FeatureShard, globalize


@dataclass
class ReplacementRun:
    """One forward of the local replacement model: live outputs and every leaf.

    Feature nodes are ordered layer, then position, then feature id (``feature_layer`` etc.,
    ``activation`` their values). ``logits`` are the last position's, ``[1, 1, V]`` (every
    logit target reads it; all positions' when a state ``"unembed_input"`` is kept).
    ``errors[l]``, ``embeddings`` (token, and position, embedding
    outputs) and ``encoder_inputs[l]`` (the live input of layer ``l``'s encoders) are ``[1, P,
    D]``; ``constants`` the model's bias parameters; ``steering`` one node per (user
    intervention call, position where its constant is nonzero), between errors and tokens."""

    input_ids: torch.Tensor
    logits: torch.Tensor
    features: list[ActiveFeatures]
    errors: list[torch.Tensor]
    embeddings: list[torch.Tensor]
    b_dec: torch.Tensor
    constants: list[torch.Tensor]
    encoder_inputs: list[torch.Tensor]
    encoder_rows: torch.Tensor
    forward_bytes: int
    #: Of ``forward_bytes``, the saved tensors ``[..., P, P]`` (attention patterns, masks).
    pattern_bytes: int = 0
    logit_softcap: float | None = None
    steering: list[SteeringLeaf] = field(default_factory=list)
    #: Live residual-stream states a direction target reads, by output name
    #: (``"unembed_input"``, ``"resid_pre.{l}"``).
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    #: ``"drop"``: the errors at position 0 (BOS) are constants, not nodes (circuit-tracer's
    #: convention); ``"keep"``: they are nodes.
    bos_errors: str = AttributionSettings.bos_errors
    #: With a transcoder sharded by feature: which of the graph's feature nodes this rank holds
    #: (``features`` and ``feature_values`` are this rank's, the ``feature_*``, ``activation``
    #: and ``encoder_rows`` the whole graph's, :mod:`.sharded`).
    shard: FeatureShard | None = None
    #: With a Lorsa sharded by OV head beside it: every rank's active heads (the graph's Lorsa
    #: nodes; ``lorsa_heads`` are this rank's).
    lorsa_nodes: int | None = None
    #: The dtype the forward ran in (:mod:`.precision`; None: the model's, float32's closure
    #: tolerance).
    compute_dtype: torch.dtype | None = None
    #: With ``attention=`` a Lorsa set (:mod:`.lorsa_nodes`): its layers, and per layer its
    #: active OV heads (feature nodes after the transcoder's), its error leaf ``[1, P, D]``
    #: (error nodes after the MLP errors), its live input ``[1, P, D]`` and its ``b_D`` leaf.
    lorsa_layers: list[int] = field(default_factory=list)
    lorsa_heads: list = field(default_factory=list)
    lorsa_errors: list[torch.Tensor] = field(default_factory=list)
    lorsa_inputs: list[torch.Tensor] = field(default_factory=list)
    lorsa_biases: list[torch.Tensor] = field(default_factory=list)
    feature_layer: torch.Tensor = field(init=False)
    feature_position: torch.Tensor = field(init=False)
    feature_id: torch.Tensor = field(init=False)
    activation: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        heads = self.lorsa_heads
        self.feature_layer = torch.cat(
            [torch.full_like(f.position, layer) for layer, f in enumerate(self.features)]
            + [torch.full_like(h.position, layer)
               for layer, h in zip(self.lorsa_layers, heads, strict=True)])
        self.feature_position = torch.cat([f.position for f in self.features]
                                          + [h.position for h in heads])
        self.feature_id = torch.cat([f.feature for f in self.features] + [h.head for h in heads])
        self.activation = torch.cat([v.detach() for v in self.feature_values]
                                    + [h.value.detach().to(self.features[0].value.dtype)
                                       for h in heads])

    @property
    def n_transcoder_features(self) -> int:
        """Feature nodes ``[0, n)`` are the transcoder's (every rank's, with a sharded one), the
        rest Lorsa OV heads."""
        heads = self.lorsa_nodes
        if heads is None:
            heads = sum(int(h.value.numel()) for h in self.lorsa_heads)
        return self.n_features - heads

    def output(self, name: str) -> torch.Tensor:
        """The live output a target reads: ``"logits"`` or a captured state."""
        if name == "logits":
            return self.logits
        if name not in self.states:
            raise InputError(f"the replacement run did not capture {name!r} (captured: "
                             f"{', '.join(self.states) or 'nothing'})")
        return self.states[name]

    @property
    def feature_values(self) -> list[torch.Tensor]:
        """The feature leaves, one tensor per layer."""
        return [f.value for f in self.features]

    @property
    def n_features(self) -> int:
        return int(self.activation.numel())

    @property
    def steering_leaves(self) -> list[SteeringLeaf]:
        """The steering constants that are gradient leaves (those recorded where no gradient
        runs, inside a recomputed module, are not nodes)."""
        return [s for s in self.steering if s.leaf is not None]

    @property
    def steering_positions(self) -> list[torch.Tensor]:
        """Per steering leaf, the positions where its constant is nonzero: its nodes."""
        return [s.positions for s in self.steering_leaves]

    @property
    def n_steering(self) -> int:
        return sum(len(p) for p in self.steering_positions)

    @property
    def n_columns(self) -> int:
        """Source nodes of a row: features, errors (layer x position), steering, tokens."""
        return (self.n_features + (self.n_layers + len(self.lorsa_layers) + 1) * self.n_pos
                + self.n_steering)

    @property
    def layout(self) -> Layout:
        return Layout(self.n_features, (self.n_layers + len(self.lorsa_layers)) * self.n_pos,
                      self.n_pos, 1, self.n_steering)

    @property
    def decoder_bytes(self) -> int:
        """Bytes of the active features' decoder rows: gathered when needed, not kept
        (:class:`~..interventions.clt_splice.ActiveFeatures`)."""
        return sum(f.value.numel() * f.row_bytes for f in self.features)

    @property
    def n_layers(self) -> int:
        return len(self.errors)

    @property
    def n_pos(self) -> int:
        return int(self.input_ids.shape[1])

    def node_inputs(self) -> list[torch.Tensor]:
        """Leaves whose edges are graph columns: features (one tensor per layer), Lorsa heads
        (one per Lorsa layer), errors, Lorsa errors, steering constants, embeddings."""
        return [*self.feature_values, *[h.value for h in self.lorsa_heads], *self.errors,
                *self.lorsa_errors, *[s.leaf for s in self.steering_leaves], *self.embeddings]

    def inputs(self) -> list[torch.Tensor]:
        """Every tensor the logits depend on linearly: node leaves, then ``b_dec``, the
        Lorsas' ``b_D`` and the model's bias constants."""
        return [*self.node_inputs(), self.b_dec, *self.lorsa_biases, *self.constants]


def _freeze_representations(bound: BoundModel, replaced: set[str] = frozenset(),
                            lorsa_layers: Sequence[int] = ()) -> list[dict]:
    """``frozen_layernorm`` on every norm in the residual path, ``frozen_attention`` on every
    attention module but those a Lorsa replaces (``lorsa_layers``); not on norms whose output
    the splice replaces (``replaced``: Gemma's post-feedforward norm when the transcoder writes
    TransformerLens's ``hook_mlp_out``)."""
    reps, adapter = [], bound.adapter
    for layer in range(bound.n_layers):
        for component in adapter.norm_sites(layer):
            if component not in replaced:
                reps.append({"component": component,
                             "intervention": FrozenLayerNorm(kind=adapter.norm_kind)})
        if layer not in lorsa_layers:
            reps.append({"component": adapter.site("attn_output", layer),
                         "intervention": FrozenAttention()})
    reps.append({"component": adapter.site("final_norm"),
                 "intervention": FrozenLayerNorm(kind=adapter.norm_kind)})
    return reps


@checked
@contextmanager
def pre_softcap_logits(model: BoundModel) -> Iterator[float | None]:
    """Inside the block the model returns its logits before the final soft-cap
    (``cap * tanh(logits / cap)``, Gemma-2), which are linear in the residual stream; yields the
    cap (None without one). The cap is off for this thread alone: other threads' forwards of the
    model keep it (:meth:`~..bound.BoundModel.pre_softcap`, what the package's own runs use)."""
    with bind(model).pre_softcap() as cap:
        yield cap


def check_batch(input_ids: torch.Tensor) -> None:
    """Refuse ``input_ids`` that are not ``[batch, P]``."""
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be [batch, P], got {tuple(input_ids.shape)}")


@checked
def run_local_replacement(
    model: nn.Module | BoundModel, transcoder: Transcoder, input_ids: torch.Tensor, *,
    freeze: bool = AttributionSettings.freeze, from_position: int = 1,
) -> ReplacementRun:
    """Run ``input_ids`` through the local replacement model (module docstring), after checking
    that ``transcoder`` fits ``model`` (:class:`~.replacement_model.ReplacementModel` checks
    once and calls :func:`replacement_forward`). ``freeze=False`` leaves attention patterns and
    norm scales live (the closure check's control); ``logits`` are the pre-soft-cap ones."""
    check_batch(input_ids)
    bound = bind(model)
    check_fits(bound, transcoder)
    return replacement_forward(bound, transcoder, input_ids, freeze=freeze,
                               from_position=from_position)


def replacement_forward(
    bound: BoundModel, transcoder: Transcoder, input_ids: torch.Tensor, *,
    freeze: bool = AttributionSettings.freeze, from_position: int = 1, states: Sequence[str] = (),
    qk_norms: bool = False, lorsa: LorsaSet | None = None,
) -> ReplacementRun:
    """:func:`run_local_replacement` of a ``transcoder`` already checked to fit the bound
    model; ``states`` names residual-stream states to keep live
    (:func:`capturing_states`); ``qk_norms`` freezes the per-head query and key norms as well
    (:func:`~..interventions.frozen.frozen_qk_norms`), which makes the live queries and keys
    linear in the leaves (:mod:`.heads`; edges never see them: queries and keys are detached);
    ``lorsa`` replaces those layers' attention outputs by Lorsa reconstructions
    (:mod:`.lorsa_nodes`)."""
    model, adapter = bound.model, bound.adapter
    if lorsa is not None and lorsa.sharded != (transcoder.features is not None):
        raise InputError(LORSA_SHARDED_ALIKE)
    n_layers = transcoder.n_layers
    embed_leaves = [GradientLeaf()]
    reps = [{"component": adapter.site("embed"), "intervention": embed_leaves[0]}]
    if adapter.position_embed is not None:
        embed_leaves.append(GradientLeaf())
        reps.append({"component": adapter.site("position_embed"),
                     "intervention": embed_leaves[1]})
    if freeze:
        outputs = {transcoder.cfg.hf_hooks(adapter, layer)["output"] for layer in range(n_layers)}
        reps += _freeze_representations(bound, outputs, [] if lorsa is None else lorsa.layers)
    lorsa_session = SpliceSession()
    if lorsa is not None:
        reps += lorsa_splice_representations(bound, lorsa, from_position=from_position,
                                             session=lorsa_session, leaves=True)
    session = SpliceSession()
    selection = clean_selection(bound, transcoder, input_ids) if transcoder.cfg.joint else None
    reps += clt_splice_representations(bound, transcoder, from_position=from_position,
                                       leaves=True, session=session, selection=selection)

    # the model's biases: under the freezes they enter the logits additively
    constants = [p for name, p in model.named_parameters() if name.endswith("bias")]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in constants:
            p.requires_grad_(True)
        replaced = [bound.module(part, layer) for layer in range(n_layers)
                    for part in (("mlp", "attn") if freeze else ("mlp",))]
        with torch.enable_grad(), _count_saved_bytes(model) as saved, \
                _no_grad_inside(model, replaced), bound.pre_softcap() as cap, \
                collect_steering() as steering, \
                capturing_states(bound, states) as captured, \
                (frozen_qk_norms(bound) if qk_norms else nullcontext()), \
                intervened(bound, reps, keep_model_gradients=True):
            # the last position's logits alone: every logit target reads it, and the whole
            # [P, vocabulary] (and its gradient per target row) grew with the prompt; all of
            # them where a direction target reads the unembedding's input at any position
            out = model(input_ids=input_ids, use_cache=False,
                        logits_to_keep=0 if "unembed_input" in states else 1)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    _drop_unreachable(steering, out.logits)
    leaves = dict(session.leaves)
    session.clear()
    features = [leaves["features"][layer] for layer in range(n_layers)]
    run = ReplacementRun(
        input_ids=input_ids, logits=out.logits, features=features,
        errors=[leaves["errors"][layer] for layer in range(n_layers)],
        embeddings=[leaf.leaf for leaf in embed_leaves], b_dec=leaves["b_dec"],
        constants=constants,
        encoder_inputs=[leaves["inputs"][layer] for layer in range(n_layers)],
        encoder_rows=torch.cat([transcoder.encoder_weight(layer)[f.feature]
                                for layer, f in enumerate(features)]),
        forward_bytes=saved["bytes"], pattern_bytes=saved["patterns"], logit_softcap=cap,
        steering=steering, states=captured, **lorsa_leaves(lorsa, lorsa_session))
    if lorsa is not None:
        run.encoder_rows = torch.cat([run.encoder_rows, *[
            h.w_v.to(run.encoder_rows.dtype) for h in run.lorsa_heads]])
    if transcoder.features is not None:
        _gather_features(run, transcoder, lorsa)
    return run


#: Why a Lorsa set and a transcoder split differently over ranks are refused.
LORSA_SHARDED_ALIKE = ("attention= (a Lorsa set) is split over ranks as the transcoder is: "
                       "both whole, or the transcoder by feature (load_transcoder(..., shard=)) "
                       "and the Lorsa by OV head (load_lorsa(..., shard=)), with the same "
                       "(rank, world)")


def _gather_features(run: ReplacementRun, transcoder: Transcoder,
                     lorsa: LorsaSet | None = None) -> None:
    """Make ``run``'s feature nodes the whole graph's (every rank's transcoder features, then
    every rank's Lorsa heads, :mod:`.sharded`), its features and leaves staying this rank's."""
    ranks = current()
    if ranks is None:
        raise InputError(SHARD_ALONE)
    n = sum(int(f.value.numel()) for f in run.features)  # this rank's transcoder features
    found, run.shard = globalize(
        ranks, run.feature_layer[:n], run.feature_position[:n],
        run.feature_id[:n] + transcoder.feature_offset, run.activation[:n],
        run.encoder_rows[:n], run.n_pos, transcoder.cfg.d_transcoder)
    if lorsa is not None:  # head ids are global already
        width = max(one.cfg.n_ov_heads for one in lorsa.layers.values())
        heads, shard = globalize(ranks, run.feature_layer[n:], run.feature_position[n:],
                                 run.feature_id[n:], run.activation[n:], run.encoder_rows[n:],
                                 run.n_pos, width)
        run.lorsa_nodes = len(heads["id"])
        found = {name: torch.cat([found[name], heads[name]]) for name in found}
        run.shard = run.shard.followed_by(shard)
    run.feature_layer, run.feature_position = found["layer"], found["position"]
    run.feature_id, run.activation = found["id"], found["activation"]
    run.encoder_rows = found["encoder_rows"]


def state_module(bound: BoundModel, name: str) -> nn.Module:
    """The module whose input is state ``name``: the unembedding for ``"unembed_input"``, block
    ``l``'s first norm for ``"resid_pre.{l}"`` (the final norm for ``l = n_layers``)."""
    if name == "unembed_input":
        return bound.module("unembed")
    layer = name.removeprefix("resid_pre.")
    n_layers = bound.n_layers
    if name == layer or not layer.isdecimal() or int(layer) > n_layers:
        raise InputError(f"unknown residual state {name!r}: 'unembed_input' or "
                         f"'resid_pre.<layer>' with layer in 0..{n_layers}")
    part = "final_norm" if int(layer) == n_layers else "pre_attn_norm"
    return bound.module(part, int(layer))


@contextmanager
def capturing_states(bound: BoundModel, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, keep the live (differentiable) residual-stream states ``names`` as the
    modules that read them receive them (after every edit upstream); yields the dict they land
    in."""
    found: dict[str, torch.Tensor] = {}
    edits = []
    for name in dict.fromkeys(names):
        module = state_module(bound, name)
        edits.append(reader(Site(module, "input", id(module) in bound.stream_inputs),
                            found, name))
    with applying(bound.model, edits):
        yield found
    missing = [name for name in names if name not in found]
    if missing:
        raise InputError(f"the forward never reached {', '.join(missing)}")


def _drop_unreachable(steering: list[SteeringLeaf], logits: torch.Tensor) -> None:
    """Set ``reached`` on every steering record, and ``leaf = None`` where it is no node: a
    zero constant, or a leaf no gradient from the logits reaches (an edit of an output the
    replacement model replaces by its own leaf or recomputation; its value is then inside that
    node, or for attention nowhere, which the closure check reports). One backward against a
    fixed random seed: pyvene writes in place, so the autograd graph still links an overwritten
    edit; only a gradient tells."""
    live = [s for s in steering if s.leaf is not None]
    if live:
        seed = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
        grads = torch.autograd.grad(logits, [s.leaf for s in live], seed.to(logits),
                                    retain_graph=True, allow_unused=True)
        for s, grad in zip(live, grads, strict=True):
            s.reached = grad is not None and bool(grad.ne(0).any())
    for s in steering:
        if not s.reached or s.is_zero:
            s.leaf = None


@contextmanager
def _no_grad_inside(model: nn.Module, modules: list[nn.Module]) -> Iterator[None]:
    """Run ``modules`` without building an autograd graph: their outputs are replaced (by the
    splice, by frozen attention), so recording them would only cost memory and every backward
    would walk it. Grad goes off at the module's input, back on at its output, before the
    edits added after these (the splice's, the freezes') run."""
    saved: dict[int, bool] = {}

    def off(_value, call: Call) -> None:
        saved[id(call.module)] = torch.is_grad_enabled()
        torch.set_grad_enabled(False)

    def on(_value, call: Call) -> None:
        torch.set_grad_enabled(saved.pop(id(call.module), True))

    mode = torch.is_grad_enabled()
    edits = [edit for module in modules
             for edit in (Edit(Site(module, "input"), off), Edit(Site(module, "output"), on))]
    try:
        with applying(model, edits):
            yield
    finally:
        torch.set_grad_enabled(mode)


@contextmanager
def _count_saved_bytes(model: nn.Module) -> Iterator[dict]:
    """Bytes of the distinct tensors autograd saves for the backward inside the block (the
    model's own weights, which exist anyway, not counted); ``patterns``: those of square
    tensors ``[..., n, n]`` (attention patterns and masks)."""
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = {"bytes": 0, "patterns": 0}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total["bytes"] += storage.nbytes()
            if tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] > 1:
                total["patterns"] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total

