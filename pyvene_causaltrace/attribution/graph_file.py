"""The attribution graph's file: one safetensors file, tensors and a JSON header, never a pickle.

    save_graph(graph, "graph.safetensors")                   # graph.save(...)
    graph = load_graph("graph.safetensors", AttributionGraph)  # AttributionGraph.load(...)

The header holds ``format`` (:data:`GRAPH_FORMAT`), ``schema_version`` and ``graph`` (prompt,
tokens, targets, closure, metadata, steering sites); the tensors are :data:`FEATURE_TENSORS`,
``input_ids`` and :meth:`~.store.RowStore.state`. Written whole or not at all; anything else
(a pickle, an older ``.pt``, a damaged header) is refused with :class:`~..errors.GraphFileError`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import safetensors.torch  # called through the module: tests patch save_file there
import torch
from safetensors import safe_open

from ..atomic import replacing
from ..errors import GraphFileError, InputError
from .edges import CLOSURE_TOLERANCE, Closure
from .store import RowStore

#: The graph class (:class:`~.graph.AttributionGraph`, which imports this module).
G = TypeVar("G")

__all__ = ["FEATURE_TENSORS", "GRAPH_FORMAT", "SCHEMA_VERSION", "load_graph", "save_graph"]

#: The graph file format (safetensors + JSON header); bump on incompatible changes.
GRAPH_FORMAT = "pyvene_causaltrace.attribution_graph"
#: 3 adds steering nodes, 4 several logit nodes or a direction target; a graph without them is
#: written as the oldest version that holds it, which older versions read.
SCHEMA_VERSION = 4
_READABLE_VERSIONS = ("2", "3", "4")
#: The feature table's tensors, one entry per active feature.
FEATURE_TENSORS = ("feature_layer", "feature_position", "feature_id", "activation")


def save_graph(graph: Any, path: str | Path) -> None:
    """Write ``graph`` to one safetensors file: tensors, and everything else as JSON in its
    header (no pickle: loading never runs code). Written under a temporary name and renamed
    over ``path`` when complete: never half a file under ``path``."""
    header = {"prompt": graph.prompt, "tokens": graph.tokens, "target": graph.target,
              "answer": graph.answer, "answer_prob": graph.answer_prob,
              "n_layers": graph.n_layers, "n_columns": graph.rows.n_columns,
              "closure": graph.closure.to_dict(), "metadata": graph.metadata,
              "steering": graph.steering, "targets": graph.targets}
    tensors = {name: getattr(graph, name).contiguous() for name in FEATURE_TENSORS}
    tensors["input_ids"] = torch.tensor(graph.input_ids, dtype=torch.long)
    tensors.update(graph.rows.state())
    plain = graph.n_logits == 1 and graph.targets[0].get("output", "logits") == "logits"
    version = "3" if graph.steering else "2"
    metadata = {"format": GRAPH_FORMAT, "schema_version": version if plain else "4",
                "graph": json.dumps(header, default=str)}
    with replacing(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata=metadata)


def load_graph(path: str | Path, cls: type[G]) -> G:
    """Read a file written by :func:`save_graph` as ``cls`` (:class:`~.graph.AttributionGraph`).
    Anything else — a pickle, a ``.pt`` of an older version, another safetensors file — is
    refused with :class:`GraphFileError`."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except FileNotFoundError:
        raise
    except Exception as error:  # safetensors raises its own error types on a bad header
        raise GraphFileError(
            f"{path} is not an attribution graph file (a safetensors file is expected; "
            f"pickled graphs are never loaded): {error}") from None
    if meta.get("format") != GRAPH_FORMAT:
        raise GraphFileError(f"{path} is a safetensors file but not an attribution graph")
    if meta.get("schema_version") not in _READABLE_VERSIONS:
        raise GraphFileError(f"{path} has graph schema version {meta.get('schema_version')}; "
                             f"this version reads {', '.join(_READABLE_VERSIONS)}")
    try:
        graph = _from_file(cls, meta, tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        detail = error if isinstance(error, InputError) else f"{type(error).__name__}: {error}"
        raise GraphFileError(f"{path} is a damaged attribution graph file: {detail}") from None
    if graph.layout.logits.start != graph.rows.n_columns:
        raise GraphFileError(f"{path}: {graph.rows.n_columns} columns for "
                             f"{graph.layout.logits.start} source nodes")
    lay = graph.layout
    if bool((graph.rows.row_of_node(lay.n_nodes)[lay.logits] < 0).any()):
        raise GraphFileError(f"{path} is a damaged attribution graph file: a logit node has no "
                             "row")
    c = graph.closure
    if not c.scale:  # written before the scale was kept: the logit row's
        logit_row = int(graph.rows.row_of_node(lay.n_nodes)[graph.logit_node])
        scale = float(graph.rows.abs_sums()[logit_row]) + abs(c.constant) + abs(c.target)
        graph.closure = Closure(c.target, c.edges, c.constant, scale, c.tolerance)
    return graph


def _from_file(cls: type[G], meta: dict, tensors: dict[str, torch.Tensor]) -> G:
    """The graph in a file's header and tensors (raising KeyError, TypeError or ValueError on
    anything missing or malformed)."""
    header = json.loads(meta["graph"])
    target = header["target"]
    targets = header.get("targets", [])
    for entry in (target, *targets):
        entry["coefficients"] = {int(k): v for k, v in entry.get("coefficients", {}).items()}
    c = header["closure"]
    n_features = {len(tensors[name]) for name in FEATURE_TENSORS}
    if len(n_features) != 1 or any(tensors[name].dim() != 1 for name in FEATURE_TENSORS):
        raise InputError("feature tensors of different lengths")
    if len(header["tokens"]) != len(tensors["input_ids"]):
        raise InputError("tokens and input_ids of different lengths")
    return cls(prompt=header["prompt"], tokens=header["tokens"],
               input_ids=tensors["input_ids"].tolist(), target=target,
               answer=header["answer"], answer_prob=header["answer_prob"],
               n_layers=header["n_layers"], **{name: tensors[name] for name in FEATURE_TENSORS},
               rows=RowStore.from_state(header["n_columns"], tensors,
                                        n_logits=max(1, len(targets))),
               closure=Closure(c["target"], c["edges"], c["constant"], c.get("scale", 0.0),
                               c.get("tolerance", CLOSURE_TOLERANCE)),
               metadata=header["metadata"], steering=header.get("steering", []),
               targets=targets)
