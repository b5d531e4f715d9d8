"""The circuit-tracer / Neuronpedia graph JSON, so a graph opens in their viewer.

Node ids are circuit-tracer's current ones (:func:`node_id`: errors ``"{layer}_-1_{pos}"``,
never a feature's) plus steering nodes ``"S{j}_{pos}"`` (``feature_type`` ``"steering"``, listed
in ``metadata.info.steering``). Only the pruned graph is exported, at most ``max_links`` links,
numbers to 6 significant digits, so a graph of thousands of features stays a few tens of MB.
:func:`check_graph_json` checks a payload against Neuronpedia's schema."""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import __version__
from ..atomic import write_text
from ..errors import InputError
from ..graph_schema import validate
from .identity import check_labels, graph_identity, text_digest
from .lorsa_nodes import lorsa_info, qk_tracing_json
from .settings import ReadingSettings

log = logging.getLogger("pyvene_causaltrace.attribution")

#: The node kinds (``feature_type``) the export writes: circuit-tracer's four, ``steering``,
#: and Neuronpedia's attention kinds ``lorsa`` and ``lorsa error`` (:mod:`.lorsa_nodes`).
KINDS = ("cross layer transcoder", "mlp reconstruction error", "embedding", "logit", "steering",
         "lorsa", "lorsa error")


