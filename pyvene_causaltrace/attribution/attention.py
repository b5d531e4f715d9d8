"""The heads a pruned graph's edges cross, for the export and the viewer.

:func:`attention_annotations` splits every kept edge that crosses positions by head
(:mod:`.heads`) and decomposes its leading head's score at the edge's two positions into QK
terms (:mod:`.qk`); :meth:`AttentionAnnotations.annotate` writes them where Neuronpedia's schema
tolerates them (``links[i].heads``, top-level ``attention.qk``: docs/attribution.md,
"Attention inside the graph").

    annotations = attention_annotations(model, transcoder, graph)
    graph.to_json("graph.json", attention=annotations)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from ..arguments import Fraction, MemoryMB, NonNegativeInt, PositiveInt, checked
from ..bound import BoundModel
from ..errors import InputError
from ..model_guard import measured
from ..transcoders.transcoder import Transcoder
from .export import node_id
from .graph_replay import replay_graph
from .heads import node_loadings
from .identity import graph_identity
from .qk import QKAttribution, score_terms
from .reading import PruneResult
from .settings import ReadingSettings

if TYPE_CHECKING:  # annotations only
    from .graph import AttributionGraph

#: Head parts kept per link, QK terms and marginals kept per head.
TOP_HEADS = 3
TOP_TERMS = 10


@dataclass
class AttentionAnnotations:
    """The annotations of the graph whose :func:`~.identity.graph_identity` is ``graph``: per
    kept cross-position edge ``(source, target)`` its largest head parts (``links``:
    ``[(layer, head, part)]``), and the QK decompositions of the edges' leading heads
    (``qk``)."""

    graph: str
    links: dict[tuple[int, int], list[tuple[int, int, float]]]
    qk: list[QKAttribution] = field(default_factory=list)

    @checked
    def check(self, graph: AttributionGraph, identity: str | None = None) -> None:
        """Refuse (:class:`InputError`) a graph other than the one annotated: its node indices
        would name other nodes."""
        identity = identity or graph_identity(graph)
        if identity != self.graph:
            raise InputError(f"these attention annotations were computed on another graph "
                             f"(identity {self.graph}, this one {identity}: another prompt, "
                             "transcoder, model or setting); compute them on this graph: "
                             "attention_annotations(model, transcoder, graph)")

    def annotate(self, payload: dict[str, Any], graph: AttributionGraph,
                 identity: str | None = None) -> dict[str, Any]:
        """``payload`` (the graph JSON of ``graph``) with ``heads`` on its annotated links and
        ``attention.qk`` at the top (module docstring); refused on another graph."""
        self.check(graph, identity)
        by_ids = {(node_id(graph, s), node_id(graph, t)): heads
                  for (s, t), heads in self.links.items()}
        for link in payload["links"]:
            heads = by_ids.get((link["source"], link["target"]))
            if heads:
                link["heads"] = [[layer, head, part] for layer, head, part in heads]
        payload["attention"] = {"qk": [_qk_json(result, graph) for result in self.qk]}
        return payload


def _qk_json(result: QKAttribution, graph: AttributionGraph) -> dict[str, Any]:
    """One QK decomposition in Neuronpedia CRM's QK lists, with labels for the ids."""
    def ident(node: int) -> str:
        return "constants" if node < 0 else node_id(graph, node)

    terms = result.top_terms(TOP_TERMS)
    queries = result.query_marginals().head(TOP_TERMS)
    keys = result.key_marginals().head(TOP_TERMS)
    named = {int(n) for n in [*terms["query_node"], *terms["key_node"], *queries["node"],
                              *keys["node"]]}
    return {"layer": result.layer, "head": result.head, "query_pos": result.query_pos,
            "key_pos": result.key_pos, "score": result.score, "residual": result.residual,
            "softcap": result.softcap,
            "pair_wise_contributors": [[ident(q), ident(k), v] for q, k, v in zip(
                terms["query_node"], terms["key_node"], terms["term"], strict=True)],
            "top_q_marginal_contributors": [[ident(n), v] for n, v in zip(
                queries["node"], queries["marginal"], strict=True)],
            "top_k_marginal_contributors": [[ident(n), v] for n, v in zip(
                keys["node"], keys["marginal"], strict=True)],
            "labels": {ident(n): ("constants" if n < 0 else graph.label(n)) for n in named}}


def crossing_edges(graph: AttributionGraph, pruned: PruneResult) -> list[tuple[int, int]]:
    """The pruned graph's edges ``(source, target)`` whose source and target sit at different
    positions, largest edge score first."""
    order = pruned.edge_score.argsort(descending=True)
    edges = []
    for i in order.tolist():
        source, target = int(pruned.edge_source[i]), int(pruned.edge_target[i])
        if graph.coordinates(source)[1] != graph.coordinates(target)[1]:
            edges.append((source, target))
    return edges


@measured
def attention_annotations(model: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
                          *, node_threshold: Fraction = ReadingSettings.node_threshold,
                          edge_threshold: Fraction = ReadingSettings.edge_threshold,
                          max_edges: NonNegativeInt = 200, top_heads: PositiveInt = TOP_HEADS,
                          max_qk: NonNegativeInt = 16, memory_mb: MemoryMB | None = None,
                          progress: bool = False,
                          settings: ReadingSettings | None = None) -> AttentionAnnotations:
    """Head parts of the ``max_edges`` kept cross-position edges of largest score
    (:func:`crossing_edges`, pruned by ``settings``' thresholds) and the QK terms of the leading
    heads of the first ``max_qk`` distinct (layer, head, positions) among them; backwards take as
    many rows as fit ``memory_mb`` (default the attribution settings')."""
    reading = ReadingSettings.merged(settings, node_threshold=node_threshold,
                                    edge_threshold=edge_threshold)
    edges = crossing_edges(graph, graph.prune(settings=reading))[:max_edges]
    layers = list(range(model.n_layers))
    replay = replay_graph(model, transcoder, graph, layers, qk=max_qk > 0, memory_mb=memory_mb)
    by_target: dict[int, list[int]] = {}
    for source, target in edges:
        by_target.setdefault(target, []).append(source)
    links: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for target, sources in tqdm(by_target.items(), total=len(by_target), desc="heads (targets)",
                                disable=not progress):
        _, _, parts, _ = node_loadings(replay, target, layers)
        for source in sources:
            column = parts[:, :, source]
            order = column.flatten().abs().argsort(descending=True)[:top_heads]
            links[(source, target)] = [(layers[int(i) // column.shape[1]],
                                        int(i) % column.shape[1], float(column.flatten()[i]))
                                       for i in order if float(column.flatten()[i]) != 0.0]
    # each leading head once, at its edge's (query, key) positions, in the edges' order
    wanted = dict.fromkeys((heads[0][0], heads[0][1], graph.coordinates(target)[1],
                            graph.coordinates(source)[1])
                           for (source, target), heads in links.items() if heads)
    qk = [score_terms(replay, *key) for key in list(wanted)[:max_qk]]
    return AttentionAnnotations(graph_identity(graph), links, qk)

