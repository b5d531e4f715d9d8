"""Attention inside the graph: which heads carry an edge, and what a head's score is made of.

Two exact decompositions of the graph's local replacement model (attention patterns and norm
scales frozen, so a node's effect on a target is linear): Anthropic's "Tracing Attention
Computation Through Feature Interactions" (transformer-circuits.pub, 2025), circuit-tracer
PR #114's head loadings.

**Head loadings** (:func:`head_loadings`). Every path from a source node to the target crosses
layer ``l``'s attention through exactly one head, or skips it. Head ``h``'s output is the
``h``-th ``head_dim`` slice ``z[l, h]`` of the input of layer ``l``'s output projection (the
adapter's ``attn_out``: ``o_proj``, GPT-2's ``c_proj``; with grouped-query attention one slice
per query head). With ``g[l] = d target / d z[l]`` from one backward, the part of source ``i``'s
edge through head ``h`` is ``x_i * d <g[l, h], z[l, h]> / d x_i``: the row of a scalar, computed
as any target's row is (:func:`~.edges.edges_from_grads`), for every source at once; one batched
backward per layer gives all its heads. The bypass (paths that skip layer ``l``'s attention) is
the edge minus its heads' parts. The tests check both sides against independent references (the
edge recomputed with other heads' outputs detached).

**QK attribution** (:func:`qk_attribution`). A head's pre-softmax score at query position ``q``
and key position ``k`` is ``s = scaling * <query[q], key[k]>``, each side taken after every
transform (projections, q/k norms frozen as the graph freezes norms, rotary). Each side is linear
in the graph's nodes plus constants (biases, ``b_dec``), so it is the sum of its nodes'
contributions (one batched backward of ``head_dim`` seeds per side; the rows close on the vector
exactly, as a graph's rows close on their target), and ``s`` is the sum of the bilinear terms
``scaling * <query part of node i, key part of node j>`` over every pair, the constants included
as one node ``"constants"`` per side. A score soft-capped by the model (Gemma-2) is decomposed
before its cap.

    loadings = head_loadings(model, transcoder, graph)        # the first logit node's edges
    loadings.of(source)                                       # DataFrame: layer, head, part
    qk = qk_attribution(model, transcoder, graph, layer=2, head=1, query_pos=-1, key_pos=3)
    qk.terms.head(10)                                         # the largest bilinear terms
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..applier import Call, Edit, applying
from ..arguments import MemoryMB, check_index, checked
from ..bound import BoundModel
from ..errors import ClosureError, InputError, UnsupportedModelError
from ..interventions.frozen import watching_qk
from ..model_guard import measured
from ..transcoders.transcoder import Transcoder, check_fits
from .budget import batch_size_for
from .edges import CLOSURE_TOLERANCE, edges_from_grads
from .export import write_json
from .leaf_grads import leaf_grads
from .replacement import ReplacementRun, replacement_forward
from .settings import AttributionSettings
from .targets import Target

if TYPE_CHECKING:  # annotations only
    from .graph import AttributionGraph

#: How far a recomputed row may be from the graph's stored one, relative to the row's largest
#: entry, before the graph is refused as not this model's and transcoder's.
ROW_MATCH_TOLERANCE = 1e-4


# ------------------------------------------------------------------ the graph's run, again

def graph_target(graph: AttributionGraph, logit: int) -> Target:
    """Logit node ``logit`` of ``graph`` as a :class:`~.targets.Target`."""
    entry = graph.targets[logit]
    size = int(entry.get("size") or 0)
    if not size:
        raise InputError(f"the graph's logit node {logit} has no coefficient size (a graph "
                         "written before targets recorded one): rebuild it")
    coefficients = torch.zeros(size)
    for index, value in entry["coefficients"].items():
        coefficients[int(index)] = float(value)
    return Target(entry["name"], int(entry["token"]), coefficients,
                  entry.get("output", "logits"), int(entry.get("position", -1)))


def _graph_run(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph, *,
               qk_norms: bool = False) -> ReplacementRun:
    """The local replacement forward ``graph`` was built from, refused unless its active
    features are the graph's."""
    if not graph.metadata.get("frozen", True):
        raise InputError("this graph was built with freeze=False (a control): heads and QK "
                         "terms decompose the frozen local replacement model only")
    if graph.steering:
        raise InputError("this graph has steering nodes (a pyvene IntervenableModel's edits): "
                         "head loadings and QK attribution do not replay them yet; attribute "
                         "the bare model")
    if transcoder.n_layers != graph.n_layers:
        raise InputError(f"the graph has {graph.n_layers} layers, the transcoder "
                         f"{transcoder.n_layers}")
    built_on = (graph.metadata.get("fingerprints") or {}).get("model")
    if built_on is not None and built_on != bound.fingerprint:
        raise InputError(f"the graph was built on another model (weights fingerprint {built_on}, "
                         f"this model's {bound.fingerprint}): pass the model the graph was "
                         "built with")
    ids = torch.tensor([graph.input_ids], device=bound.device)
    bound.check_inputs(ids)
    states = [t["output"] for t in graph.targets if t.get("output", "logits") != "logits"]
    run = replacement_forward(bound, transcoder, ids, from_position=graph.from_position,
                              states=states, qk_norms=qk_norms)
    if str(graph.metadata.get("bos_errors", "kept")).startswith("dropped"):
        run.bos_errors = "drop"
    same = run.n_features == graph.n_features and all(
        torch.equal(getattr(run, name).cpu(), getattr(graph, name).cpu())
        for name in ("feature_layer", "feature_position", "feature_id"))
    if not same:
        raise InputError(f"the graph's {graph.n_features} active features are not this "
                         f"model's and transcoder's on its prompt ({run.n_features} active): "
                         "pass the model and transcoder the graph was built with")
    return run


