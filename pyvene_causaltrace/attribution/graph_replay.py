"""A graph's local replacement run, replayed for head loadings (:mod:`.heads`) and QK
attribution (:mod:`.qk`): the forward the graph was built from (patterns and norm scales
frozen), refused unless its active features and a recomputed row are the graph's, keeping each
chosen layer's attention-output-projection input and, for QK, every layer's queries and keys.

    replayed = replay_graph(bound, transcoder, graph, layers=[0, 1], qk=True)
    rows, constants = replay_rows(replayed, output, seeds)   # rows of <seeds[b], output>"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..applier import Call, Edit, applying
from ..arguments import check_index
from ..bound import BoundModel
from ..errors import InputError
from ..interventions.frozen import watching_qk
from ..transcoders.lorsa import LorsaSet
from ..transcoders.transcoder import Transcoder, check_fits
from .budget import batch_size_for
from .edges import edges_from_grads
from .leaf_grads import leaf_grads
from .replacement import ReplacementRun, replacement_forward
from .settings import AttributionSettings
from .targets import Target

if TYPE_CHECKING:  # annotations only
    from .graph import AttributionGraph

__all__ = ["ROW_MATCH_TOLERANCE", "Replay", "check_row", "chosen_layers", "graph_run",
           "graph_target", "head_outputs", "replay_graph", "replay_rows", "row_output"]

#: How far a recomputed row may be from the graph's stored one, relative to the row's largest
#: entry, before the graph is refused as not this model's and transcoder's.
ROW_MATCH_TOLERANCE = 1e-4


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


def graph_run(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph, *,
              qk_norms: bool = False, lorsa: LorsaSet | None = None) -> ReplacementRun:
    """The local replacement forward ``graph`` was built from (with ``lorsa``, the Lorsa set
    of a graph with Lorsa nodes), refused unless its active features are the graph's."""
    if bool(graph.lorsa_layers) != (lorsa is not None):
        raise InputError("the graph has Lorsa nodes: pass the Lorsa set it was built with"
                         if graph.lorsa_layers else "the graph has no Lorsa nodes: pass no "
                         "Lorsa set")
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
                              states=states, qk_norms=qk_norms, lorsa=lorsa)
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


def row_output(run: ReplacementRun, graph: AttributionGraph,
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


def check_row(graph: AttributionGraph, node: int, row: torch.Tensor) -> None:
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


def chosen_layers(layers: int | Sequence[int] | None, n_layers: int) -> list[int]:
    """``layers`` (None: all) as a checked list."""
    chosen = list(range(n_layers)) if layers is None else (
        [layers] if isinstance(layers, int) else list(layers))
    if not chosen:
        raise InputError("layers=[]: give at least one layer (None: every layer)")
    chosen = [check_index("layers", layer, n_layers, "attention layers of the model")
              for layer in chosen]
    return list(dict.fromkeys(chosen))


@dataclass
class Replay:
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


def replay_graph(bound: BoundModel, transcoder: Transcoder, graph: AttributionGraph,
            layers: Sequence[int], *, qk: bool = False,
            memory_mb: float | None = None) -> Replay:
    """One forward of ``graph``'s local replacement model (:func:`graph_run`) keeping the head
    outputs of ``layers`` and, with ``qk``, every layer's queries and keys (q/k norms frozen);
    later backwards take as many rows as fit ``memory_mb`` (default the attribution settings')."""
    check_fits(bound, transcoder)
    bound.check_weights()
    attentions = {id(bound.module("attn", layer)): layer for layer in range(bound.n_layers)}
    seen: dict[int, tuple] = {}

    def watch(module, query, key, kwargs):
        layer = attentions.get(id(module))
        if layer is not None and query.requires_grad:
            seen[layer] = (query, key, kwargs)

    with head_outputs(bound, layers) as outputs, \
            (watching_qk(watch) if qk else nullcontext()):
        run = graph_run(bound, transcoder, graph, qk_norms=qk)
    if qk and len(seen) != bound.n_layers:
        raise InputError(f"the attention of layers {sorted(set(range(bound.n_layers)) - set(seen))}"
                         " did not run through the frozen attention function")
    memory_mb = AttributionSettings().memory_mb if memory_mb is None else memory_mb
    return Replay(bound, graph, run, dict(outputs), seen, batch_size_for(run, memory_mb))


def replay_rows(replay: Replay, output: torch.Tensor,
          seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``[B, n_sources]`` and constants ``[B]`` of ``<seeds[b], output>``, ``replay.batch``
    rows per backward."""
    parts = [edges_from_grads(replay.run, leaf_grads(replay.run, output, chunk),
                              batch=len(chunk))
             for chunk in seeds.split(replay.batch)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@contextmanager
def head_outputs(bound: BoundModel, layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
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
