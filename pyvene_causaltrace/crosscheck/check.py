"""``cross_check``: one prompt's attribution graph against its causal trace, both ways.

    check = cross_check(graph, tracer, clt)          # sites, and the top 20 features
    check.summary(); check.plot("cross_check.png"); check.to_json("cross_check.json")

Sites (:mod:`.sites`): per cell, the graph's influence beside the residual and MLP traces'
indirect effects. Features (:mod:`.features`): for the ``top_n`` features, attribution's linear
prediction of the noise's effect through each beside the patch measured in the spliced model.
Heads (:mod:`.heads`, with ``heads=``): each head's loading beside its restore alone."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..arguments import NonNegativeInt, PositiveInt, checked
from ..errors import InputError, PyveneModelError
from ..tracing.engine import get_kind
from ..tracing.head_restore import check_layers
from ..transcoders.transcoder import Transcoder, check_fits
from .features import PatchRunner, noised_activations, target_coefficients, total_effects
from .heads import head_section
from .result import CrossCheckResult, feature_statistics
from .settings import CrossCheckSettings
from .sites import SITE_PARTS, compare_grids, reachable_cells, site_influence, window_sum

if TYPE_CHECKING:  # annotations only
    from ..attribution.graph import AttributionGraph
    from ..tracing.tracer import Tracer

#: The keyword defaults: :class:`~.settings.CrossCheckSettings`' fields.
_DEFAULT = CrossCheckSettings()
#: Activations recomputed from the model must equal the graph's to this (relative) tolerance.
ACTIVATION_TOLERANCE = 1e-3
#: The noised runs' P(answer) must equal the trace's corrupted runs' to this.
NOISE_TOLERANCE = 1e-4


@checked
def check_pair(graph: AttributionGraph, tracer: Tracer) -> None:
    """Refuse a graph and a tracer of different prompts, answers or models."""
    if graph.lorsa_layers:
        raise InputError("the graph has Lorsa nodes (attention=lorsa); the cross-check "
                         "noises transcoder features only and does not splice Lorsa yet")
    if tracer.with_interventions or graph.steering:
        raise PyveneModelError("cross_check compares the bare model's graph and trace: build "
                               "both without a pyvene IntervenableModel")
    ids = tracer.prompt.input_ids[0].tolist()
    if list(graph.input_ids) != ids:
        raise InputError(f"the graph is of {graph.prompt!r} ({len(graph.input_ids)} tokens), "
                         f"the trace of {tracer.prompt.text!r} ({len(ids)} tokens): cross-check "
                         "one prompt")
    goal = graph.targets[0]
    if goal.get("output", "logits") != "logits" or int(goal["token"]) != tracer.answer_id:
        answer = tracer.tokenizer.decode([tracer.answer_id])
        raise InputError(f"the graph's first logit node is {goal.get('text')!r}, the trace's "
                         f"answer {answer!r}: build the graph with answer={answer!r}")
    if graph.n_layers != tracer.engine.n_layers:
        raise InputError(f"the graph has {graph.n_layers} layers, the model "
                         f"{tracer.engine.n_layers}: another model")


@checked
def cross_check(
    graph: AttributionGraph, tracer: Tracer, transcoder: Transcoder | None = None, *,
    kinds: Sequence[str] = _DEFAULT.kinds, window: PositiveInt = _DEFAULT.window,
    top_k: PositiveInt = _DEFAULT.top_k, top_n: NonNegativeInt = _DEFAULT.top_n,
    modes: Sequence[str] = _DEFAULT.modes, heads: bool | int | Sequence[int] = _DEFAULT.heads,
    progress: Callable[[int], None] | None = None,
    settings: CrossCheckSettings | None = None,
) -> CrossCheckResult:
    """Compare ``graph`` with ``tracer``'s traces (module docstring).

    ``graph`` is of ``tracer``'s prompt, its first logit node the trace's answer; the tracer's
    noise is the perturbation on both sides. Without ``transcoder`` only the sites are compared.
    ``kinds``, ``window``, ``top_k``, ``top_n``, ``modes``, ``heads`` are
    :class:`~.settings.CrossCheckSettings`' fields, or ``settings`` gives them at once.
    ``progress`` is called with 1 after each mode's patches. Raises ``InputError`` for a graph and
    tracer of different prompts, answers or models, a transcoder not the graph's, an unknown kind
    or mode; ``PyveneModelError`` for an ``IntervenableModel``'s graph or tracer."""
    start = time.perf_counter()
    s = CrossCheckSettings.merged(settings, kinds=kinds, window=window, top_k=top_k,
                                  top_n=top_n, modes=modes, heads=heads)
    kinds, window, top_k, top_n, modes = s.kinds, s.window, s.top_k, s.top_n, s.modes
    head_layers = _head_layers(s.heads, tracer.engine.n_layers)
    if head_layers is not None and transcoder is None:
        raise InputError("heads: head loadings replay the graph's run, so they need the graph's "
                         "transcoder (pass transcoder=)")
    check_pair(graph, tracer)
    if transcoder is not None:
        check_fits(tracer.model, transcoder)

    features, stats = [], {}
    if transcoder is not None and top_n > 0:  # first: it refuses another transcoder quickly
        features = _feature_rows(graph, tracer, transcoder, top_n, modes, progress)
        stats = {mode: feature_statistics(features, mode) for mode in modes}
    traces = {kind: tracer.trace(kind, window=window) for kind in kinds}
    trace_grids = {kind: result.indirect_effect.mean(0) for kind, result in traces.items()}
    layers_of = {kind: [tracer.engine.restore_layers(get_kind(kind), layer, window)
                        for layer in range(tracer.engine.n_layers)] for kind in kinds}
    graph_grids = {part: site_influence(graph, part, share=True) for part in SITE_PARTS}
    mask = reachable_cells(graph.n_layers, graph.n_pos, tracer.prompt.subject_range[0])
    sites = {kind: {part: compare_grids(window_sum(graph_grids[part], layers_of[kind]),
                                        trace_grids[kind], mask, top_k)
                    for part in SITE_PARTS} for kind in kinds}
    head_stats = ({} if head_layers is None
                  else head_section(graph, tracer, transcoder, head_layers))
    return CrossCheckResult(
        prompt=graph.prompt, tokens=list(graph.tokens),
        subject_range=tuple(tracer.prompt.subject_range), answer=graph.answer,
        n_layers=graph.n_layers, seeds=list(tracer.seeds), scale=float(tracer.scale),
        sigma=float(tracer.sigma), clean_prob=tracer.clean_prob,
        corrupt_probs=[float(p) for p in tracer.corrupt_probs],
        windows={kind: result.window for kind, result in traces.items()},
        graph_grids={part: grid.tolist() for part, grid in graph_grids.items()},
        trace_grids={kind: grid.tolist() for kind, grid in trace_grids.items()},
        sites=sites, features=features, feature_stats=stats,
        graph_info={"n_features": graph.n_features, "n_explored": graph.n_explored,
                    "complete": graph.n_explored == graph.n_features,
                    "n_logits": graph.n_logits, "closure": graph.closure.relative,
                    "transcoder": graph.metadata.get("transcoder", {})},
        settings={"kinds": list(kinds), "window": window, "top_k": top_k, "top_n": top_n,
                  "modes": list(modes), "cells": "positions from the subject's first token",
                  "heads": head_layers},
        heads=head_stats, seconds=time.perf_counter() - start)