def check_graph_json(payload: dict) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``payload`` matches Neuronpedia's graph
    schema, or :class:`InputError` for a node kind the export does not write, two nodes of one
    kind sharing an id, or a link to a missing node. Nodes are told apart by ``feature_type``, so
    circuit-tracer 0.5.0's error ids ``"0_{layer}_{pos}"`` (which can equal a layer-0 feature's)
    are accepted; the viewer leaves links naming a shared id undrawn."""
    validate(payload)
    kinds: dict[str, set[str]] = {}
    for node in payload["nodes"]:
        kind = node["feature_type"]
        if kind not in KINDS:
            raise InputError(f"node {node['node_id']} is of kind {kind!r}, not "
                             f"one of {', '.join(KINDS)}")
        shared = kinds.setdefault(node["node_id"], set())
        if kind in shared:
            raise InputError(f"two {kind} nodes share the id {node['node_id']}")
        shared.add(kind)
    for link in payload["links"]:
        if link["source"] not in kinds or link["target"] not in kinds:
            raise InputError(f"link {link['source']} -> {link['target']} names a missing node")


def feature_index(layer: int, feature: int, d_transcoder: int) -> int:
    """The node's ``feature`` number as circuit-tracer writes it for Neuronpedia:
    ``feature + 10**ceil(log10(d_transcoder)) * layer`` (layer 3, feature 17 of 16,384 ->
    300017), so the viewer finds the feature's page in the graph's ``scan``."""
    return feature + 10 ** math.ceil(math.log10(max(d_transcoder, 2))) * layer


def _clean(token: str) -> str:
    return token.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _num(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.6g}")


def _node(node_id: str, feature: int, layer: str, pos: int, kind: str, js_id: str, *,
          clerp: str = "", influence: float | None = None, activation: float | None = None,
          token_prob: float = 0.0, is_target: bool = False) -> dict[str, Any]:
    return {"node_id": node_id, "feature": feature, "layer": layer, "ctx_idx": pos,
            "feature_type": kind, "token_prob": token_prob, "is_target_logit": is_target,
            "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": js_id, "clerp": clerp,
            "influence": _num(influence), "activation": _num(activation)}


def sublayer(graph, layer: int, kind: str) -> int:
    """The exported layer of a node at ``layer``: itself, or in a graph with Lorsa nodes the
    OpenMOSS server's sublayers (``2 l`` attention: Lorsa heads and errors; ``2 l + 1`` the
    MLP: transcoder features and errors; ``2 L`` the logits), so that ids of a Lorsa head and
    a transcoder feature never coincide and attention sits below the MLP in the viewer."""
    if not graph.lorsa_layers:
        return layer
    return 2 * layer if kind in ("lorsa", "lorsa error") else 2 * layer + 1


def node_id(graph, i: int) -> str:
    """Node ``i``'s exported id (with Lorsa nodes, the OpenMOSS server's: ``{sublayer}_{feature
    or head}_{pos}``, ``{sublayer}_error_{pos}``, logits ``{2 L}_{token}_{pos}``)."""
    kind = graph.node_kind(i)
    layer, pos, feature, _ = graph.coordinates(i, kind)
    if graph.lorsa_layers and kind != "token" and kind != "steering":
        if kind == "logit":
            return f"{2 * graph.n_layers}_{feature}_{pos}"
        middle = "error" if kind.endswith("error") else feature
        return f"{sublayer(graph, layer, kind)}_{middle}_{pos}"
    if kind == "feature":
        return f"{layer}_{feature}_{pos}"
    if kind == "error":
        return f"{layer}_-1_{pos}"
    if kind == "steering":
        return f"S{feature}_{pos}"
    if kind == "token":
        return f"E_{graph.input_ids[pos]}_{pos}"
    return f"{graph.n_layers + 1}_{feature}_{pos}"


def graph_json(graph, slug: str | None = None,
               node_threshold: float = ReadingSettings.node_threshold,
               edge_threshold: float = ReadingSettings.edge_threshold,
               max_links: int | None = ReadingSettings.max_links,
               labels: Mapping[tuple[int, int], str] | None = None,
               attention=None, *, settings: ReadingSettings | None = None) -> dict[str, Any]:
    """The viewer's JSON for ``graph`` pruned at the two thresholds (or ``settings``), at most
    ``max_links`` links of largest edge score (the metadata says when capped). ``labels``
    (``{(layer, feature): text}``, :func:`read_labels`) become the features' ``clerp``;
    ``metadata.scan`` is the transcoder's Neuronpedia scan, else the model's name; ``attention``
    (:func:`~.attention.attention_annotations`) adds heads and QK terms. Labels the transcoder
    lacks and another graph's annotations are refused (:mod:`.identity`)."""
    reading = ReadingSettings.merged(settings, node_threshold=node_threshold,
                                    edge_threshold=edge_threshold, max_links=max_links)
    max_links = reading.max_links
    if labels:
        check_labels(graph, labels)
    identity = graph_identity(graph)
    if attention is not None:
        attention.check(graph, identity)
    pruned = graph.prune(settings=reading)
    edge_target, edge_source, edge_weight = pruned.edge_target, pruned.edge_source, \
        pruned.edge_weight
    capped = max_links is not None and pruned.n_edges > max_links
    if capped:
        top = pruned.edge_score.topk(max_links).indices.sort().values
        edge_target, edge_source, edge_weight = edge_target[top], edge_source[top], \
            edge_weight[top]
        log.warning("export: %d pruned edges, writing the %d of largest edge score "
                    "(max_links)", pruned.n_edges, max_links)
    touched = set(edge_target.tolist()) | set(edge_source.tolist())
    lay = graph.layout
    d_transcoder = (graph.metadata.get("transcoder") or {}).get("d_transcoder") \
        or int(graph.feature_id.max()) + 1 if graph.n_features else 1
    shown = [i for i in pruned.node_mask.nonzero().squeeze(-1).tolist()
             if i >= lay.tokens.start or i in touched]
    ids = {i: node_id(graph, i) for i in shown}
    nodes = []
    for i in shown:
        kind = graph.node_kind(i)
        layer, pos, feature, activation = graph.coordinates(i, kind)
        influence = float(pruned.cumulative_scores[i])
        shown_layer = str(sublayer(graph, layer, kind)) if layer is not None else "E"
        if kind == "feature":
            nodes.append(_node(ids[i], feature_index(layer, feature, d_transcoder), shown_layer,
                               pos, "cross layer transcoder", f"{shown_layer}_{feature}-0",
                               influence=influence, activation=activation,
                               clerp=(labels or {}).get((layer, feature), "")))
        elif kind == "lorsa":  # feature: the head, numbered per layer as features are
            width = int(graph.metadata["lorsa"]["n_ov_heads"][str(layer)])
            nodes.append(_node(ids[i], feature_index(layer, feature, width), shown_layer, pos,
                               "lorsa", f"{shown_layer}_{feature}-0", influence=influence,
                               activation=activation, clerp=f"Lorsa L{layer} head {feature}"))
        elif kind in ("error", "lorsa error"):
            nodes.append(_node(ids[i], -1, shown_layer, pos,
                               "mlp reconstruction error" if kind == "error" else kind,
                               f"{shown_layer}_-1-{pos}", influence=influence))
        elif kind == "steering":  # layer: the one whose output it joins ("E": the embeddings)
            nodes.append(_node(ids[i], feature, "E" if layer < 0 else str(layer), pos,
                               "steering", f"S{feature}-{pos}", influence=influence,
                               clerp=f"steering: {graph.steering_site(feature)}"))
        elif kind == "token":
            nodes.append(_node(ids[i], pos, "E", pos, "embedding",
                               f"E_{graph.input_ids[pos]}-{pos}", influence=influence))
        else:  # circuit-tracer marks the first (most probable) logit as the target
            j = i - lay.logits.start
            goal = graph.targets[j]
            prob = goal.get("prob")
            text = f'Output "{_clean(goal["text"])}"' + ("" if prob is None else
                                                         f" (p={prob:.3f})")
            logit_layer = 2 * graph.n_layers if graph.lorsa_layers else graph.n_layers + 1
            nodes.append(_node(ids[i], feature, str(logit_layer), pos, "logit",
                               f"L_{feature}-{pos}", token_prob=0.0 if prob is None else prob,
                               is_target=j == 0, clerp=text))
    links = [{"source": ids[s], "target": ids[t], "weight": _num(w)}
             for t, s, w in zip(edge_target.tolist(), edge_source.tolist(),
                                edge_weight.tolist(), strict=True)
             if s in ids and t in ids]
    metadata = {
        "slug": slug or "pyvene-causaltrace-graph",
        "scan": str((graph.metadata.get("transcoder") or {}).get("scan")
                    or graph.metadata.get("model", "")),
        "transcoder_list": [],
        "prompt_tokens": [_clean(t) for t in graph.tokens],
        "prompt": graph.prompt,
        "node_threshold": reading.node_threshold,
        "schema_version": 1,
        "info": {"generator": {"name": "pyvene-causaltrace", "version": __version__},
                 "transcoder_set": str(graph.metadata.get("clt", "")),
                 "transcoder": graph.metadata.get("transcoder"),
                 "logit_softcap": graph.metadata.get("logit_softcap"),
                 "steering": [{"id": f"S{j}", **site} for j, site in enumerate(graph.steering)],
                 **lorsa_info(graph),
                 "feature_nodes": {"active": graph.n_features, "explored": graph.n_explored},
                 "inputs": {"graph": identity, "prompt_sha256": text_digest(graph.prompt),
                            **(graph.metadata.get("fingerprints") or {})},
                 **({"faithfulness": graph.metadata["faithfulness"]}
                    if graph.metadata.get("faithfulness") else {})},
        "pruning_settings": {"node_threshold": reading.node_threshold,
                             "edge_threshold": reading.edge_threshold,
                             "pruned_edges": pruned.n_edges,
                             "max_links": max_links if capped else None},
        # Neuronpedia's schema types max_feature_nodes (an integer): an unknown one is left out
        "generation_settings": {key: value for key, value in (
            ("target", graph.target["name"]), ("targets", graph.metadata.get("targets")),
            ("bos_errors", graph.metadata.get("bos_errors")),
            ("bos", graph.metadata.get("bos")),
            ("max_feature_nodes", graph.metadata.get("max_feature_nodes")))
            if value is not None or key != "max_feature_nodes"},
    }
    q_params = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
                "sg_pos": ""}
    payload = {"metadata": metadata, "qParams": q_params, "nodes": nodes, "links": links,
               **qk_tracing_json(graph, node_id, set(ids.values()))}
    return payload if attention is None else attention.annotate(payload, graph, identity)


