"""How many features carry the answer: the feature-budget curve (PIE, arXiv 2604.16889).

KL(model || run) on the next-token distribution and P(answer) when only the top ``K`` transcoder
features are kept live, for each ``K`` of ``budgets`` and for every active feature ("all"),
beside ``K`` random features (``draws`` random orders). The features are the clean run's
*active* transcoder features (every layer, every position from the graph's first, not only
the graph's nodes): the ranking puts the graph's feature nodes first, in the order
:func:`~.faithfulness.node_order` gives them (influence, or ``rank_by="direct"``), then the
other active features by ``|activation| x`` the norm of their decoder (all the layers it
writes). "The rest" — the active features outside the top ``K`` — is ablated as the
faithfulness curve ablates (``ablation``: the counterfactual prompt's value, the reference
mean, or zero); features inactive on the clean run are held at zero (their clean value), so
only ``K`` features are live and ``K`` = all is the model itself (errors held). The error
nodes are held (``errors="held"``, the default) or ablated.

"Random features needed to match": for each ``K``, the smallest ``K'`` whose random mean KL
is at or below the ranked top ``K``'s, read on a half-octave grid of ``K'`` (1, 1.4, 2, 2.8,
... rounded, with each ``K`` and all) up to every active feature, interpolated linearly in
``log K'`` between the two grid points around the first crossing; ``None`` ("> all") when no
``K'`` does. Every circuit is one batch row of :func:`~.faithfulness.run_masks` (``batch_size``
per forward): ``1 + len(budgets) + 1 + draws * len(grid)`` circuits, the first one empty."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..arguments import checked
from ..bound import BoundModel
from ..model_guard import measured
from ..transcoders.transcoder import Transcoder
from .faithfulness import (
    _CurveFile,
    ablated_values,
    ablation_prompts,
    band,
    check_graph,
    metric_of,
    node_order,
    run_masks,
    settings_json,
)
from .plots import finish, subplots
from .settings import FaithfulnessSettings

if TYPE_CHECKING:  # annotations only
    from transformers import PreTrainedTokenizerBase

    from .graph import AttributionGraph

__all__ = ["BudgetCurve", "budget_curve", "features_ranked", "random_needed"]


@dataclass(frozen=True)
class BudgetCurve(_CurveFile):
    """KL and P(answer) with the top ``kept[i]`` features live (``budgets``: the ``K`` asked,
    then every active feature, ``n_active``; ``kept`` = ``min(K, n_active)``), the random
    orders' at each ``grid`` point (``random_kl[draw][j]``), the model's P(answer)
    (``prob_full``) and the empty circuit's, ``matched`` the random ``K'`` needed per ``K``
    (None: more than all), ``n_graph`` of the ranked features the graph's nodes."""

    answer: str
    settings: dict
    n_active: int
    n_graph: int
    budgets: list[int]
    kept: list[int]
    kl: list[float]
    prob: list[float]
    grid: list[int]
    random_kl: list[list[float]]
    random_prob: list[list[float]]
    prob_full: float
    prob_empty: float
    kl_empty: float
    matched: list[float | None]
    forwards: int
    seconds: float = field(default=0.0, compare=False)

    @property
    def ratio(self) -> list[float | None]:
        """Random features needed per ranked feature, ``matched / kept`` (None: "> all")."""
        return [None if m is None else m / k for m, k in zip(self.matched, self.kept,
                                                             strict=True)]

    def _band(self, values: list[list[float]]) -> tuple[list[float], ...]:
        """Mean, min and max over the draws at each ``kept`` (a grid point each)."""
        at = [self.grid.index(k) for k in self.kept]
        low, mean, high = band(values, len(self.grid))
        return [mean[j] for j in at], [low[j] for j in at], [high[j] for j in at]

    def to_dataframe(self) -> pd.DataFrame:
        """One row per ``K`` ("all" last): kept, KL and P(answer), the random band's, and the
        random features needed to match (NaN: "> all") and its ratio."""
        kl_mean, kl_min, kl_max = self._band(self.random_kl)
        p_mean, p_min, p_max = self._band(self.random_prob)
        labels = [str(k) for k in self.budgets[:-1]] + ["all"]
        nan = float("nan")
        return pd.DataFrame({
            "K": labels, "kept": self.kept, "kl": self.kl, "random_kl_mean": kl_mean,
            "random_kl_min": kl_min, "random_kl_max": kl_max, "prob": self.prob,
            "random_prob_mean": p_mean, "random_prob_min": p_min, "random_prob_max": p_max,
            "random_needed": [nan if m is None else m for m in self.matched],
            "ratio": [nan if r is None else r for r in self.ratio]})

    @checked
    def plot(self, path: str | Path | None = None):
        """KL (log) and P(answer) against ``K`` (log), the ranked features beside the random
        band (min to max over the draws, the mean drawn); saved to ``path`` when given."""
        fig, axes = subplots(1, 2, figsize=(10, 4))
        for ax, ranked, random, name in ((axes[0], self.kl, self.random_kl, "KL(model || run)"),
                                         (axes[1], self.prob, self.random_prob, "P(answer)")):
            table = torch.tensor(random, dtype=torch.float64)
            ax.fill_between(self.grid, table.min(0).values, table.max(0).values, alpha=0.25,
                            color="gray", label=f"random features ({len(random)} draws)")
            ax.plot(self.grid, table.mean(0), color="gray", lw=1)
            ax.plot(self.kept, ranked, marker="o", label="top K (graph's ranking)")
            ax.set_xscale("log")
            ax.set_xlabel(f"features kept live (of {self.n_active} active)")
            ax.set_ylabel(name)
        axes[0].set_yscale("symlog", linthresh=1e-3)  # KL reaches 0 at all features
        axes[0].set_ylim(bottom=0)
        axes[1].axhline(self.prob_full, color="black", lw=0.5, ls="--", label="model")
        axes[0].legend(loc="best", fontsize=8)
        axes[1].legend(loc="best", fontsize=8)
        return finish(fig, path)


