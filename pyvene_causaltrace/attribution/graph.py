"""The attribution graph of one prompt: nodes, the computed rows of the edge matrix, and ways to
read them.

Nodes, in circuit-tracer's order: active features (layer, position, feature id), errors (layer
x position, layer-major), steering nodes (a pyvene ``IntervenableModel``'s interventions'
constant parts, :attr:`~AttributionGraph.steering`), tokens, then the logit nodes
(:attr:`~AttributionGraph.targets`, weighted by probability in influence and pruning). ``rows``
holds the logits' rows and the *explored* features'; under a feature-node budget the others are
leaves whose direct effects every row keeps, so each row still closes. Derived results are
memoised; files are written whole or not at all (:mod:`.graph_file`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..arguments import Fraction, checked
from ..errors import InputError
from .edges import Closure
from .export import graph_json, write_json
from .graph_file import load_graph, save_graph
from .plots import plot_graph
from .reading import Layout, PruneResult, graph_scores, influence, logit_weights, prune
from .settings import ReadingSettings
from .store import RowStore


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
    rows: RowStore
    closure: Closure
    metadata: dict[str, Any] = field(default_factory=dict)
    #: The user's interventions whose constant parts are steering nodes, in node order: each
    #: ``{"key", "class", "component", "module", "layer", "input", "positions"}`` (``layer``:
    #: the block the hooked module is in, None outside the blocks; ``input``: it edits the
    #: module's input; ``positions``: one node per position listed).
    steering: list[dict[str, Any]] = field(default_factory=list)
    #: The logit nodes, in node order: each a :meth:`~.targets.Target.describe` dict plus
    #: ``text`` (its token, or a direction's name). Default: the one ``target``, weight 1.
    targets: list[dict[str, Any]] = field(default_factory=list)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = [{**self.target, "prob": self.answer_prob, "weight": 1.0,
                             "text": self.answer}]

    def __repr__(self) -> str:
        return (f"AttributionGraph({self.prompt!r} -> {self.answer!r}: {self.n_features:,} "
                f"active features, {self.n_explored:,} with rows, {self.rows.nnz:,} stored "
                f"edges; closure {self.closure.relative:.1e})")

    # ----------------------------------------------------------------------- layout
    @property
    def from_position(self) -> int:
        """The first position the graph's splice covered: 1 when position 0 was BOS (graphs
        made before ``metadata["bos"]`` was recorded always treated it so), else 0."""
        return int((self.metadata.get("bos") or {}).get("first_spliced_position", 1))

    @property
    def n_pos(self) -> int:
        return len(self.input_ids)

    @property
    def n_features(self) -> int:
        return int(self.activation.numel())

    @property
    def n_steering(self) -> int:
        return sum(len(s["positions"]) for s in self.steering)

    @property
    def n_logits(self) -> int:
        return len(self.targets)

    @property
    def lorsa_layers(self) -> list[int]:
        """The layers whose attention a Lorsa replaced (:mod:`.lorsa_nodes`): their OV heads
        are the feature nodes from ``metadata["lorsa"]["first_node"]`` on, their errors the
        error nodes after the MLP errors, in this order."""
        return list((self.metadata.get("lorsa") or {}).get("layers", []))

    @property
    def first_lorsa_node(self) -> int:
        """The first Lorsa OV-head node (``n_features`` without a Lorsa)."""
        return int((self.metadata.get("lorsa") or {}).get("first_node", self.n_features))

    @property
    def layout(self) -> Layout:
        return Layout(self.n_features, (self.n_layers + len(self.lorsa_layers)) * self.n_pos,
                      self.n_pos, self.n_logits, self.n_steering)

    def logit_weights(self) -> torch.Tensor:
        """``[n_logits]`` float64: each logit node's weight in influence and pruning (its
        probability for salient logits, 1 for a single answer's target)."""
        return torch.tensor([float(t.get("weight", 1.0)) for t in self.targets],
                            dtype=torch.float64)

    @checked
    def steering_node(self, index: int) -> tuple[int, int]:
        """``(j, position)`` of steering node ``index``: ``self.steering[j]`` at that
        position."""
        if "steering_nodes" not in self._memo:
            self._memo["steering_nodes"] = [(j, int(p)) for j, s in enumerate(self.steering)
                                            for p in s["positions"]]
        return self._memo["steering_nodes"][index - self.layout.steering.start]

    @checked
    def steering_layer(self, j: int) -> int:
        """The layer whose output steering intervention ``j`` joins: its block's, or the one
        before for an edit of a block's input (-1: the embeddings, or outside the blocks)."""
        site = self.steering[j]
        layer = site.get("layer")
        if layer is None:
            return -1
        block_input = site.get("input") and site.get("module", "").split(".")[-1].isdecimal()
        return int(layer) - 1 if block_input else int(layer)

    @property
    def logit_node(self) -> int:
        """The first (most probable) logit node."""
        return self.layout.logits.start

    @property
    def explored(self) -> torch.Tensor:
        """``[n_features]`` bool: the features whose rows were computed."""
        return self.rows.row_of_node(self.layout.n_nodes)[:self.n_features] >= 0

    @property
    def n_explored(self) -> int:
        return int(self.explored.sum())

    @checked
    def row(self, node: int) -> torch.Tensor:
        """Dense row of ``node`` (``[n_nodes - n_logits]``: every source node's direct effect on
        its target); raises for a node without a row."""
        index = int(self.rows.row_of_node(self.layout.n_nodes)[node])
        if index < 0:
            raise InputError(f"node {node} ({self.label(node)}) has no computed row")
        return self.rows.dense([index])[0]

    @checked
    def target_row(self, logit: int | None = None) -> torch.Tensor:
        """Every node's direct effect on logit node ``logit`` (0: the first), or, by default,
        on the weighted mean target ``sum_i w_i * target_i / sum_i w_i`` (one target: its
        row)."""
        if logit is not None and not 0 <= logit < self.n_logits:
            raise InputError(f"logit node {logit} of {self.n_logits} (0..{self.n_logits - 1})")
        key = ("target_row", logit)
        if key not in self._memo:
            if logit is not None or self.n_logits == 1:
                self._memo[key] = self.row(self.layout.logits.start + (logit or 0))
            else:
                rows = [self.row(node) for node in range(self.layout.logits.start,
                                                         self.layout.n_nodes)]
                weights = self._mean_weights()
                self._memo[key] = sum(float(w) * r.double()
                                      for w, r in zip(weights, rows, strict=True)).float()
        return self._memo[key]

    def _mean_weights(self) -> torch.Tensor:
        """The logit weights scaled to sum to 1: a weighted mean of the targets."""
        weights = self.logit_weights()
        return weights / weights.sum()

    @checked
    def node_kind(self, index: int) -> str:
        lay = self.layout
        if index < lay.n_features:
            return "feature" if index < self.first_lorsa_node else "lorsa"
        if index < lay.steering.start:
            return "error" if index < lay.n_features + self.n_layers * self.n_pos \
                else "lorsa error"
        if index < lay.tokens.start:
            return "steering"
        return "token" if index < lay.logits.start else "logit"

    @checked
    def coordinates(self, i: int, kind: str | None = None
                    ) -> tuple[int | None, int, int | None, float | None]:
        """``(layer, position, feature, activation)`` of node ``i`` (of ``kind``, default
        :meth:`node_kind`'s; ``None`` where a kind has none; the logit's "feature" is its token
        id; a steering node's layer is :meth:`steering_layer`, its "feature" the index of its
        intervention in :attr:`steering`)."""
        lay, kind = self.layout, kind or self.node_kind(i)
        if kind in ("feature", "lorsa"):
            return (int(self.feature_layer[i]), int(self.feature_position[i]),
                    int(self.feature_id[i]), float(self.activation[i]))
        if kind in ("error", "lorsa error"):
            layer, pos = divmod(i - lay.n_features, self.n_pos)
            if layer >= self.n_layers:
                layer = self.lorsa_layers[layer - self.n_layers]
            return layer, pos, None, None
        if kind == "steering":
            j, pos = self.steering_node(i)
            return self.steering_layer(j), pos, j, None
        if kind == "token":
            return None, i - lay.tokens.start, None, None
        goal = self.targets[i - lay.logits.start]
        return self.n_layers, goal.get("position", -1) % self.n_pos, goal["token"], None

    @checked
    def label(self, i: int) -> str:
        """``F L2/#9970 @3 'iff'``, ``ERR L15 @10 ' of'``,
        ``STEER AdditionIntervention block_output L1 @3 'iff'``, ``TOK @3 'iff'``,
        ``LOGIT ' Paris'``."""
        kind = self.node_kind(i)
        layer, pos, feature, _ = self.coordinates(i, kind)
        if kind == "logit":
            return f"LOGIT {self.targets[i - self.layout.logits.start]['text']!r}"
        what = f"STEER {self.steering_site(feature)}" if kind == "steering" else {
            "feature": f"F L{layer}/#{feature}", "lorsa": f"LORSA L{layer}/H{feature}",
            "error": f"ERR L{layer}", "lorsa error": f"LORSA-ERR L{layer}", "token": "TOK"}[kind]
        return f"{what} @{pos} {self.tokens[pos]!r}"

    @checked
    def steering_site(self, j: int) -> str:
        """``AdditionIntervention block_output L1``: steering intervention ``j``'s class and
        where it acts."""
        site = self.steering[j]
        where = site.get("component") or site.get("module", "")
        layer = "" if site.get("layer") is None or "[" in where else f" L{site['layer']}"
        return f"{site.get('class', 'intervention')} {where}{layer}"

    @checked
    def labels(self, nodes: torch.Tensor) -> list[str]:
        return [self.label(int(i)) for i in nodes]

    def nodes(self) -> pd.DataFrame:
        """One row per node: kind, layer, position, token, feature (a logit's token id),
        activation, whether its row was computed, label, direct effect on the (weighted) target,
        influence, and each logit node's probability (``token_prob``)."""
        lay, n = self.layout, self.layout.n_nodes
        first, n_mlp = self.first_lorsa_node, self.n_layers * self.n_pos
        kind = (["feature"] * first + ["lorsa"] * (lay.n_features - first)
                + ["error"] * n_mlp + ["lorsa error"] * (lay.n_errors - n_mlp)
                + ["steering"] * lay.n_steering + ["token"] * lay.n_tokens
                + ["logit"] * lay.n_logits)
        logit = [self.coordinates(i, "logit") for i in range(lay.logits.start, n)]
        errors = torch.arange(lay.n_errors)
        steer = [self.coordinates(i, "steering") for i in range(lay.steering.start,
                                                                lay.steering.stop)]
        error_layer = torch.tensor(list(range(self.n_layers)) + self.lorsa_layers,
                                   dtype=torch.long)[errors // self.n_pos]
        layer = torch.cat([self.feature_layer.float(), error_layer.float(),
                           torch.tensor([float(c[0]) for c in steer]),
                           torch.full((lay.n_tokens,), float("nan")),
                           torch.full((lay.n_logits,), float(self.n_layers))])
        position = torch.cat([self.feature_position, errors % self.n_pos,
                              torch.tensor([c[1] for c in steer], dtype=torch.long),
                              torch.arange(self.n_pos),
                              torch.tensor([c[1] for c in logit], dtype=torch.long)])
        feature = torch.cat([self.feature_id.float(),
                             torch.full((lay.n_errors + lay.n_steering + lay.n_tokens,),
                                        float("nan")),
                             torch.tensor([float(c[2]) for c in logit])])
        activation = torch.cat([self.activation.float(), torch.full((n - lay.n_features,),
                                                                    float("nan"))])
        has_row = self.rows.row_of_node(n) >= 0
        frame = pd.DataFrame({
            "node": range(n), "kind": kind, "layer": pd.array(layer.tolist(), dtype="Int64"),
            "position": position.tolist(),
            "token": [self.tokens[p] for p in position.tolist()],
            "feature": pd.array(feature.tolist(), dtype="Int64"),
            "activation": activation.tolist(), "explored": has_row.tolist(),
            "direct": torch.cat([self.target_row(), torch.zeros(lay.n_logits)]).tolist(),
            "influence": self.influence().tolist(),
            "token_prob": [float("nan")] * lay.logits.start
            + [float("nan") if t.get("prob") is None else float(t["prob"])
               for t in self.targets]})
        frame.insert(7, "label", self.labels(torch.arange(n)))
        return frame

    # ---------------------------------------------------------------------- reading
    def influence(self) -> torch.Tensor:
        """Each node's influence on the targets (``w @ (A + A^2 + ...)`` on row-normalised
        ``|A|``, ``w`` the logit weights)."""
        if "influence" not in self._memo:
            self._memo["influence"] = influence(
                self.rows, logit_weights(self.layout, self.logit_weights()))
        return self._memo["influence"]

    @checked
    def direct_attributions(self, n: int = 10, logit: int | None = None) -> pd.DataFrame:
        """The ``n`` largest direct effects on the (weighted) target, or on logit node
        ``logit``, by magnitude, with labels."""
        row = self.target_row(logit)
        order = row.abs().argsort(descending=True)[:n]
        return pd.DataFrame({"node": order.tolist(), "label": self.labels(order),
                             "edge": row[order].tolist()})

    @checked
    def decomposition(self, logit: int | None = None) -> dict[str, float]:
        """The weighted mean target (:meth:`target_row`), or logit node ``logit``'s, split by node
        kind — explored features, unexplored features (no row of their own), errors, steering (the
        constants of a pyvene model's interventions; 0 without them), tokens — plus the constants,
        and the shares of errors and of unexplored features."""
        lay, row = self.layout, self.target_row(logit).double()
        rows = self.rows.row_of_node(lay.n_nodes)[lay.logits]
        weights = self._mean_weights() if logit is None else \
            torch.eye(lay.n_logits, dtype=torch.float64)[logit]
        features = row[:lay.n_features]
        explored = self.explored
        parts = {"features": float(features[explored].sum()),
                 "unexplored": float(features[~explored].sum()),
                 "errors": float(row[lay.errors].sum()),
                 "steering": float(row[lay.steering].sum()),
                 "tokens": float(row[lay.tokens].sum()),
                 "constants": float((weights * self.rows.constants[rows]).sum())}
        parts["target"] = target = float((weights * self.rows.targets[rows]).sum())
        nan = float("nan")  # a target of exactly 0 (e.g. a zero-ablated residual) has no shares
        parts["error_share"] = parts["errors"] / target if target else nan  # errors' share
        parts["unexplored_share"] = parts["unexplored"] / target if target else nan
        return parts

    @checked
    def prune(self, node_threshold: Fraction = ReadingSettings.node_threshold,
              edge_threshold: Fraction = ReadingSettings.edge_threshold, *,
              settings: ReadingSettings | None = None) -> PruneResult:
        """circuit-tracer's pruning (:func:`~.reading.prune`), memoised per thresholds (each
        a cumulative-influence fraction in [0, 1]; or ``settings``, a
        :class:`~.settings.ReadingSettings`, whose ``max_links`` pruning does not read)."""
        s = ReadingSettings.merged(settings, node_threshold=node_threshold,
                                  edge_threshold=edge_threshold)
        key = ("prune", s.node_threshold, s.edge_threshold)
        if key not in self._memo:
            self._memo[key] = prune(self.rows, self.layout, s.node_threshold, s.edge_threshold,
                                    self.logit_weights(), self.influence())
        return self._memo[key]

    def scores(self) -> dict[str, float]:
        """Replacement and completeness scores, the error nodes' share of the target, and the
        share of influence that ends on unexplored features."""
        if "scores" not in self._memo:
            out = graph_scores(self.rows, self.layout, self.logit_weights(), self.influence())
            out["error_share"] = self.decomposition()["error_share"]
            leaf = self.influence()[:self.n_features][~self.explored].sum()
            out["unexplored_influence"] = float(leaf / self.influence().sum().clamp(min=1e-30))
            self._memo["scores"] = out
        return self._memo["scores"]

    def closures(self) -> torch.Tensor:
        """Per computed row: ``row.sum() + constant - target`` (float64)."""
        return self.rows.sums() + self.rows.constants - self.rows.targets

    def row_closures(self) -> torch.Tensor:
        """Per computed row, ``|closure residual|`` over the scale of what it sums, ``sum |row|
        + |constant| + |target|`` plus the terms a feature's pre-activation sums (float64; the
        rows' :attr:`~.edges.Closure.relative`, :func:`~.edges.feature_targets_and_magnitudes`)."""
        scale = (self.rows.abs_sums() + self.rows.constants.abs() + self.rows.targets.abs()
                 + self.rows.magnitudes)
        return self.closures().abs() / scale.clamp(min=1e-30)

    def feature_closure(self) -> float:
        """Largest :meth:`row_closures` over the feature rows: each residual relative to the
        scale of what its row sums (a pre-activation can be near zero while its edges are
        not), against :data:`~.edges.CLOSURE_TOLERANCE` like the target row's."""
        features = self.rows.nodes < self.n_features
        if not features.any():
            return 0.0
        return float(self.row_closures()[features].max())

    # ------------------------------------------------------------------------ output
    @checked
    def to_dataframe(self, pruned: bool = False) -> pd.DataFrame:
        """Long-form edges (nonzero only; with ``pruned``, the pruned graph's): source, target,
        weight and both labels."""
        if pruned:
            kept = self.prune()
            target, source, weight = kept.edge_target, kept.edge_source, kept.edge_weight
        else:
            parts = [(self.rows.nodes[r], c, v) for r, c, v in self.rows.chunks()]
            target, source, weight = (torch.cat([p[i] for p in parts]) if parts
                                      else torch.zeros(0) for i in range(3))
        used = torch.unique(torch.cat([target, source]).long())
        names = pd.Series(self.labels(used), index=used.tolist())
        return pd.DataFrame({
            "source": source.tolist(), "target": target.tolist(), "weight": weight.tolist(),
            "source_label": names.reindex(source.tolist()).to_numpy(),
            "target_label": names.reindex(target.tolist()).to_numpy()})

    @checked
    def to_json(self, path: str | Path | None = None, **kwargs: Any) -> dict:
        """The circuit-tracer / Neuronpedia graph JSON (:func:`~.export.graph_json`: the pruning
        thresholds and ``max_links``, or ``settings=``, a :class:`~.settings.ReadingSettings`;
        labels, attention annotations); written compactly to ``path`` when given (whole or not
        at all)."""
        return write_json(graph_json(self, **kwargs), path)

    @checked
    def plot(self, path: str | Path | None = None, **kwargs: Any):
        """Static figure of the pruned graph (:func:`~.plots.plot_graph`: the pruning
        thresholds or ``settings=``, and how many nodes and edges are drawn)."""
        return plot_graph(self, path, **kwargs)

    # ---------------------------------------------------------------------- files
    @checked
    def save(self, path: str | Path) -> None:
        """Write the graph to one safetensors file (:func:`~.graph_file.save_graph`: tensors,
        and everything else as JSON in its header; never a pickle, never half a file)."""
        save_graph(self, path)

    @classmethod
    def load(cls, path: str | Path) -> AttributionGraph:
        """Read a file written by :meth:`save` (:func:`~.graph_file.load_graph`); anything else
        is refused with :class:`GraphFileError`."""
        return load_graph(path, cls)