def _row_output(run: ReplacementRun, graph: AttributionGraph,
                node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The live output node ``node``'s value reads and its gradient seed (a logit node's
    coefficients, a feature's encoder row at its position)."""
    kind = graph.node_kind(node)
    if kind == "logit":
        target = graph_target(graph, node - graph.layout.logits.start)
        output = run.output(target.output)
        return output, target.seed(output)
    if kind == "feature":
        layer, position = int(graph.feature_layer[node]), int(graph.feature_position[node])
        state = run.encoder_inputs[layer]
        seed = torch.zeros_like(state)
        seed[0, position] = run.encoder_rows[node].to(state.dtype)
        return state, seed
    raise InputError(f"node {node} ({graph.label(node)}) is a {kind}: a target is a logit node "
                     "or a feature node")


def _check_row(graph: AttributionGraph, node: int, row: torch.Tensor) -> None:
    """Refuse a recomputed row that is not the graph's (another model or transcoder)."""
    index = int(graph.rows.row_of_node(graph.layout.n_nodes)[node])
    if index < 0:
        return  # an unexplored feature: its row was never stored
    stored = graph.rows.dense([index])[0].double()
    row = row.detach().double().cpu()
    scale = float(stored.abs().max()) or 1.0
    worst = float((row - stored).abs().max()) / scale
    if worst > ROW_MATCH_TOLERANCE:
        raise InputError(f"{graph.label(node)}'s row recomputed here differs from the graph's by "
                         f"{worst:.2e} of its largest edge (tolerance {ROW_MATCH_TOLERANCE:g}): "
                         "pass the model and transcoder the graph was built with")


def _layers(layers: int | Sequence[int] | None, n_layers: int) -> list[int]:
    """``layers`` (None: all) as a checked list."""
    chosen = list(range(n_layers)) if layers is None else (
        [layers] if isinstance(layers, int) else list(layers))
    if not chosen:
        raise InputError("layers=[]: give at least one layer (None: every layer)")
    chosen = [check_index("layers", layer, n_layers, "attention layers of the model")
              for layer in chosen]
    return list(dict.fromkeys(chosen))


@dataclass
class _Replay:
    """The graph's run replayed once, with what the decompositions read from it: the live
    input of each chosen layer's output projection (``heads``) and, with ``qk``, every layer's
    live queries, keys and attention keyword arguments (``qk``)."""

    bound: BoundModel
    graph: AttributionGraph
    run: ReplacementRun
    heads: dict[int, torch.Tensor]
    qk: dict[int, tuple[torch.Tensor, torch.Tensor, dict]]
    #: gradient rows per backward within the memory cap (:func:`~.budget.batch_size_for`)
    batch: int


def _replay(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
            layers: Sequence[int], *, qk: bool = False,
            memory_mb: float | None = None) -> _Replay:
    """One forward of ``graph``'s local replacement model (:func:`_graph_run`) keeping the head
    outputs of ``layers`` and, with ``qk``, every layer's queries and keys (q/k norms
    frozen); later backwards take as many rows at once as fit ``memory_mb`` (default
    :attr:`~.settings.AttributionSettings.memory_mb`)."""
    check_fits(transcoder, bound)
    bound.check_weights()
    attentions = {id(bound.module("attn", layer)): layer for layer in range(bound.n_layers)}
    seen: dict[int, tuple] = {}

    def watch(module, query, key, kwargs):
        layer = attentions.get(id(module))
        if layer is not None and query.requires_grad:
            seen[layer] = (query, key, kwargs)

    with _head_outputs(bound, layers) as outputs, \
            (watching_qk(watch) if qk else nullcontext()):
        run = _graph_run(bound, transcoder, graph, qk_norms=qk)
    if qk and len(seen) != bound.n_layers:
        raise InputError(f"the attention of layers {sorted(set(range(bound.n_layers)) - set(seen))}"
                         " did not run through the frozen attention function")
    memory_mb = AttributionSettings().memory_mb if memory_mb is None else memory_mb
    return _Replay(bound, graph, run, dict(outputs), seen, batch_size_for(run, memory_mb))


def _rows(replay: _Replay, output: torch.Tensor,
          seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``[B, n_sources]`` and constants ``[B]`` of ``<seeds[b], output>``, ``replay.batch``
    rows per backward."""
    parts = [edges_from_grads(replay.run, leaf_grads(replay.run, output, chunk),
                              batch=len(chunk))
             for chunk in seeds.split(replay.batch)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@contextmanager
def _head_outputs(bound: BoundModel, layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block, the live input ``[1, P, heads * head_dim]`` of each of ``layers``'
    output projections, as the frozen attention recomputes it (the call that carries a
    gradient)."""
    found: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def read(value: torch.Tensor, call: Call) -> None:
            if call.args and value.requires_grad:
                found[layer] = value
        return read

    with applying(bound.model, [Edit(bound.at("attn_out", layer, "input"), keep(layer),
                                     last=True) for layer in layers]):
        yield found
    missing = [layer for layer in layers if layer not in found]
    if missing:
        raise InputError(f"no live attention output reached layers {missing}' output "
                         "projections (is the attention frozen?)")


# ------------------------------------------------------------------------- head loadings

@dataclass
class HeadLoadings:
    """Every source node's edge into one target, split by the heads of each attention layer.

    ``parts[i, h, s]``: the part of source ``s``'s edge that crosses head ``h`` of
    ``layers[i]``; ``bypass[i, s]``: the part that skips that layer's attention;
    ``parts[i].sum(0) + bypass[i] == edges`` for every ``i``. ``constant_parts`` and
    ``constant_bypass`` split the row's constant (biases, ``b_dec``) the same way. Columns are
    the graph's source nodes (features, errors, steering, tokens)."""

    target: int
    target_label: str
    layers: list[int]
    edges: torch.Tensor           # [n_sources]
    parts: torch.Tensor           # [len(layers), n_heads, n_sources]
    bypass: torch.Tensor          # [len(layers), n_sources]
    constant: float
    constant_parts: torch.Tensor  # [len(layers), n_heads]
    constant_bypass: torch.Tensor  # [len(layers)]
    labels: list[str] = field(repr=False)

    @property
    def n_heads(self) -> int:
        return int(self.parts.shape[1])

    def _layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise InputError(f"layer {layer} was not split (split: {self.layers})")
        return self.layers.index(layer)

    @checked
    def of(self, source: int, layer: int | None = None) -> pd.DataFrame:
        """Source ``source``'s edge by (layer, head), with a ``bypass`` row per layer:
        ``part`` and ``share`` (of the edge)."""
        if not 0 <= source < len(self.edges):
            raise InputError(f"source {source} is not a source node (0..{len(self.edges) - 1})")
        edge = float(self.edges[source])
        layers = self.layers if layer is None else [layer]
        rows = []
        for chosen in layers:
            i = self._layer_index(chosen)
            rows += [{"layer": chosen, "head": str(h), "part": float(self.parts[i, h, source])}
                     for h in range(self.n_heads)]
            rows.append({"layer": chosen, "head": "bypass",
                         "part": float(self.bypass[i, source])})
        frame = pd.DataFrame(rows)
        frame["share"] = frame["part"] / edge if edge else float("nan")
        frame.insert(0, "source", self.labels[source])
        return frame

    @checked
    def top_heads(self, source: int, n: int = 5) -> pd.DataFrame:
        """The ``n`` (layer, head) pairs carrying the most of ``source``'s edge (by |part|)."""
        frame = self.of(source)
        frame = frame[frame["head"] != "bypass"]
        return frame.reindex(frame["part"].abs().sort_values(ascending=False).index).head(n)

    @checked
    def to_dataframe(self, min_abs: float = 0.0) -> pd.DataFrame:
        """One row per (source, layer, head) with ``|part| > min_abs``: the long table."""
        index = (self.parts.abs() > min_abs).nonzero()
        return pd.DataFrame({
            "source": [self.labels[int(s)] for s in index[:, 2]],
            "source_node": index[:, 2].tolist(),
            "layer": [self.layers[int(i)] for i in index[:, 0]],
            "head": index[:, 1].tolist(),
            "part": self.parts[index[:, 0], index[:, 1], index[:, 2]].tolist(),
            "edge": self.edges[index[:, 2]].tolist()})

    @checked
    def to_dict(self, sources: Sequence[int] | None = None) -> dict[str, Any]:
        """JSON-ready: the target, the layers, and per source (default: every source with a
        nonzero edge) its edge, parts ``[layer][head]`` and bypass per layer."""
        chosen = (self.edges.ne(0).nonzero().squeeze(-1).tolist() if sources is None
                  else list(sources))
        return {"target": self.target, "target_label": self.target_label,
                "layers": self.layers, "n_heads": self.n_heads, "constant": self.constant,
                "sources": [{"node": s, "label": self.labels[s], "edge": float(self.edges[s]),
                             "parts": self.parts[:, :, s].tolist(),
                             "bypass": self.bypass[:, s].tolist()} for s in chosen]}

    @checked
    def to_json(self, path: str | Path | None = None,
                sources: Sequence[int] | None = None) -> dict[str, Any]:
        """:meth:`to_dict`, written to ``path`` when given."""
        data = self.to_dict(sources)
        if path is not None:
            write_json(data, path)
        return data

    @checked
    def plot(self, source: int, path: str | Path | None = None):
        """Heat map of ``source``'s edge by layer (rows) and head (columns), the bypass in the
        last column; returns the figure."""
        import matplotlib.pyplot as plt  # heavy: only when a picture is asked for

        values = torch.cat([self.parts[:, :, source], self.bypass[:, source, None]], 1)
        limit = float(values.abs().max()) or 1.0
        fig, ax = plt.subplots(figsize=(1.2 + 0.5 * values.shape[1],
                                        1.2 + 0.35 * values.shape[0]))
        image = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit,
                          aspect="auto")
        ax.set_xticks(range(values.shape[1]),
                      [str(h) for h in range(self.n_heads)] + ["bypass"])
        ax.set_yticks(range(len(self.layers)), [str(layer) for layer in self.layers])
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{self.labels[source]} → {self.target_label}\n"
                     f"edge {float(self.edges[source]):+.4g}", fontsize=9)
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def _split_layer(replay: _Replay, z: torch.Tensor, g: torch.Tensor, n_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[n_heads, n_sources]`` and constants ``[n_heads]`` of ``<g[h], z[h]>`` per head
    (module docstring): one batched backward (more if the memory cap says so)."""
    width = z.shape[-1] // n_heads
    seeds = torch.zeros(n_heads, *z.shape, dtype=z.dtype, device=z.device)
    for h in range(n_heads):
        seeds[h, ..., h * width:(h + 1) * width] = g[..., h * width:(h + 1) * width]
    return _rows(replay, z, seeds)


def _loadings(replay: _Replay, node: int, layers: Sequence[int]
              ) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """Node ``node``'s row ``[n_sources]``, its constant, and the parts ``[len(layers),
    n_heads, n_sources]`` and constant parts ``[len(layers), n_heads]`` of each head (module
    docstring); the row checked against the graph's."""
    run, graph = replay.run, replay.graph
    if not 0 <= node < graph.layout.n_nodes:
        raise InputError(f"target {node} is not a node of the graph "
                         f"(0..{graph.layout.n_nodes - 1})")
    output, seed = _row_output(run, graph, node)
    rows, constants = edges_from_grads(run, leaf_grads(run, output, seed[None]), batch=1)
    edges, constant = rows[0].detach().cpu(), float(constants[0])
    _check_row(graph, node, edges)
    zs = [replay.heads[layer] for layer in layers]
    grads = torch.autograd.grad(output, zs, seed, retain_graph=True, allow_unused=True)
    n_heads = replay.bound.n_heads
    parts = torch.zeros(len(layers), n_heads, len(edges), dtype=edges.dtype)
    constant_parts = torch.zeros(len(layers), n_heads, dtype=torch.float64)
    for i, (z, g) in enumerate(zip(zs, grads, strict=True)):
        if g is None or not bool(g.ne(0).any()):
            continue  # the target reads nothing after this layer's attention
        head_rows, head_constants = _split_layer(replay, z, g, n_heads)
        parts[i] = head_rows.detach().cpu().to(parts.dtype)
        constant_parts[i] = head_constants.detach().double().cpu()
    return edges, constant, parts, constant_parts


