"""Attention inside the graph: which heads carry an edge, an exact decomposition of the local
replacement model (Anthropic's "Tracing Attention Computation Through Feature Interactions",
2025; circuit-tracer PR #114's head loadings).

Every path from a source to the target crosses layer ``l``'s attention through one head or
skips it. With ``z[l, h]`` head ``h``'s slice of the output projection's input and ``g[l] = d
target / d z[l]``, source ``i``'s part through head ``h`` is ``x_i * d <g[l, h], z[l, h]> / d
x_i``, a row like any target's (one batched backward per layer); the bypass is the edge minus
its heads' parts.

    loadings = head_loadings(model, transcoder, graph)        # the first logit node's edges
    loadings.of(source)                                       # DataFrame: layer, head, part

The run is replayed by :mod:`.graph_replay`; a head's score is decomposed by :mod:`.qk`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..arguments import MemoryMB, check_index, checked
from ..bound import BoundModel
from ..errors import InputError
from ..model_guard import measured
from ..transcoders.transcoder import Transcoder
from .edges import edges_from_grads
from .export import write_json
from .graph_replay import Replay, check_row, chosen_layers, replay_graph, replay_rows, row_output
from .leaf_grads import leaf_grads
from .plots import finish

if TYPE_CHECKING:  # annotations only
    from .graph import AttributionGraph

__all__ = ["HeadLoadings", "head_loadings", "node_loadings"]


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

    @checked
    def of(self, source: int, layer: int | None = None) -> pd.DataFrame:
        """Source ``source``'s edge by (layer, head), with a ``bypass`` row per layer:
        ``part`` and ``share`` (of the edge)."""
        check_index("source", source, len(self.edges), "source nodes")
        edge = float(self.edges[source])
        layers = self.layers if layer is None else [layer]
        rows = []
        for chosen in layers:
            if chosen not in self.layers:
                raise InputError(f"layer {chosen} was not split (split: {self.layers})")
            i = self.layers.index(chosen)
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
        return write_json(self.to_dict(sources), path)

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
        return finish(fig, path, dpi=120)


def _split_layer(replay: Replay, z: torch.Tensor, g: torch.Tensor, n_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[n_heads, n_sources]`` and constants ``[n_heads]`` of ``<g[h], z[h]>`` per head
    (module docstring): one batched backward (more if the memory cap says so)."""
    width = z.shape[-1] // n_heads
    seeds = torch.zeros(n_heads, *z.shape, dtype=z.dtype, device=z.device)
    for h in range(n_heads):
        seeds[h, ..., h * width:(h + 1) * width] = g[..., h * width:(h + 1) * width]
    return replay_rows(replay, z, seeds)


def node_loadings(replay: Replay, node: int, layers: Sequence[int]
              ) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """Node ``node``'s row ``[n_sources]``, its constant, and the parts ``[len(layers),
    n_heads, n_sources]`` and constant parts ``[len(layers), n_heads]`` of each head (module
    docstring); the row checked against the graph's."""
    run, graph = replay.run, replay.graph
    node = check_index("target", node, graph.layout.n_nodes, "nodes of the graph")
    output, seed = row_output(run, graph, node)
    rows, constants = edges_from_grads(run, leaf_grads(run, output, seed[None]), batch=1)
    edges, constant = rows[0].detach().cpu(), float(constants[0])
    check_row(graph, node, edges)
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
    """Split every edge into node ``target`` of ``graph`` (default the first logit node) by
    the heads of ``layers`` (default all), plus a bypass per layer. ``model`` and ``transcoder``
    are the graph's: its run is replayed, and refused if its features or the target's row
    differ. Backwards take as many rows as fit ``memory_mb`` (default the attribution settings')."""
    chosen = chosen_layers(layers, model.n_layers)
    node = graph.logit_node if target is None else check_index(
        "target", target, graph.layout.n_nodes, "nodes of the graph")
    replay = replay_graph(model, transcoder, graph, chosen, memory_mb=memory_mb)
    edges, constant, parts, constant_parts = node_loadings(replay, node, chosen)
    return HeadLoadings(
        target=node, target_label=graph.label(node), layers=chosen, edges=edges, parts=parts,
        bypass=edges[None] - parts.sum(1), constant=constant, constant_parts=constant_parts,
        constant_bypass=constant - constant_parts.sum(1),
        labels=[graph.label(i) for i in range(len(edges))])