def write_json(payload: dict, path: str | Path | None) -> dict:
    """``payload``, written compactly (no spaces) through :func:`replacing` to ``path`` when
    given."""
    if path is not None:
        write_text(json.dumps(payload, separators=(",", ":"), ensure_ascii=False), path)
    return payload


def write_circuit_tracer_dir(payload: dict, directory: str | Path) -> Path:
    """Lay a graph out as circuit-tracer's local server reads it: ``<slug>.json`` beside a
    ``graph-metadata.json`` index (entries merged by slug), so that ``circuit-tracer
    start-server --graph_file_dir DIR`` opens it at ``/index.html?slug=<slug>``. (Its page loads
    d3 and dagre from the web.) Returns the graph file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = payload["metadata"]
    slug = meta["slug"]
    if not isinstance(slug, str) or not slug or Path(slug).name != slug or "\\" in slug:
        raise InputError(f"slug {slug!r} is not a file name: circuit-tracer serves "
                         "DIR/<slug>.json (no separators, not empty)")
    write_json(payload, directory / f"{slug}.json")
    index_path = directory / "graph-metadata.json"
    index = {"graphs": []}
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InputError(f"{index_path} is not a graph index ({error}); remove it to "
                             "start a new one") from None
        if not isinstance(index, dict) or not isinstance(index.get("graphs"), list):
            raise InputError(f"{index_path} is not a graph index (no 'graphs' list); remove "
                             "it to start a new one")
    entry = {key: meta[key] for key in ("slug", "scan", "prompt", "prompt_tokens",
                                        "node_threshold", "transcoder_list") if key in meta}
    index["graphs"] = [g for g in index["graphs"]
                       if not isinstance(g, dict) or g.get("slug") != slug] + [entry]
    write_text(json.dumps(index, indent=1), index_path)
    return directory / f"{slug}.json"


#: A layer or feature number as a labels file may write it: digits, or digits and ``.0``.
_INTEGER = re.compile(r"\d+(\.0*)?")
_TEXT_COLUMNS = ("label", "clerp", "description")


def _index(value: object) -> int | None:
    """``value`` as a non-negative integer if it is exactly one (``3``, ``"3"``, ``"3.0"``,
    ``3.0``), else None."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value.strip().split(".")[0])
    return None


