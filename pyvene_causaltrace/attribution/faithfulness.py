"""How far to trust a graph: MIB's faithfulness curve f(k), CPR and CMD, for a feature graph.

A circuit is the graph's top ``k`` items (feature nodes, or edges) of its ranking, ``k`` =
``int(fraction * n_items)`` at each size (MIB's ``evaluate_area_under_curve``: sizes 0.1, 0.2,
0.5, 1, 2, 5, 10, 20, 50, 100 % of the items). It runs in the spliced model (every MLP replaced
by the transcoder, attention and norms live, so with nothing ablated and the clean errors it
*is* the model): the graph's feature nodes outside the circuit are set to their ablated value —
the counterfactual prompt's activation at the same layer, position and feature (MIB's
patching), the mean over a reference set's tokens, or zero — and the circuit's own stay live
(recomputed from the forward's own residual stream, as every feature that is not a graph node
is). Error nodes are not ranked: ``errors="held"`` keeps the clean run's, ``"ablated"`` sets
them like the features (then f(100 %) need not be 1). An edge circuit keeps the feature nodes
from which a logit is reached through kept edges (MIB prunes an edge circuit the same way), and
ablates the others: node ablation, not path patching.

``f(k) = (m(circuit) - m(empty)) / (m(full) - m(empty))``, ``m(full)`` the model's own forward
and ``m(empty)`` every graph feature ablated; the metric ``m`` is the logit difference between
the answer and a foil, P(answer), or KL(model || run). CPR is the trapezoid area under f over
the sizes as fractions, CMD the area of ``|1 - f|`` (no point added at 0, as MIB integrates).
The same curve for ``draws`` random rankings is the floor. One forward runs ``batch_size``
circuits (one per batch row, :class:`~..interventions.feature_ablate.FeatureAblate`'s
``keep``/``outside``), through the one applier (``runtime.intervened``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..arguments import checked
from ..atomic import write_text
from ..bound import BoundModel
from ..errors import InputError, UndefinedCurveError
from ..fingerprint import transcoder_fingerprint
from ..interventions.clt_splice import clean_errors, clean_selection, clt_splice_representations
from ..model_guard import measured
from ..prompts import answer_token_id
from ..runtime import intervened
from ..strict_json import loads
from ..transcoders.hooks import transcoder_states
from ..transcoders.transcoder import Transcoder
from .plots import finish, subplots
from .reading import logit_weights, row_denominators
from .settings import FaithfulnessSettings

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedTokenizerBase

    from .graph import AttributionGraph

__all__ = ["FaithfulnessCurve", "FaithfulnessSettings", "curve_json", "faithfulness", "mib_areas"]


def mib_areas(fractions: list[float], f: list[float]) -> tuple[float, float]:
    """``(CPR, CMD)`` of a curve: trapezoids between consecutive sizes (fractions of the items,
    not log-scaled) of ``f`` and of ``|1 - f|`` (MIB's ``evaluate_area_under_curve``)."""
    cpr = cmd = 0.0
    for i in range(len(f) - 1):
        width = fractions[i + 1] - fractions[i]
        cpr += width * (f[i] + f[i + 1]) / 2
        cmd += width * (abs(1.0 - f[i]) + abs(1.0 - f[i + 1])) / 2
    return cpr, cmd


def curve_json(title: str, sizes: list[float], f: list[float], random: list[list[float]], *,
               cpr: float, cmd: float, x_label: str, y_label: str,
               counts: list[int] | None = None, random_cpr: list[float] | None = None) -> dict:
    """A curve as a graph JSON's ``metadata.info`` carries it and the viewer draws it (one
    panel per ``metadata.info`` entry holding a ``curve``; docs/attribution.md, "The
    viewer"): ``sizes`` (the x values, drawn on a log axis), ``f`` per size, the random
    draws' band per size (``random``: one curve per draw, kept as min, mean and max), CPR
    and CMD (and the random draws' CPR). Any curve of this shape (a feature budget, a
    trace's) plugs in."""
    if any(len(draw) != len(sizes) for draw in [f, *random]):
        raise InputError(f"curve: {len(sizes)} sizes, but a curve of another length")
    low, mean, high = band(random, len(sizes)) if random else ([], [], [])
    return {"title": title, "x_label": x_label, "y_label": y_label,
            "sizes": [float(s) for s in sizes], "f": [float(v) for v in f],
            "random": {"draws": len(random), "min": low, "mean": mean, "max": high},
            "cpr": float(cpr), "cmd": float(cmd),
            **({} if counts is None else {"counts": [int(c) for c in counts]}),
            **({} if random_cpr is None else {"random_cpr": [float(c) for c in random_cpr]})}


def band(draws: list[list[float]], n: int) -> tuple[list[float], list[float], list[float]]:
    """Min, mean and max over the random ``draws`` (each a curve of ``n`` points) per point."""
    table = torch.tensor(draws, dtype=torch.float64).reshape(len(draws), n)
    return table.min(0).values.tolist(), table.mean(0).tolist(), table.max(0).values.tolist()


class _CurveFile:
    """A curve dataclass's JSON (:class:`FaithfulnessCurve`, :class:`~.budget_curve.BudgetCurve`):
    every field, written and read back whole."""

    def to_dict(self) -> dict:
        return asdict(self)

    @checked
    def to_json(self, path: str | Path | None = None) -> dict:
        """The curve as a JSON object (written to ``path`` when given)."""
        out = self.to_dict()
        if path is not None:
            write_text(json.dumps(out, indent=1, allow_nan=False), path)
        return out

    @classmethod
    def from_json(cls, source: str | Path | dict):
        """A curve from :meth:`to_json`'s object or file."""
        data = source if isinstance(source, dict) else \
            loads(Path(source).read_text(encoding="utf-8"))
        return cls(**data)


def settings_json(s: FaithfulnessSettings) -> dict:
    """``s`` as a curve records it (its tuples as lists, as JSON reads them back)."""
    return {**asdict(s), "sizes": list(s.sizes), "budgets": list(s.budgets)}


@dataclass(frozen=True)
class FaithfulnessCurve(_CurveFile):
    """One ranking's f(k) at each size, with ``random`` (one curve per draw) as the floor;
    ``metric_full``/``metric_empty`` the metric of the model and of the empty circuit;
    ``counts`` the items kept at each size out of ``n_items`` and ``nodes_kept`` the feature nodes
left live (the same for nodes; an edge circuit's reach); ``forwards`` run for it all."""

    answer: str
    foil: str | None
    settings: dict
    n_items: int
    counts: list[int]
    nodes_kept: list[int]
    metric_full: float
    metric_empty: float
    f: list[float]
    random: list[list[float]]
    cpr: float
    cmd: float
    random_cpr: list[float]
    random_cmd: list[float]
    forwards: int
    seconds: float = field(default=0.0, compare=False)

    @property
    def fractions(self) -> list[float]:
        """The sizes as fractions (what CPR and CMD integrate over), as the trace's curve."""
        return [round(s / 100, 12) for s in self.settings["sizes"]]

    def below_random(self) -> bool:
        """Whether CPR is below every random ranking's."""
        return self.cpr < min(self.random_cpr)

    def summary(self) -> dict:
        """What a graph's metadata carries: CPR, CMD, the random rankings', how they were
        measured, and the ``curve`` itself (:func:`curve_json`: what the viewer draws)."""
        level, metric = self.settings["level"], self.settings["metric"]
        return {"cpr": self.cpr, "cmd": self.cmd, "random_cpr": self.random_cpr,
                "random_cmd": self.random_cmd, "metric_full": self.metric_full,
                "metric_empty": self.metric_empty, "foil": self.foil,
                **{k: self.settings[k] for k in ("level", "rank_by", "ablation", "errors",
                                                 "metric", "draws")},
                "curve": curve_json(
                    "faithfulness f(k) (MIB)", self.settings["sizes"], self.f, self.random,
                    cpr=self.cpr, cmd=self.cmd, x_label=f"circuit size (% of {level})",
                    y_label=f"f(k) ({metric})", counts=self.counts, random_cpr=self.random_cpr)}

    def to_dataframe(self) -> pd.DataFrame:
        low, mean, high = band(self.random, len(self.f))
        return pd.DataFrame({"size_pct": self.settings["sizes"], "k": self.counts,
                             "nodes_kept": self.nodes_kept, "f": self.f, "random_mean": mean,
                             "random_min": low, "random_max": high})

    @checked
    def plot(self, path: str | Path | None = None):
        """f(k) against the size (log axis) with the random rankings' band; saved to ``path``
        when given. Returns the figure."""
        frame = self.to_dataframe()
        fig, ax = subplots(figsize=(6, 4))
        ax.fill_between(frame.size_pct, frame.random_min, frame.random_max, alpha=0.25,
                        color="gray", label=f"random ({len(self.random)} draws)")
        ax.plot(frame.size_pct, frame.random_mean, color="gray", lw=1)
        ax.plot(frame.size_pct, frame.f, marker="o",
                label=f"graph's ranking (CPR {self.cpr:.3f}, CMD {self.cmd:.3f})")
        ax.axhline(1.0, color="black", lw=0.5, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel(f"circuit size (% of {self.settings['level']})")
        ax.set_ylabel(f"faithfulness f(k) ({self.settings['metric']})")
        ax.legend(loc="best", fontsize=8)
        return finish(fig, path)


# ------------------------------------------------------------------------- rankings


def node_order(graph: AttributionGraph, rank_by: str) -> torch.Tensor:
    """Feature nodes, most blamed first (``validate.ranking``'s scores)."""
    n = graph.n_features
    score = graph.influence()[:n] if rank_by == "influence" else graph.target_row()[:n]
    return score.double().argsort(descending=True, stable=True)


def edge_list(graph: AttributionGraph, rank_by: str) -> tuple[torch.Tensor, ...]:
    """Every stored edge ``(target, source)`` and its score: ``|A[t, s]|`` (``"direct"``) or
    circuit-tracer's edge score on the unpruned graph, ``|A[t, s]| / sum_s |A[t, s]| *
    (influence[t] + w[t])`` (``"influence"``)."""
    store, lay = graph.rows, graph.layout
    weights = logit_weights(lay, graph.logit_weights())
    row_weight = (graph.influence() + weights)[store.nodes] / \
        row_denominators(store).clamp(min=1e-10)
    targets, sources, scores = [], [], []
    for rows, cols, values in store.chunks():
        targets.append(store.nodes[rows])
        sources.append(cols)
        score = values.abs().double()
        scores.append(score * row_weight[rows] if rank_by == "influence" else score)
    return torch.cat(targets), torch.cat(sources), torch.cat(scores)


def edge_circuit(graph: AttributionGraph, target: torch.Tensor, source: torch.Tensor,
                 kept: torch.Tensor) -> torch.Tensor:
    """Bool ``[n_features]``: the feature nodes a logit is reached from through the ``kept``
    edges."""
    reach = torch.zeros(graph.layout.n_nodes, dtype=torch.bool)
    reach[graph.layout.logits] = True
    target, source = target[kept], source[kept]
    while True:
        before = int(reach.sum())
        reach[source[reach[target]]] = True
        if int(reach.sum()) == before:
            return reach[:graph.n_features]


def circuits(graph: AttributionGraph, counts: list[int], order: torch.Tensor,
             edges: tuple | None) -> torch.Tensor:
    """Bool ``[len(counts), n_features]``: the feature nodes kept by the top ``k`` of
    ``order`` (node or edge indices) for each ``k``."""
    out = torch.zeros(len(counts), graph.n_features, dtype=torch.bool)
    for i, k in enumerate(counts):
        top = order[:k]
        if edges is None:
            out[i, top] = True
        else:
            kept = torch.zeros(len(order), dtype=torch.bool)
            kept[top] = True
            out[i] = edge_circuit(graph, edges[0], edges[1], kept)
    return out


# ------------------------------------------------------------------------- the runs


@dataclass
class _Ablated:
    """What the features and errors outside the circuit are set to: per-layer feature values
    ``[L, P, F]`` and the decoders' errors ``[L, 1, P, D]``; ``clean`` the clean run's features
    ``[L, P, F]`` (zero before the graph's first position)."""

    features: torch.Tensor
    errors: torch.Tensor
    clean: torch.Tensor


def _features_and_errors(bound: BoundModel, transcoder: Transcoder, ids: torch.Tensor,
                         start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[L, P, F]`` (zero before ``start``) and errors ``[L, 1, P, D]`` of the
    model's own run of ``ids [1, P]``."""
    states = transcoder_states(bound, transcoder, ids)
    acts = transcoder.encode_all(states["input"].to(transcoder.dtype), zero_bos=False)
    acts[:, :start] = 0
    return acts, clean_errors(bound, transcoder, ids, start)


def ablated_values(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
                   s: FaithfulnessSettings, counterfactual: torch.Tensor | None,
                   reference: list[torch.Tensor]) -> _Ablated:
    """The ablation's feature values and errors (clean errors when ``errors="held"``)."""
    ids = torch.tensor([graph.input_ids], device=bound.device)
    start, n_pos = graph.from_position, ids.shape[1]
    clean_acts, held = _features_and_errors(bound, transcoder, ids, start)
    if s.ablation == "counterfactual":
        features, errors = _features_and_errors(bound, transcoder, counterfactual, start)
    elif s.ablation == "zero":
        features, errors = torch.zeros_like(clean_acts), torch.zeros_like(held)
    else:
        runs = [_features_and_errors(bound, transcoder, r, start) for r in reference]
        features = torch.cat([a[:, start:] for a, _ in runs], 1).mean(1, keepdim=True)
        errors = torch.cat([e[:, :, start:] for _, e in runs], 2).mean(2, keepdim=True)
        features = features.expand(-1, n_pos, -1).clone()
        errors = errors.expand(-1, -1, n_pos, -1).clone()
        features[:, :start] = 0
    return _Ablated(features, held if s.errors == "held" else errors, clean_acts)


def run_masks(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
              blocks: Iterable[tuple[int, dict[int, torch.Tensor]]], outside: torch.Tensor,
              errors: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Last-position logits ``[C, V]`` of the spliced model, one forward per block of
    ``blocks``: ``(B, {layer: keep})`` with ``keep`` bool ``[B, P, F]`` (one circuit per batch
    row; a layer left out is live), every feature where ``keep`` is False set to ``outside[layer]
    [P, F]``, the decoders' ``errors`` added; and the number of forwards."""
    ids = torch.tensor([graph.input_ids], device=bound.device)
    selection = clean_selection(bound, transcoder, ids) if transcoder.cfg.joint else None
    out, forwards = [], 0
    for rows, block in blocks:
        ablations = [{"clt_layer": lay, "features": "all", "keep": keep.to(bound.device),
                      "outside": outside[lay][None]} for lay, keep in sorted(block.items())]
        reps = clt_splice_representations(bound, transcoder, errors=errors,
                                          from_position=graph.from_position,
                                          ablations=ablations, selection=selection)
        with torch.no_grad(), intervened(bound, reps) as spliced:
            logits = spliced(input_ids=ids.expand(rows, -1)).logits[:, -1]
        out.append(logits.float().cpu())
        forwards += 1
    return torch.cat(out), forwards


def run_circuits(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
                 keep: torch.Tensor, ablated: _Ablated, batch_size: int
                 ) -> tuple[torch.Tensor, int]:
    """Last-position logits ``[C, V]`` of the spliced model with each circuit of ``keep``
    (bool ``[C, n_features]``) live and the graph's other features ablated, ``batch_size``
    circuits per forward; and the number of forwards."""
    layer = graph.feature_layer.long()
    position, feature = graph.feature_position.long(), graph.feature_id.long()
    n_layers, n_pos, width = ablated.features.shape

    def blocks():
        for first in range(0, len(keep), batch_size):
            block, masks = keep[first:first + batch_size], {}
            for lay in range(n_layers):
                mine = layer == lay
                if mine.any():
                    live = torch.ones(len(block), n_pos, width, dtype=torch.bool)
                    live[:, position[mine], feature[mine]] = block[:, mine]
                    masks[lay] = live
            yield len(block), masks

    return run_masks(bound, transcoder, graph, blocks(), ablated.features, ablated.errors)


def metric_of(logits: torch.Tensor, metric: str, answer: int, foil: int | None,
              full: torch.Tensor) -> torch.Tensor:
    """The metric per row of last-position ``logits [C, V]`` (``full``: the model's own
    logits ``[V]``, KL's reference), float64."""
    logits = logits.double()
    if metric == "logit_diff":
        return logits[:, answer] - logits[:, foil]
    if metric == "prob":
        return logits.softmax(-1)[:, answer]
    p = full.double().log_softmax(-1)
    return (p.exp() * (p - logits.log_softmax(-1))).sum(-1)


# ------------------------------------------------------------------------- the curve


def check_logit_graph(graph: AttributionGraph, method: str) -> None:
    """Refuse a graph ``method`` cannot ablate: one with Lorsa nodes or of a direction."""
    if graph.lorsa_layers:
        raise InputError(f"graph: it has Lorsa nodes (attention=lorsa); {method} ablates "
                         "transcoder features in the model spliced with the transcoder alone "
                         "and does not splice Lorsa yet")
    if graph.targets and graph.targets[0].get("output", "logits") != "logits":
        raise InputError(f"graph: it explains a direction ({graph.targets[0]['name']}), not a "
                         f"logit; {method} reads the answer's logit")


def check_graph(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph) -> None:
    """:func:`check_logit_graph`, and refuse a graph of another model or transcoder."""
    check_logit_graph(graph, "faithfulness")
    if transcoder.n_layers != graph.n_layers:
        raise InputError(f"graph: it has {graph.n_layers} layers, the transcoder "
                         f"{transcoder.n_layers}: pass the transcoder it was built with")
    built = graph.metadata.get("fingerprints") or {}
    if built.get("model") not in (None, bound.fingerprint):
        raise InputError(f"graph: it was built on another model (weights fingerprint "
                         f"{built['model']}, this model's {bound.fingerprint})")
    if built.get("transcoder") not in (None, transcoder_fingerprint(transcoder)):
        raise InputError("graph: it was built with another transcoder (its fingerprint "
                         f"{built['transcoder']}, this one's {transcoder_fingerprint(transcoder)})")


def _ids(bound: BoundModel, name: str, prompt, tokenizer) -> torch.Tensor:
    """``prompt`` (text, read with ``tokenizer``, or token ids) as ``[1, P]`` on the model."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InputError(f"{name}: a text needs the tokenizer (or give token ids)")
        prompt = tokenizer(prompt)["input_ids"]
    ids = torch.tensor([list(prompt)], device=bound.device)
    bound.check_inputs(ids)
    return ids


def ablation_prompts(bound: BoundModel, tokenizer, graph: AttributionGraph,
                     s: FaithfulnessSettings, counterfactual, reference
                     ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The counterfactual prompt ``[1, P]`` (or None) and the reference prompts, checked
    against the graph's prompt and the ablation."""
    n_pos, cf = len(graph.input_ids), None
    if counterfactual is not None:
        cf = _ids(bound, "counterfactual", counterfactual, tokenizer)
        if cf.shape[1] != n_pos:
            raise InputError(f"counterfactual: it is {cf.shape[1]} tokens and the graph's "
                             f"prompt {n_pos}; a counterfactual prompt patches position by "
                             "position: give one of the same length")
    if s.ablation == "counterfactual" and cf is None:
        raise InputError("counterfactual: ablation='counterfactual' (MIB's default) needs a "
                         "counterfactual prompt; or ablation='mean' with reference=, or 'zero'")
    refs = [_ids(bound, "reference", r, tokenizer) for r in reference or []]
    if s.ablation == "mean" and not any(r.shape[1] > graph.from_position for r in refs):
        raise InputError("reference: ablation='mean' needs reference prompts with a token at or "
                         f"after the graph's first spliced position ({graph.from_position})")
    return cf, refs


def _foil(bound, tokenizer, foil, counterfactual, answer: int, metric: str) -> int | None:
    """The foil's token: ``foil`` (text or id), else the model's top token on the counterfactual."""
    if metric != "logit_diff":
        return None
    if isinstance(foil, str):
        if tokenizer is None:
            raise InputError("foil: a text needs the tokenizer (or give its token id)")
        foil = answer_token_id(tokenizer, foil)  # its first token; a longer one warns
    elif foil is None:
        if counterfactual is None:
            raise InputError("foil: metric='logit_diff' needs a foil (the other answer) or a "
                             "counterfactual prompt whose top token is taken as it")
        with torch.no_grad():
            foil = int(bound.model(input_ids=counterfactual).logits[0, -1].argmax())
    if not 0 <= int(foil) < bound.vocab_size:  # -1 read the vocabulary's last logit
        raise InputError(f"foil: token id {foil} is outside the vocabulary ({bound.vocab_size})")
    if int(foil) == answer:
        raise InputError(f"foil: it is the answer's token ({answer}); the logit difference "
                         "would be 0 everywhere")
    return int(foil)


@measured
def faithfulness(model: BoundModel, tokenizer: PreTrainedTokenizerBase | None,
                 transcoder: Transcoder, graph: AttributionGraph,
                 counterfactual: str | list[int] | None = None, *,
                 reference: list[str] | None = None, foil: str | int | None = None,
                 settings: FaithfulnessSettings | None = None, **keywords) -> FaithfulnessCurve:
    """MIB's faithfulness curve of ``graph`` (module docstring): f(k) at each size for its ranking
    and for ``draws`` random ones, CPR and CMD. ``tokenizer`` reads the prompts and the foil given
    as text (None: give token ids). ``counterfactual``: a prompt of the graph's prompt's length
    (text, or token ids), whose features (and errors, with ``errors="ablated"``) replace the
    ablated ones; ``reference``: prompts whose mean is used with ``ablation="mean"``; ``foil``:
    the logit difference's other token (default: the model's top token on ``counterfactual``).
    Settings: a :class:`FaithfulnessSettings` or its fields as keywords. Refused
    (:class:`InputError` naming the argument): a counterfactual of another length, a graph from
    another model or transcoder, an ablation without its prompts (or a reference prompt with no
    position from the graph's first), a foil outside the vocabulary, an empty circuit that
    scores as the model does up to rounding (f(k) undefined)."""
    started = time.perf_counter()
    s = FaithfulnessSettings.merged(settings, **keywords)
    check_graph(model, transcoder, graph)
    answer = int(graph.target["token"])
    cf, refs = ablation_prompts(model, tokenizer, graph, s, counterfactual, reference)
    foil_id = _foil(model, tokenizer, foil, cf, answer, s.metric)
    ids = torch.tensor([graph.input_ids], device=model.device)
    with torch.no_grad():
        full_logits = model.model(input_ids=ids).logits[0, -1].float().cpu()
    ablated = ablated_values(model, transcoder, graph, s, cf, refs)
    if s.level == "nodes":
        order, edges, n_items = node_order(graph, s.rank_by), None, graph.n_features
    else:
        edges = edge_list(graph, s.rank_by)
        order = edges[2].argsort(descending=True, stable=True)
        n_items = len(order)
    fractions = [round(size / 100, 12) for size in s.sizes]
    counts = [int(fraction * n_items) for fraction in fractions]
    g = torch.Generator().manual_seed(s.seed)
    orders = [order] + [torch.randperm(n_items, generator=g) for _ in range(s.draws)]
    keep = torch.cat([torch.zeros(1, graph.n_features, dtype=torch.bool)]
                     + [circuits(graph, counts, o, edges) for o in orders])
    logits, forwards = run_circuits(model, transcoder, graph, keep, ablated, s.batch_size)
    m = metric_of(logits, s.metric, answer, foil_id, full_logits)
    m_full = float(metric_of(full_logits[None], s.metric, answer, foil_id, full_logits)[0])
    m_empty = float(m[0])
    scale = 1e-5 if s.metric == "kl" else max(abs(m_full), abs(m_empty), s.metric != "prob")
    if not abs(m_full - m_empty) > 1e-4 * scale:  # apart by rounding, or NaN: f(k) is noise
        raise UndefinedCurveError("graph: the empty circuit scores as the full model does "
                                  f"({s.metric} {m_full:g} and {m_empty:g}): f(k) is undefined; "
                                  "try another counterfactual or ablation")
    f = ((m[1:] - m_empty) / (m_full - m_empty)).reshape(len(orders), len(counts)).tolist()
    areas = [mib_areas(fractions, curve) for curve in f]
    return FaithfulnessCurve(
        answer=graph.answer, foil=None if tokenizer is None or foil_id is None
        else tokenizer.decode([foil_id]), settings=settings_json(s), n_items=n_items,
        counts=counts, nodes_kept=keep[1:1 + len(counts)].sum(1).tolist(), metric_full=m_full,
        metric_empty=m_empty, f=f[0], random=f[1:],
        cpr=areas[0][0], cmd=areas[0][1], random_cpr=[a[0] for a in areas[1:]],
        random_cmd=[a[1] for a in areas[1:]], forwards=forwards,
        seconds=time.perf_counter() - started)
