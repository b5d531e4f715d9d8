"""What a graph is, so nothing made for one graph is written onto another:
:func:`graph_identity` hashes its tokens, targets, nodes, rows and recorded fingerprints (kept
by save and load, changed by another prompt, model, transcoder or setting; annotations carry
it), :func:`check_labels` refuses labels the transcoder lacks, :func:`text_digest` is a text's
SHA-256."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from ..errors import InputError
from .checkpoint import tensor_digest

#: Missing keys a refusal names before "and N more".
SHOWN = 5


def text_digest(text: str) -> str:
    """SHA-256 of ``text`` (UTF-8), hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def graph_identity(graph) -> str:
    """A short hash identifying ``graph`` (module docstring)."""
    rows = graph.rows
    described = {"input_ids": list(graph.input_ids), "n_layers": graph.n_layers,
                 "targets": graph.targets or [graph.target], "n_columns": rows.n_columns,
                 "steering": graph.steering,
                 "fingerprints": graph.metadata.get("fingerprints"),
                 "bos_errors": graph.metadata.get("bos_errors")}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    digest.update(tensor_digest(graph.feature_layer, graph.feature_position, graph.feature_id,
                                rows.nodes, rows.constants, rows.targets).encode())
    return digest.hexdigest()[:20]


def check_labels(graph, labels: Mapping) -> None:
    """Refuse (:class:`InputError`, naming the first few) label keys that are not ``(layer,
    feature)`` of the graph's transcoder. Features the prompt does not activate are kept: a
    labels table covers the transcoder, a graph only its active features."""
    width = (graph.metadata.get("transcoder") or {}).get("d_transcoder")
    missing = [key for key in labels if not (
        isinstance(key, tuple) and len(key) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in key)
        and key[0] < graph.n_layers and (width is None or key[1] < width))]
    if missing:
        shown = ", ".join(map(repr, missing[:SHOWN]))
        more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
        size = f"layers 0..{graph.n_layers - 1}" + (
            "" if width is None else f", features 0..{width - 1}")
        raise InputError(f"labels for features this graph's transcoder does not have "
                         f"({size}): {shown}{more}; labels of another transcoder?")