def _head_layers(heads: bool | int | Sequence[int], n_layers: int) -> list[int] | None:
    """The layers ``heads=`` asks for (None: no head comparison), checked."""
    if heads is False or heads is None:
        return None
    if heads is True:
        return list(range(n_layers))
    try:
        return check_layers(heads, n_layers)
    except (InputError, TypeError) as error:
        raise InputError(f"heads must be True, False, a layer or a list of layers: {error}") \
            from None


def _feature_rows(graph, tracer, transcoder: Transcoder, top_n: int, modes: Sequence[str],
                  progress: Callable[[int], None] | None) -> list[dict]:
    """One dict per checked feature: where it is, its activations, the prediction and, per
    mode, the measured effects."""
    n = graph.n_features
    influence = graph.influence()[:n]
    order = influence.argsort(descending=True, stable=True)[:top_n]
    layer, position = graph.feature_layer[order], graph.feature_position[order]
    feature = graph.feature_id[order]
    acts = noised_activations(tracer, transcoder, layer, position, feature)
    _check_activations(graph, order, acts.clean)
    corrupt = torch.as_tensor(tracer.corrupt_probs, dtype=torch.float64)
    if float((acts.noised_probs - corrupt).abs().max()) > NOISE_TOLERANCE:
        raise InputError("the noised runs here are not the trace's corrupted runs (P(answer) "
                         f"{acts.noised_probs.tolist()} vs {corrupt.tolist()}): the tracer's "
                         "model changed since it was built?")
    derivative = total_effects(graph)[order]
    delta = acts.noised - acts.clean[None]  # [seeds, n]
    predicted = delta * derivative[None]
    coefficients = target_coefficients(graph, int(tracer.engine.clean_probs.numel()))
    measured: dict[str, tuple[np.ndarray, np.ndarray, float, np.ndarray]] = {}
    n_seeds = delta.shape[0]
    settings = [(int(layer[i]), int(position[i]), int(feature[i]), float(acts.noised[s, i]))
                for i in range(len(order)) for s in range(n_seeds)]
    for mode in modes:
        runner = PatchRunner(tracer.bound, transcoder, tracer.prompt.input_ids, coefficients,
                             tracer.answer_id, mode, graph.from_position)
        targets, probs, crossings = runner.run([None, *settings])
        base_target, base_prob = float(targets[0]), float(probs[0])
        effect = (targets[1:] - base_target).view(len(order), n_seeds).T.numpy()
        change = (probs[1:] - base_prob).view(len(order), n_seeds).T.numpy()
        switched = crossings[1:].view(len(order), n_seeds).T.numpy()
        measured[mode] = (effect, change, base_target, switched)
        if progress is not None:
            progress(1)
    rows = []
    for i, node in enumerate(order.tolist()):
        row = {"node": node, "label": graph.label(node), "layer": int(layer[i]),
               "position": int(position[i]), "token": graph.tokens[int(position[i])],
               "feature": int(feature[i]), "influence": float(influence[node]),
               "activation": float(acts.clean[i]), "noised": acts.noised[:, i].tolist(),
               "delta_mean": float(delta[:, i].mean()), "total_effect": float(derivative[i]),
               "predicted": predicted[:, i].tolist(),
               "predicted_mean": float(predicted[:, i].mean()), "modes": {}}
        for mode, (effect, prob, base, switched) in measured.items():
            row["modes"][mode] = {"measured": effect[:, i].tolist(),
                                  "measured_mean": float(effect[:, i].mean()),
                                  "prob_change": prob[:, i].tolist(),
                                  "prob_change_mean": float(prob[:, i].mean()),
                                  "crossings": [int(c) for c in switched[:, i]],
                                  "baseline_target": base}
        rows.append(row)
    return rows


def _check_activations(graph, order: torch.Tensor, clean: torch.Tensor) -> None:
    """Refuse a transcoder or model other than the graph's: its activations would differ."""
    expected = graph.activation[order].double()
    gap = float((clean - expected).abs().max())
    scale = float(expected.abs().max())
    if gap > ACTIVATION_TOLERANCE * max(scale, 1e-6):
        raise InputError(f"this model and transcoder give the graph's top features activations "
                         f"up to {gap:.3g} away from the graph's (largest {scale:.3g}): the graph "
                         "was built with another model or transcoder")


__all__ = ["check_pair", "cross_check"]