def features_ranked(transcoder: Transcoder, graph: AttributionGraph, clean: torch.Tensor,
                    rank_by: str) -> tuple[torch.Tensor, int]:
    """Flat indices into ``clean [L, P, F]`` of every active feature, best first: the graph's
    feature nodes in its order, then the others by ``|activation| x ||decoder||``; and how
    many of them are graph nodes."""
    n_layers, n_pos, width = clean.shape
    active = (clean != 0).flatten()
    order = node_order(graph, rank_by)
    nodes = ((graph.feature_layer.long()[order] * n_pos + graph.feature_position.long()[order])
             * width + graph.feature_id.long()[order])
    nodes = nodes[active[nodes]]
    rest = active.clone()
    rest[nodes] = False
    rest = rest.nonzero().squeeze(1)
    layer, feature = rest // (n_pos * width), rest % width
    score = clean.flatten()[rest].abs().double()
    for lay in layer.unique().tolist():
        mine = layer == lay
        rows = transcoder.decoder_rows(lay, feature[mine].to(transcoder.W_dec[lay].device))
        score[mine] *= rows.flatten(1).double().norm(dim=1).cpu()
    rest = rest[score.argsort(descending=True, stable=True)]
    return torch.cat([nodes, rest]), len(nodes)


def half_octave_grid(n: int, also: list[int]) -> list[int]:
    """1, 1.4, 2, 2.8, ... (rounded) up to ``n``, with ``also`` and ``n``."""
    steps = int(2 * math.log2(n)) + 1 if n > 0 else 0
    points = {round(2 ** (i / 2)) for i in range(steps)} | set(also) | {n}
    return sorted(p for p in points if 0 < p <= n)


def random_needed(grid: list[int], random_mean: list[float], target: float) -> float | None:
    """The smallest ``K'`` whose random mean KL is at most ``target``: the first grid point
    where it is, interpolated in ``log K'`` from the point before; None when none is."""
    for j, value in enumerate(random_mean):
        if value <= target:
            if j == 0:
                return float(grid[0])
            before = random_mean[j - 1]
            t = (before - target) / (before - value)
            return math.exp(math.log(grid[j - 1]) + t * (math.log(grid[j])
                                                         - math.log(grid[j - 1])))
    return None


