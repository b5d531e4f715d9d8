"""The attribution graph of one prompt: nodes, the exact edge matrix, and ways to read it.

Nodes, in circuit-tracer's order: active features (layer, position, feature id), errors (one per
layer x position, layer-major), tokens (one per position), and the target (the logit node).
``adjacency`` holds a row per feature node plus the target row: ``adjacency[r, c]`` is source
node ``c``'s direct effect on row ``r``'s target. ``constants`` is what the model's biases and
``b_dec`` add to each row, so ``adjacency[r].sum() + constants[r]`` is the row's target.

    graph = attribute(model, tokenizer, clt, "The Eiffel Tower is in the city of", " Paris")
    graph.closure                       # target, sum of edges, residual
    graph.direct_attributions(10)       # DataFrame
    graph.prune()                       # PruneResult (node and edge masks)
    graph.to_json("graph.json")         # circuit-tracer / Neuronpedia viewer format
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from .edges import Closure
from .reading import Layout, graph_scores, node_influence, prune


@dataclass
class AttributionGraph:
    """See module docstring. Tensors live on the CPU."""

    prompt: str
    tokens: list[str]
    input_ids: list[int]
    target: dict[str, Any]
    answer: str
    answer_prob: float
    n_layers: int
    feature_layer: torch.Tensor
    feature_position: torch.Tensor
    feature_id: torch.Tensor
    activation: torch.Tensor
    adjacency: torch.Tensor
    constants: torch.Tensor
    row_targets: torch.Tensor
    closure: Closure
    metadata: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------------- layout
    @property
    def n_pos(self) -> int:
        return len(self.input_ids)

    @property
    def n_features(self) -> int:
        return int(self.activation.numel())

    @property
    def layout(self) -> Layout:
        return Layout(self.n_features, self.n_layers * self.n_pos, self.n_pos, 1)

    def square(self) -> torch.Tensor:
        """``[N, N]`` adjacency over all nodes (rows = targets; error and token rows empty)."""
        lay = self.layout
        full = torch.zeros(lay.n_nodes, lay.n_nodes, dtype=self.adjacency.dtype)
        full[:lay.n_features, :lay.logits.start] = self.adjacency[:-1]
        full[-1, :lay.logits.start] = self.adjacency[-1]
        return full

    def node_kind(self, index: int) -> str:
        lay = self.layout
        if index < lay.n_features:
            return "feature"
        if index < lay.tokens.start:
            return "error"
        return "token" if index < lay.logits.start else "logit"

    def nodes(self) -> pd.DataFrame:
        """One row per node: kind, layer, position, token, feature, activation, label, direct
        effect on the target and influence."""
        lay = self.layout
        influence = self.influence()
        direct = torch.cat([self.adjacency[-1], torch.zeros(1)])
        records = []
        for i in range(lay.n_nodes):
            kind = self.node_kind(i)
            layer, pos, feature, act = self.coordinates(i, kind)
            records.append({"node": i, "kind": kind, "layer": layer, "position": pos,
                            "token": self.tokens[pos], "feature": feature, "activation": act,
                            "label": self.label(i), "direct": float(direct[i]),
                            "influence": float(influence[i])})
        return pd.DataFrame.from_records(records)

    def coordinates(self, i: int, kind: str) -> tuple[int | None, int, int | None, float | None]:
        """``(layer, position, feature, activation)`` of node ``i`` of ``kind`` (``None`` where
        a kind has none; the logit's "feature" is its token id)."""
        lay = self.layout
        if kind == "feature":
            return (int(self.feature_layer[i]), int(self.feature_position[i]),
                    int(self.feature_id[i]), float(self.activation[i]))
        if kind == "error":
            layer, pos = divmod(i - lay.n_features, self.n_pos)
            return layer, pos, None, None
        if kind == "token":
            return None, i - lay.tokens.start, None, None
        return self.n_layers, self.n_pos - 1, self.target["token"], None

    def label(self, i: int) -> str:
        """``F L2/#9970 @3 'iff'``, ``ERR L15 @10 ' of'``, ``TOK @3 'iff'``, ``LOGIT ' Paris'``."""
        kind = self.node_kind(i)
        layer, pos, feature, _ = self.coordinates(i, kind)
        token = repr(self.tokens[pos])
        if kind == "feature":
            return f"F L{layer}/#{feature} @{pos} {token}"
        if kind == "error":
            return f"ERR L{layer} @{pos} {token}"
        if kind == "token":
            return f"TOK @{pos} {token}"
        return f"LOGIT {self.answer!r}"

    # ---------------------------------------------------------------------- reading
    def influence(self) -> torch.Tensor:
        """Each node's influence on the target (``A + A^2 + ...`` on row-normalised ``|A|``)."""
        return node_influence(self.square(), self.layout)

    def direct_attributions(self, n: int = 10) -> pd.DataFrame:
        """The ``n`` largest direct effects on the target, by magnitude, with labels."""
        row = self.adjacency[-1]
        order = row.abs().argsort(descending=True)[:n]
        return pd.DataFrame({"node": order.tolist(), "label": [self.label(int(i)) for i in order],
                             "edge": row[order].tolist()})

    def decomposition(self) -> dict[str, float]:
        """The target split by node kind (features, errors, tokens) plus the constants."""
        lay, row = self.layout, self.adjacency[-1].double()
        parts = {"features": float(row[:lay.n_features].sum()),
                 "errors": float(row[lay.errors].sum()),
                 "tokens": float(row[lay.tokens].sum()),
                 "constants": float(self.constants[-1])}
        parts["target"] = self.closure.target
        parts["error_share"] = parts["errors"] / self.closure.target  # the seed's 5.3%
        return parts

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98):
        """circuit-tracer's pruning (:func:`~.reading.prune`)."""
        return prune(self.square(), self.layout, node_threshold, edge_threshold)

    def scores(self) -> dict[str, float]:
        """Replacement and completeness scores, and the error nodes' share of the target."""
        out = graph_scores(self.square(), self.layout)
        out["error_share"] = self.decomposition()["error_share"]
        return out

    def feature_closure(self) -> float:
        """Largest closure residual over the feature rows, relative to the largest feature
        pre-activation (rows near zero make per-row ratios meaningless)."""
        if self.n_features == 0:
            return 0.0
        rows = self.adjacency[:-1].double().sum(1) + self.constants[:-1].double()
        targets = self.row_targets[:-1].double()
        return float((rows - targets).abs().max() / targets.abs().max().clamp(min=1e-12))

    # ------------------------------------------------------------------------ output
    def to_dataframe(self, pruned: bool = False) -> pd.DataFrame:
        """Long-form edges (nonzero only; with ``pruned``, the pruned graph's): source, target,
        weight and both labels."""
        full = self.square()
        if pruned:
            full = full * self.prune().edge_mask
        target, source = full.nonzero(as_tuple=True)
        labels = pd.Series([self.label(i) for i in range(self.layout.n_nodes)])
        return pd.DataFrame({
            "source": source.tolist(), "target": target.tolist(),
            "weight": full[target, source].tolist(),
            "source_label": labels[source.numpy()].to_numpy(),
            "target_label": labels[target.numpy()].to_numpy()})

    def to_json(self, path: str | Path | None = None, **kwargs: Any) -> dict:
        """The circuit-tracer / Neuronpedia graph JSON (:func:`~.export.graph_json`); written
        to ``path`` when given."""
        from .export import graph_json

        payload = graph_json(self, **kwargs)
        if path is not None:
            Path(path).write_text(json.dumps(payload))
        return payload

    def plot(self, path: str | Path | None = None, **kwargs: Any):
        """Static figure of the pruned graph (:func:`~.plots.plot_graph`)."""
        from .plots import plot_graph

        return plot_graph(self, path, **kwargs)

    def save(self, path: str | Path) -> None:
        """Write the whole graph (tensors and metadata) to one ``.pt`` file."""
        torch.save({"format": "pyvene_causaltrace.attribution_graph/1", **self.__dict__,
                    "closure": self.closure.to_dict()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> AttributionGraph:
        state = torch.load(str(path), weights_only=False)
        state.pop("format")
        c = state.pop("closure")
        return cls(**state, closure=Closure(c["target"], c["edges"], c["constant"]))
