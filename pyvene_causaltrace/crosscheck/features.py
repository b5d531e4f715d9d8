"""The graph's features under the trace's noise: attribution's linear prediction beside a patch
(docs/crosscheck.md, "Features").

For feature ``i`` (clean activation ``a_i``) and noise seed ``s``: the **prediction** is
``(a_i(s) - a_i) * g_i``, ``a_i(s)`` read by the transcoder from the noised real model and
``g_i = d target / d a_i`` summed over the graph's paths (:func:`total_effects`); the
**measured** effect is the target in the spliced model (errors held at the clean run's) with
feature ``i`` set to ``a_i(s)``, minus the same model unset. ``mode="replacement"`` also holds
attention patterns and norm scales: the local replacement model, where prediction and patch
agree to float error until another feature crosses its threshold. The target is the graph's
(its logit nodes' weighted mean, before a final soft-cap); P(answer) is the real, capped one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..arguments import PositiveInt, checked
from ..bound import BoundModel, bind
from ..capture import capture
from ..errors import InputError
from ..interventions.clt_splice import clean_errors, clt_splice_representations
from ..interventions.frozen import (
    FrozenAttention,
    FrozenLayerNorm,
    attention_patterns,
    norm_scales,
)
from ..interventions.noise import NoiseAdd
from ..interventions.splice_session import SpliceSession
from ..runtime import intervened
from ..transcoders.hooks import hook_component, hook_value, norm_settings
from ..transcoders.transcoder import Transcoder

if TYPE_CHECKING:  # annotations only (an import cycle otherwise)
    from ..attribution.graph import AttributionGraph
    from ..tracing.tracer import Tracer

#: How the patch is measured (module docstring).
MODES = ("spliced", "replacement")
#: Patched rows (one set feature each) per forward.
ROWS = 64


@checked
def total_effects(graph: AttributionGraph, max_iter: PositiveInt = 1000) -> torch.Tensor:
    """``[n_features]`` float64: ``d target / d a_i`` for every feature node in the local
    replacement model, the sum over the graph's paths (the target: the logit nodes' weighted
    mean). Paths through features without a row (a budgeted graph) are missing."""
    store, lay = graph.rows, graph.layout
    nodes = store.nodes
    row_of_node = store.row_of_node(lay.n_nodes)
    weight = torch.zeros(store.n_rows, dtype=torch.float64)
    weight[row_of_node[lay.logits]] = graph.logit_weights() / graph.logit_weights().sum()
    feature_rows = (nodes < lay.n_features).nonzero().squeeze(-1)
    activation = graph.activation.double()
    safe = torch.where(activation != 0, activation, torch.ones_like(activation))
    previous = None
    for _ in range(max_iter):
        total = torch.zeros(store.n_columns, dtype=torch.float64)
        for rows, cols, values in store.chunks():
            total.index_add_(0, cols, weight[rows] * values.double())
        derivative = total[:lay.n_features] / safe
        if previous is not None and torch.equal(total, previous):
            return derivative
        weight[feature_rows] = derivative[nodes[feature_rows]]
        previous = total
    raise InputError(f"the graph's paths did not end after {max_iter} steps: not an acyclic "
                     "attribution graph")


def target_coefficients(graph, vocab_size: int) -> torch.Tensor:
    """``[vocab]`` float64: the weighted mean of the graph's logit targets' coefficients."""
    weights = graph.logit_weights() / graph.logit_weights().sum()
    out = torch.zeros(vocab_size, dtype=torch.float64)
    for w, goal in zip(weights, graph.targets, strict=True):
        if goal.get("output", "logits") != "logits":
            raise InputError(f"the graph explains {goal.get('name')!r}, a direction in the "
                             "residual stream: the feature check measures logit targets only")
        for token, value in goal["coefficients"].items():
            out[int(token)] += float(w) * float(value)
    return out


def _transcoder_inputs(bound: BoundModel, transcoder: Transcoder, layers: Sequence[int],
                       run) -> dict[int, torch.Tensor]:
    """The transcoder's input hook values ``[batch, P, D]`` at ``layers`` during ``run()``."""
    hook = transcoder.cfg.feature_input_hook
    paths = {layer: hook_component(bound.adapter, hook, layer) for layer in layers}
    found = capture(bound.model, {}, list(paths.values()), run=run)
    out = {}
    for layer, path in paths.items():
        out[layer] = hook_value(found[path], norm_settings(bound, hook, layer))
    return out


@dataclass(frozen=True)
class NoisedActivations:
    """Clean ``[n]`` and noised ``[seeds, n]`` activations of chosen features, and P(answer) of
    each noised run (``[seeds]``, to check it is the trace's corrupted run)."""

    clean: torch.Tensor
    noised: torch.Tensor
    noised_probs: torch.Tensor