def _blocks(ranked: list[tuple[torch.Tensor, int]], shape: tuple[int, int, int], start: int,
            batch_size: int):
    """``(B, {layer: keep [B, P, F]})`` per forward: each circuit's first ``k`` of its order
    live, the features before ``start`` left to the forward."""
    n_layers, n_pos, width = shape
    for first in range(0, len(ranked), batch_size):
        block = ranked[first:first + batch_size]
        keep = torch.zeros(len(block), n_layers * n_pos * width, dtype=torch.bool)
        for row, (order, k) in enumerate(block):
            keep[row, order[:k]] = True
        keep = keep.view(len(block), n_layers, n_pos, width)
        keep[:, :, :start] = True
        yield len(block), {lay: keep[:, lay] for lay in range(n_layers)}


@measured
def budget_curve(model: BoundModel, tokenizer: PreTrainedTokenizerBase | None,
                 transcoder: Transcoder, graph: AttributionGraph,
                 counterfactual: str | list[int] | None = None, *,
                 reference: list[str] | None = None,
                 settings: FaithfulnessSettings | None = None, **keywords) -> BudgetCurve:
    """The feature-budget curve of ``graph``'s ranking (module docstring): KL and P(answer)
    with the top ``K`` features of ``budgets`` and all of them, beside ``draws`` random orders,
    and the random features needed to match. Settings: a :class:`FaithfulnessSettings` (its
    ``budgets``, ``rank_by``, ``ablation``, ``errors``, ``draws``, ``seed``, ``batch_size``)
    or its fields as keywords; ``counterfactual`` and ``reference`` as for
    :func:`~.faithfulness.faithfulness` (refused alike: :class:`~..errors.InputError` naming
    the argument)."""
    started = time.perf_counter()
    s = FaithfulnessSettings.merged(settings, **keywords)
    check_graph(model, transcoder, graph)
    cf, refs = ablation_prompts(model, tokenizer, graph, s, counterfactual, reference)
    answer = int(graph.target["token"])
    ids = torch.tensor([graph.input_ids], device=model.device)
    with torch.no_grad():
        full = model.model(input_ids=ids).logits[0, -1].float().cpu()
    ablated = ablated_values(model, transcoder, graph, s, cf, refs)
    clean = ablated.clean.cpu()
    order, n_graph = features_ranked(transcoder, graph, clean, s.rank_by)
    n_active = len(order)
    budgets = [*s.budgets, n_active]
    kept = [min(k, n_active) for k in budgets]
    grid = half_octave_grid(n_active, kept)
    g = torch.Generator().manual_seed(s.seed)
    universe = order.sort().values  # the random draws do not depend on the ranking
    draws = [universe[torch.randperm(n_active, generator=g)] for _ in range(s.draws)]
    circuits = [(order, 0)] + [(order, k) for k in kept] \
        + [(o, k) for o in draws for k in grid]
    # outside the top K: the ablated value where the clean run is active, else zero (held)
    outside = torch.where(ablated.clean != 0, ablated.features, 0)
    logits, forwards = run_masks(model, transcoder, graph,
                                 _blocks(circuits, tuple(clean.shape), graph.from_position,
                                         s.batch_size), outside, ablated.errors)
    kl = metric_of(logits, "kl", answer, None, full)
    prob = metric_of(logits, "prob", answer, None, full)
    n = 1 + len(kept)
    random_kl = kl[n:].reshape(s.draws, len(grid))
    matched = [float(k) if k == n_active else random_needed(grid, random_kl.mean(0).tolist(),
                                                             float(t))
               for k, t in zip(kept, kl[1:n].tolist(), strict=True)]
    return BudgetCurve(
        answer=graph.answer, settings=settings_json(s),
        n_active=n_active, n_graph=n_graph, budgets=budgets, kept=kept,
        kl=kl[1:n].tolist(), prob=prob[1:n].tolist(), grid=grid,
        random_kl=random_kl.tolist(), random_prob=prob[n:].reshape(s.draws, len(grid)).tolist(),
        prob_full=float(full.double().softmax(-1)[answer]), prob_empty=float(prob[0]),
        kl_empty=float(kl[0]), matched=matched, forwards=forwards,
        seconds=time.perf_counter() - started)
