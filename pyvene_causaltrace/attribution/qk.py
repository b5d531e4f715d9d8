"""Attention inside the graph: what a head's pre-softmax score is made of.

An exact decomposition of the local replacement model, as :mod:`.heads`' (Anthropic's "Tracing
Attention Computation Through Feature Interactions", 2025). A head's score at query ``q`` and
key ``k`` is ``s = scaling * <query[q], key[k]>``, each side after every transform (projections,
frozen q/k norms, rotary). Each side is linear in the graph's nodes plus constants, so it is the
sum of its nodes' parts (one batched backward per side, closing on the vector exactly), and
``s`` the sum of ``scaling * <query part of i, key part of j>`` over every pair, the constants
one node ``"constants"`` per side. A soft-capped score (Gemma-2) is decomposed before its cap.

    qk = qk_attribution(model, transcoder, graph, layer=2, head=1, query_pos=-1, key_pos=3)
    qk.terms.head(10)                                         # the largest bilinear terms"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..arguments import MemoryMB, check_index, checked
from ..bound import BoundModel
from ..errors import ClosureError, InputError, UnsupportedModelError
from ..model_guard import measured
from ..transcoders.transcoder import Transcoder
from .edges import CLOSURE_TOLERANCE
from .export import write_json
from .graph_replay import Replay, chosen_layers, replay_graph, replay_rows
from .plots import finish

if TYPE_CHECKING:  # annotations only
    from .graph import AttributionGraph

__all__ = ["QKAttribution", "check_qk_supported", "qk_attribution", "score_terms"]


@dataclass
class QKAttribution:
    """Head ``head`` of ``layer``'s pre-softmax score at (``query_pos``, ``key_pos``) as a sum
    of bilinear terms between the nodes on the query side and on the key side (module
    docstring).

    ``query_parts [n_q, head_dim]`` / ``key_parts [n_k, head_dim]``: each contributing node's
    part of the vector, ``query_nodes`` / ``key_nodes`` their node indices (-1, the last: the
    constants). Every term sums to ``score`` (``residual``: the float rounding)."""

    layer: int
    head: int
    query_pos: int
    key_pos: int
    score: float
    scaling: float
    softcap: float | None
    query_nodes: torch.Tensor
    key_nodes: torch.Tensor
    query_parts: torch.Tensor = field(repr=False)
    key_parts: torch.Tensor = field(repr=False)
    labels: list[str] = field(repr=False)

    def _label(self, node: int) -> str:
        return "constants" if node < 0 else self.labels[node]

    def term_matrix(self) -> torch.Tensor:
        """``[n_q, n_k]`` float64: every term (their sum is the score)."""
        return self.scaling * self.query_parts.double() @ self.key_parts.double().T

    @property
    def residual(self) -> float:
        """``sum of all terms - score`` (float64)."""
        total = self.scaling * float(self.query_parts.double().sum(0)
                                     @ self.key_parts.double().sum(0))
        return total - self.score

    @checked
    def top_terms(self, n: int = 20) -> pd.DataFrame:
        """The ``n`` largest terms by magnitude: query node, key node, value, share of the
        score."""
        matrix = self.term_matrix()
        flat = matrix.flatten()
        order = flat.abs().topk(min(n, flat.numel())).indices
        rows, cols = order // matrix.shape[1], order % matrix.shape[1]
        return pd.DataFrame({
            "query": [self._label(int(self.query_nodes[r])) for r in rows],
            "key": [self._label(int(self.key_nodes[c])) for c in cols],
            "query_node": self.query_nodes[rows].tolist(),
            "key_node": self.key_nodes[cols].tolist(),
            "term": flat[order].tolist(),
            "share": (flat[order] / self.score).tolist() if self.score else None})

    @property
    def terms(self) -> pd.DataFrame:
        return self.top_terms()

    def _marginals(self, parts: torch.Tensor, other: torch.Tensor,
                   nodes: torch.Tensor) -> pd.DataFrame:
        values = self.scaling * (parts.double() @ other.double().sum(0))
        order = values.abs().argsort(descending=True)
        return pd.DataFrame({"node": nodes[order].tolist(),
                             "label": [self._label(int(nodes[i])) for i in order],
                             "marginal": values[order].tolist()})

    def query_marginals(self) -> pd.DataFrame:
        """Each query-side node's terms summed over every key-side node, largest first."""
        return self._marginals(self.query_parts, self.key_parts, self.query_nodes)

    def key_marginals(self) -> pd.DataFrame:
        """Each key-side node's terms summed over every query-side node, largest first."""
        return self._marginals(self.key_parts, self.query_parts, self.key_nodes)

    @checked
    def to_dataframe(self, n: int = 20) -> pd.DataFrame:
        return self.top_terms(n)

    @checked
    def to_dict(self, n: int = 20) -> dict[str, Any]:
        """JSON-ready: the score, its top ``n`` terms and marginals."""
        return {"layer": self.layer, "head": self.head, "query_pos": self.query_pos,
                "key_pos": self.key_pos, "score": self.score, "scaling": self.scaling,
                "softcap": self.softcap, "residual": self.residual,
                "terms": self.top_terms(n).to_dict("records"),
                "query_marginals": self.query_marginals().head(n).to_dict("records"),
                "key_marginals": self.key_marginals().head(n).to_dict("records")}

    @checked
    def to_json(self, path: str | Path | None = None, n: int = 20) -> dict[str, Any]:
        return write_json(self.to_dict(n), path)

    @checked
    def plot(self, n: int = 15, path: str | Path | None = None):
        """Bars of the ``n`` largest terms; returns the figure."""
        import matplotlib.pyplot as plt  # heavy: only when a picture is asked for

        top = self.top_terms(n).iloc[::-1]
        fig, ax = plt.subplots(figsize=(7, 0.8 + 0.3 * len(top)))
        ax.barh([f"{q}  ·  {k}" for q, k in zip(top["query"], top["key"], strict=True)],
                top["term"], color=["#b2182b" if v > 0 else "#2166ac" for v in top["term"]])
        ax.set_xlabel("term of the score")
        ax.set_title(f"L{self.layer} H{self.head}: query @{self.query_pos}, key "
                     f"@{self.key_pos}, score {self.score:+.4g}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        return finish(fig, path, dpi=120)


def _side_parts(replay: Replay, vector_of: torch.Tensor, index: tuple, what: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's part ``[n_sources + 1, d]`` of the vector ``vector_of[index]`` (the last row:
    the constants) from one batched backward; refused unless the parts sum to the vector."""
    vector = vector_of[index]
    d = vector.shape[-1]
    seeds = torch.zeros(d, *vector_of.shape, dtype=vector_of.dtype, device=vector_of.device)
    for c in range(d):
        seeds[(c, *index, c)] = 1.0
    rows, constants = replay_rows(replay, vector_of, seeds)
    parts = torch.cat([rows.T.double(), constants.double()[None]]).cpu()  # [n + 1, d]
    value = vector.detach().double().cpu()
    scale = float(parts.abs().sum(0).max()) + float(value.abs().max())
    worst = float((parts.sum(0) - value).abs().max())
    if worst > CLOSURE_TOLERANCE * max(scale, 1e-30):
        raise ClosureError(f"the {what}'s node parts do not sum to it (residual {worst:.3g} of "
                           f"{scale:.3g}): something in the forward is not linear in the "
                           "graph's nodes")
    return parts, value


def _positions(graph: AttributionGraph, query_pos: int, key_pos: int) -> tuple[int, int]:
    """Both positions checked and made non-negative."""
    query_pos, key_pos = (check_index(name, pos, graph.n_pos, "positions of the prompt",
                                      negative=True)
                          for name, pos in (("query_pos", query_pos), ("key_pos", key_pos)))
    if key_pos > query_pos:
        raise InputError(f"key_pos {key_pos} is after query_pos {query_pos}: a causal head "
                         "never attends there")
    return query_pos, key_pos


def score_terms(replay: Replay, layer: int, head: int, query_pos: int,
                key_pos: int) -> QKAttribution:
    """:func:`qk_attribution` on a replay that kept the queries and keys."""
    bound, graph = replay.bound, replay.graph
    check_qk_supported(bound)
    head = check_index("head", head, bound.n_heads, "heads of the model")
    query_pos, key_pos = _positions(graph, query_pos, key_pos)
    query, key, kwargs = replay.qk[layer]
    kv_head = head // (query.shape[1] // key.shape[1])  # grouped-query: the shared key head
    query_parts, query_vec = _side_parts(replay, query, (0, head, query_pos), "query")
    key_parts, key_vec = _side_parts(replay, key, (0, kv_head, key_pos), "key")
    scaling = _scaling(bound.module("attn", layer), kwargs, query.shape[-1])
    nodes = torch.arange(len(query_parts))
    nodes[-1] = -1
    keep_q, keep_k = query_parts.ne(0).any(1), key_parts.ne(0).any(1)
    return QKAttribution(
        layer=layer, head=head, query_pos=query_pos, key_pos=key_pos,
        score=scaling * float(query_vec @ key_vec), scaling=scaling,
        softcap=kwargs.get("softcap"), query_nodes=nodes[keep_q], key_nodes=nodes[keep_k],
        query_parts=query_parts[keep_q], key_parts=key_parts[keep_k],
        labels=[graph.label(i) for i in range(len(query_parts) - 1)])


@measured
def qk_attribution(model: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
                   layer: int, head: int, query_pos: int, key_pos: int, *,
                   memory_mb: MemoryMB | None = None) -> QKAttribution:
    """Decompose head ``head`` of ``layer``'s pre-softmax score at (``query_pos``, ``key_pos``;
    negative counts from the end) on ``graph``'s prompt into bilinear node-pair terms (module
    docstring). ``model`` and ``transcoder`` are the graph's (replayed and checked as in
    :func:`head_loadings`; ``memory_mb`` as there)."""
    (layer,) = chosen_layers(layer, model.n_layers)
    head = check_index("head", head, model.n_heads, "heads of the model")
    _positions(graph, query_pos, key_pos)  # refused before the forward
    replayed = replay_graph(model, transcoder, graph, [layer], qk=True, memory_mb=memory_mb)
    return score_terms(replayed, layer, head, query_pos, key_pos)


def check_qk_supported(bound: BoundModel) -> None:
    """Refuse QK attribution where its score is not known to be the model's: under a
    transformers older than the adapter's ``qk_from`` (Gemma-2 under 4: with a soft cap of 0.3
    the eager pattern there is not the softmax of the capped scores; under 5 it is,
    tests/test_heads.py)."""
    import transformers  # loaded already: the model is a transformers model

    if int(transformers.__version__.split(".")[0]) < bound.adapter.qk_from:
        raise UnsupportedModelError(
            f"QK attribution of {bound.model_type} is checked against the model's attention "
            f"pattern under transformers {bound.adapter.qk_from} or later only (this is "
            f"{transformers.__version__}, where the check fails): upgrade transformers; head "
            "loadings are not affected")


def _scaling(attention: torch.nn.Module, kwargs: dict, head_dim: int) -> float:
    """The factor on ``<query, key>``: the one the model passes its attention function, else
    (GPT-2 under older transformers) its own rule."""
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(attention, "scaling", None)
    if scaling is None:
        scaling = head_dim ** -0.5 if getattr(attention, "scale_attn_weights", True) else 1.0
        if getattr(attention, "scale_attn_by_inverse_layer_idx", False):
            scaling /= float(attention.layer_idx + 1)
    return float(scaling)