@checked
@torch.no_grad()
def noised_activations(tracer: Tracer, transcoder: Transcoder, layer: torch.Tensor,
                       position: torch.Tensor, feature: torch.Tensor) -> NoisedActivations:
    """Each chosen feature's activation on the clean prompt and in each of ``tracer``'s noised
    runs (its seeds, scale and sigma on the subject's embeddings), read by the transcoder from
    the real model."""
    bound = tracer.bound
    model, adapter = bound.model, bound.adapter
    device = bound.device
    ids = tracer.prompt.input_ids.to(device)
    layers = sorted({int(x) for x in layer})
    noise = NoiseAdd(seeds=tracer.seeds, positions=tracer.noise_positions, scale=tracer.scale,
                     sigma=tracer.sigma, distribution=tracer.distribution)
    box = {}
    batch = ids.repeat(len(tracer.seeds), 1)

    def noised_run():
        with intervened(bound, [{"component": adapter.site("embed"), "intervention": noise}]):
            box["out"] = model(input_ids=batch, use_cache=False)

    noised = _transcoder_inputs(bound, transcoder, layers, noised_run)
    clean = _transcoder_inputs(bound, transcoder, layers, lambda: model(input_ids=ids,
                                                                         use_cache=False))
    probs = box["out"].logits[:, -1].double().softmax(-1)[:, tracer.answer_id].cpu()

    def read(states: dict[int, torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(next(iter(states.values())).shape[0], len(feature), dtype=torch.float64)
        for lay in layers:
            chosen = (layer == lay).nonzero().squeeze(-1)
            x = states[lay][:, position[chosen].to(device)]  # [batch, n, D]
            acts = transcoder.encode(x, lay)  # [batch, n, F]
            index = feature[chosen].to(acts.device).view(1, -1, 1).expand(acts.shape[0], -1, 1)
            out[:, chosen] = acts.gather(2, index).squeeze(-1).double().cpu()
        return out

    return NoisedActivations(read(clean)[0], read(noised), probs)


class PatchRunner:
    """The spliced model of one prompt (transcoder at every layer, errors held at the clean
    run's), optionally with attention patterns and norm scales held too
    (``mode="replacement"``); :meth:`run` sets features and reads the target, P(answer) and
    how many features crossed their thresholds."""

    def __init__(self, model: nn.Module | BoundModel, transcoder: Transcoder,
                 input_ids: torch.Tensor,
                 coefficients: torch.Tensor, answer_id: int, mode: str = "spliced",
                 from_position: int = 1) -> None:
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.bound = bind(model)
        self.model, self.transcoder, self.mode = self.bound.model, transcoder, mode
        self.ids = input_ids.to(self.bound.device)
        self.coefficients = coefficients
        self.answer_id = int(answer_id)
        self.from_position = from_position  # the graph's: 0 where position 0 is no BOS
        with torch.no_grad():
            self.errors = clean_errors(self.bound, transcoder, self.ids, from_position)
            self._held = self._held_states() if mode == "replacement" else None
        self._active: dict[int, torch.Tensor] | None = None
        self._active = self._forward([None])[2]  # the unpatched run's active features

    def _held_states(self) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[str]]:
        adapter = self.bound.adapter
        replaced = {self.transcoder.cfg.hf_hooks(adapter, layer)["output"]
                    for layer in range(self.transcoder.n_layers)}
        norms = [c for layer in range(self.bound.n_layers)
                 for c in adapter.norm_sites(layer) if c not in replaced]
        norms.append(adapter.site("final_norm"))
        return (attention_patterns(self.bound, self.ids),
                norm_scales(self.bound, self.ids, norms), norms)

    def _freezes(self) -> list[dict]:
        if self._held is None:
            return []
        adapter = self.bound.adapter
        patterns, scales, norms = self._held
        reps = [{"component": c, "intervention": FrozenLayerNorm(kind=adapter.norm_kind,
                                                                 scale=scales[c])}
                for c in norms]
        reps += [{"component": adapter.site("attn_output", layer),
                  "intervention": FrozenAttention(pattern=pattern, pattern_from="clean")}
                 for layer, pattern in enumerate(patterns)]
        return reps

    @torch.no_grad()
    def run(self, rows: Sequence[tuple[int, int, int, float] | None]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(target [n], P(answer) [n], crossings [n])`` (float64, float64, long), one forward
        per :data:`ROWS` rows: row ``i`` sets feature ``rows[i] = (layer, position, feature,
        value)`` (None: nothing set); ``crossings``: features, other than the set one, active
        in the row and not in the unpatched run or the reverse."""
        parts = [self._forward(rows[start:start + ROWS]) for start in range(0, len(rows), ROWS)]
        return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                torch.cat([p[3] for p in parts]))

    def _forward(self, rows: Sequence[tuple[int, int, int, float] | None]):
        groups: dict[tuple[int, int, int], list[float | None]] = {}
        for i, row in enumerate(rows):
            if row is not None:
                layer, pos, feature, value = row
                key = (int(layer), int(pos), int(feature))
                groups.setdefault(key, [None] * len(rows))[i] = float(value)
        ablations = [{"clt_layer": layer, "positions": [pos], "features": [feature],
                      "row_values": values}
                     for (layer, pos, feature), values in groups.items()]
        session = SpliceSession()
        reps = clt_splice_representations(self.bound, self.transcoder, errors=self.errors,
                                          from_position=self.from_position,
                                          ablations=ablations, session=session)
        batch = self.ids.expand(len(rows), -1)
        with self.bound.pre_softcap() as cap, \
                intervened(self.bound, reps + self._freezes()) as model:
            out = model(input_ids=batch, use_cache=False)
        logits = out.logits[:, -1].double()
        target = logits @ self.coefficients.to(logits.device)
        capped = logits if cap is None else cap * torch.tanh(logits / cap)
        active = {layer: acts != 0 for layer, acts in session.encoded.items()}
        crossings = torch.zeros(len(rows), dtype=torch.long)
        if self._active is not None:
            for layer, mask in active.items():
                crossings += (mask != self._active[layer]).flatten(1).sum(1).cpu()
        return (target.cpu(), capped.softmax(-1)[:, self.answer_id].cpu(), active, crossings)