def _csv_records(path: Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` per data row of a CSV/TSV table (``where``: "row N (line M)")."""
    delimiter = "\t" if path.suffix in (".tsv", ".tab") else ","
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle, delimiter=delimiter, strict=True)
            header = next(reader, None)
            if header is None:
                raise InputError(f"{path} is empty: need a header row layer, feature, label")
            header = [name.strip() for name in header]
            for row, cells in enumerate(reader, start=1):
                if not any(cell.strip() for cell in cells):
                    continue
                where = f"row {row} (line {reader.line_num})"
                if len(cells) != len(header):
                    raise InputError(f"{path}: {where} has {len(cells)} fields, the header "
                                     f"{len(header)}")
                yield where, dict(zip(header, cells, strict=True))
    except (UnicodeDecodeError, csv.Error) as error:
        raise InputError(f"{path} is not a readable CSV/TSV table: {error}") from None


def _json_records(path: Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` per entry of a JSON labels file (a list of records, or
    ``{"layer/feature": label}``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path} is not valid JSON: {error}") from None
    if isinstance(data, dict):
        for key, value in data.items():
            layer, slash, feature = key.partition("/")
            if not slash:
                raise InputError(f"{path}: key {key!r} is not 'layer/feature'")
            yield f"key {key!r}", {"layer": layer, "feature": feature, "label": value}
    elif isinstance(data, list):
        for row, record in enumerate(data, start=1):
            if not isinstance(record, dict):
                raise InputError(f"{path}: record {row} is a {type(record).__name__}, not an "
                                 "object with layer, feature and label")
            yield f"record {row}", record
    else:
        raise InputError(f"{path}: a list of records or an object of 'layer/feature': label "
                         f"is expected, found a {type(data).__name__}")


def read_labels(path: str | Path, n_layers: int | None = None,
                n_features: int | None = None) -> dict[tuple[int, int], str]:
    """Feature labels from a table: CSV/TSV (a header naming ``layer``, ``feature`` and
    ``label``, ``clerp`` or ``description``) or JSON (a list of such records, or
    ``{"layer/feature": label}``).

    ``layer`` and ``feature`` must be exact non-negative integers (``3``, ``"3"``, ``3.0``; not
    ``1.9``, ``-1`` or missing); one (layer, feature) given two different labels is refused; with
    ``n_layers`` / ``n_features``, a label of a layer or feature the transcoder lacks is refused
    (it would label nothing, silently). Each refusal is an :class:`InputError` naming the file and
    the row."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"labels file {path} does not exist")
    if path.is_dir():
        raise InputError(f"labels file {path} is a directory")
    records = _json_records(path) if path.suffix == ".json" else _csv_records(path)
    labels: dict[tuple[int, int], str] = {}
    first: dict[tuple[int, int], str] = {}
    text = None
    for where, record in records:
        if text is None:
            text = next((c for c in _TEXT_COLUMNS if c in record), None)
            if text is None or not {"layer", "feature"} <= set(record):
                raise InputError(f"{path}: need columns layer, feature and label (or clerp / "
                                 f"description); found {list(record)}")
        layer, feature = _index(record.get("layer")), _index(record.get("feature"))
        if layer is None or feature is None:
            raise InputError(f"{path}: {where} has layer {record.get('layer')!r}, feature "
                             f"{record.get('feature')!r}: both must be non-negative integers")
        for name, value, size in (("layer", layer, n_layers), ("feature", feature, n_features)):
            if size is not None and value >= size:
                raise InputError(f"{path}: {where} labels layer {layer}, feature {feature}: the "
                                 f"transcoder has no {name} {value} ({name}s 0..{size - 1}); "
                                 "a labels file of another transcoder?")
        label = record.get(text)
        if isinstance(label, bool) or not isinstance(label, str | int | float):
            raise InputError(f"{path}: {where} has {text} {label!r}: text expected")
        key, label = (layer, feature), str(label)
        if key in labels and labels[key] != label:
            raise InputError(f"{path}: {where} labels layer {layer}, feature {feature} "
                             f"{label!r}, but {first[key]} labels it {labels[key]!r}")
        labels.setdefault(key, label)
        first.setdefault(key, where)
    if text is None:
        raise InputError(f"{path} holds no labels")
    return labels