@measured
def head_loadings(model: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
                  target: int | None = None, *, layers: int | Sequence[int] | None = None,
                  memory_mb: MemoryMB | None = None) -> HeadLoadings:
    """Split every edge into node ``target`` of ``graph`` (a logit node or a feature node;
    default the first logit node) by the heads of ``layers`` (default every layer), plus a
    bypass per layer (module docstring). ``model`` and ``transcoder`` are the graph's: its
    run is replayed, and refused if its features or the target's row differ from the graph's.
    One forward, one backward, then one batched backward (one row per head) per layer; as
    many rows per backward as fit ``memory_mb`` (default the attribution settings')."""
    chosen = _layers(layers, model.n_layers)
    node = graph.logit_node if target is None else check_index(
        "target", target, graph.layout.n_nodes, "nodes of the graph")
    replay = _replay(model, transcoder, graph, chosen, memory_mb=memory_mb)
    edges, constant, parts, constant_parts = _loadings(replay, node, chosen)
    return HeadLoadings(
        target=node, target_label=graph.label(node), layers=chosen, edges=edges, parts=parts,
        bypass=edges[None] - parts.sum(1), constant=constant, constant_parts=constant_parts,
        constant_bypass=constant - constant_parts.sum(1),
        labels=[graph.label(i) for i in range(len(edges))])


