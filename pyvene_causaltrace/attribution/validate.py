"""The graph's test on the real model: ablate what it blames, watch the answer.

In the spliced model (every MLP replaced by the CLT plus the clean run's error, attention and
norms live, so unablated it *is* the original model) zero the ``n`` feature nodes the graph ranks
highest and compare the answer's probability with ablating ``n`` random active ones, over draws."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..bound import BoundModel
from ..errors import InputError
from ..interventions.clt_splice import clean_errors, clt_splice_representations
from ..model_guard import measured
from ..runtime import intervened
from ..transcoders.transcoder import Transcoder
from .faithfulness import check_logit_graph

if TYPE_CHECKING:  # annotations only
    from .graph import AttributionGraph


@dataclass
class AblationResult:
    """Answer probabilities: clean, spliced (unablated), graph's top-``n`` ablated, and random
    ``n`` ablated (one per draw), for each ``n``."""

    answer: str
    clean_prob: float
    spliced_prob: float
    rank_by: str
    top: dict[int, float]
    random: dict[int, list[float]]

    def to_dataframe(self) -> pd.DataFrame:
        rows = []
        for n, prob in self.top.items():
            rand = torch.tensor(self.random[n])
            rows.append({"n_ablated": n, "top_prob": prob,
                         "random_mean": float(rand.mean()), "random_min": float(rand.min()),
                         "random_max": float(rand.max()), "draws": len(self.random[n]),
                         "top_drop": self.spliced_prob - prob,
                         "random_drop": self.spliced_prob - float(rand.mean())})
        return pd.DataFrame(rows)

    def to_dict(self) -> dict:
        return asdict(self)


def _ablations(graph, nodes: list[int]) -> list[dict]:
    groups: dict[tuple[int, int], list[int]] = {}
    for i in nodes:
        key = (int(graph.feature_layer[i]), int(graph.feature_position[i]))
        groups.setdefault(key, []).append(int(graph.feature_id[i]))
    return [{"clt_layer": layer, "positions": [pos], "features": features}
            for (layer, pos), features in sorted(groups.items())]


def answer_prob(model: BoundModel, transcoder: Transcoder, ids: torch.Tensor,
                errors: torch.Tensor, token: int, ablate: list[int], graph) -> float:
    """P(token) in the spliced model with the feature nodes ``ablate`` zeroed."""
    reps = clt_splice_representations(model, transcoder, errors=errors,
                                      from_position=graph.from_position,
                                      ablations=_ablations(graph, ablate))
    with torch.no_grad(), intervened(model, reps) as spliced:
        out = spliced(input_ids=ids)
    return float(out.logits[0, -1].float().softmax(-1)[token])


def ranking(graph, rank_by: str = "influence") -> list[int]:
    """Feature nodes, most blamed first: by ``"influence"`` on the target, or by ``"direct"``
    (signed direct effect, largest positive first)."""
    n = graph.n_features
    if rank_by == "influence":
        score = graph.influence()[:n]
    elif rank_by == "direct":
        score = graph.target_row()[:n]
    else:
        raise InputError(f"rank_by must be 'influence' or 'direct', got {rank_by!r}")
    return score.argsort(descending=True).tolist()


@measured
def ablation_test(model: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
                  sizes: tuple[int, ...] = (5, 10, 20), draws: int = 10, seed: int = 0,
                  rank_by: str = "influence") -> AblationResult:
    """Ablate the graph's top ``n`` features vs ``draws`` random sets of ``n`` (each ``n`` in
    ``sizes``, at most the number of active features) in the model spliced with
    ``transcoder``. The probability read is the first logit node's (the answer's, or the most
    probable of several). ``model`` is bound once (``@measured``) for every spliced run."""
    check_logit_graph(graph, "the ablation test")
    ids = torch.tensor([graph.input_ids], device=model.device)
    errors = clean_errors(model, transcoder, ids, graph.from_position)
    token = int(graph.target["token"])
    with torch.no_grad():
        clean = float(model.model(input_ids=ids).logits[0, -1].float().softmax(-1)[token])
    spliced = answer_prob(model, transcoder, ids, errors, token, [], graph)
    order = ranking(graph, rank_by)
    g = torch.Generator().manual_seed(seed)
    top, random = {}, {}
    for n in sizes:
        n = min(n, graph.n_features)
        top[n] = answer_prob(model, transcoder, ids, errors, token, order[:n], graph)
        random[n] = [answer_prob(model, transcoder, ids, errors, token,
                                 torch.randperm(graph.n_features, generator=g)[:n].tolist(),
                                 graph) for _ in range(draws)]
    return AblationResult(graph.answer, clean, spliced, rank_by, top, random)