# ------------------------------------------------------------------------ QK attribution

@dataclass
class QKAttribution:
    """Head ``head`` of ``layer``'s pre-softmax score at (``query_pos``, ``key_pos``) as a sum
    of bilinear terms between the nodes on the query side and on the key side (module
    docstring).

    ``query_parts [n_q, head_dim]`` / ``key_parts [n_k, head_dim]``: each contributing node's
    part of the query / key vector (the last row: the constants), ``query_nodes`` /
    ``key_nodes`` their node indices (-1: the constants). ``terms`` lists the largest
    ``scaling * <query part i, key part j>``; ``query_marginals`` / ``key_marginals`` each node's
    terms summed over the other side. Everything sums to ``score`` (``residual``: the float
    rounding)."""

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
        data = self.to_dict(n)
        if path is not None:
            write_json(data, path)
        return data

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
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def _side_parts(replay: _Replay, vector_of: torch.Tensor, index: tuple, what: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's part ``[n_sources + 1, d]`` of the vector ``vector_of[index]`` (the last row:
    the constants) from one batched backward; refused unless the parts sum to the vector."""
    vector = vector_of[index]
    d = vector.shape[-1]
    seeds = torch.zeros(d, *vector_of.shape, dtype=vector_of.dtype, device=vector_of.device)
    for c in range(d):
        seeds[(c, *index, c)] = 1.0
    rows, constants = _rows(replay, vector_of, seeds)
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
    n_pos, positions = graph.n_pos, []
    for name, pos in (("query_pos", query_pos), ("key_pos", key_pos)):
        positions.append(check_index(name, pos, n_pos, "positions of the prompt",
                                     negative=True))
    if positions[1] > positions[0]:
        raise InputError(f"key_pos {positions[1]} is after query_pos {positions[0]}: a causal "
                         "head never attends there")
    return positions[0], positions[1]


def _qk(replay: _Replay, layer: int, head: int, query_pos: int, key_pos: int) -> QKAttribution:
    """:func:`qk_attribution` on a replay that kept the queries and keys."""
    bound, graph = replay.bound, replay.graph
    check_qk_supported(bound)
    if not 0 <= head < bound.n_heads:
        raise InputError(f"head {head} is not a head of the model (0..{bound.n_heads - 1})")
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
    (layer,) = _layers(layer, model.n_layers)
    head = check_index("head", head, model.n_heads, "heads of the model")
    _positions(graph, query_pos, key_pos)  # refused before the forward
    return _qk(_replay(model, transcoder, graph, [layer], qk=True, memory_mb=memory_mb), layer,
               head, query_pos, key_pos)


def check_qk_supported(bound: BoundModel) -> None:
    """Refuse QK attribution where its score is not known to be the model's: Gemma-2 under
    transformers 4 (with a soft cap of 0.3 the eager pattern there is not the softmax of the
    capped scores; under transformers 5 it is, tests/test_heads.py)."""
    import transformers  # loaded already: the model is a transformers model

    if bound.adapter.model_type == "gemma2" and int(transformers.__version__.split(".")[0]) < 5:
        raise UnsupportedModelError(
            "QK attribution of Gemma-2 is checked against the model's attention pattern under "
            f"transformers 5 only (this is {transformers.__version__}, where the check fails): "
            "upgrade transformers; head loadings are not affected")


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
