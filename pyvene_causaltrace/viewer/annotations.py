"""Annotations made in the viewer (pinned nodes, supernodes, edited labels) saved into the graph
file in the fields circuit-tracer's and Neuronpedia's viewers read (docs/attribution.md, "The
viewer", has the fields and why labels go into each node's ``clerp``).

    summary = save(index, "eiffel/graph.json", body)   # body: the page's POST, as bytes

Only :data:`FIELDS` and :data:`EDITABLE` labels change; an id naming two nodes cannot be
annotated. A save is checked in time linear in the request, then the file is read, checked
against its version and replaced whole under a ``flock`` on ``.NAME.lock`` beside it."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..atomic import replacing
from ..errors import InputError, NonFiniteError
from ..strict_json import loads
from .listing import GraphIndex, Key, file_key

#: Largest save request read, in bytes (``make_server(..., max_save_bytes=...)`` overrides it).
MAX_SAVE_BYTES = 4 * 1024 * 1024
#: Longest label and supernode name, in characters.
MAX_LABEL_CHARS = 2000
MAX_NAME_CHARS = 200
#: The ``qParams`` fields a save may set.
FIELDS = ("pinnedIds", "supernodes", "clickedId", "linkType", "sg_pos", "pruningThreshold")
#: circuit-tracer's link-type buttons (``attribution_graph/init-cg-button-container.js``).
LINK_TYPES = ("input", "output", "either", "both")
#: Node kinds whose label (``clerp``) can be edited: features (``cross layer transcoder``
#: whatever the transcoder, Neuronpedia's attention ``lorsa``) and our steering nodes.
EDITABLE = ("cross layer transcoder", "lorsa", "steering")
#: The kind given to a node id that names more than one node (see :func:`node_kinds`).
AMBIGUOUS = "\0ambiguous"

_NUMBER = r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_SG_POS = re.compile(rf"(?:{_NUMBER}(?: {_NUMBER})*)?", re.ASCII)  # the page checks the same
_BODY = '{"qParams": {"pinnedIds": [...], "supernodes": [...], ...}, "clerps": [[id, text]]}'
#: Seconds a save waits for another process's save of the same file before it is refused (503).
LOCK_WAIT_S = 10.0
_lock = threading.Lock()  # one save at a time in this process; _file_lock across processes
log = logging.getLogger("pyvene_causaltrace.viewer")


class AnnotationError(InputError):
    """A save request refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _refuse(message: str, status: int = 400) -> AnnotationError:
    return AnnotationError(status, message)


def _text(value: object, where: str, limit: int, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise _refuse(f"{where}: text expected, got {json.dumps(value)[:60]}")
    if len(value) > limit:
        raise _refuse(f"{where}: {len(value)} characters, over the {limit}-character limit")
    if not empty and not value.strip():
        raise _refuse(f"{where}: empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _refuse(f"{where}: not valid Unicode (a lone surrogate)") from None
    return value


def _node(value: object, where: str, kinds: Mapping[str, str], shared: bool = False) -> str:
    """``value`` if it is one node's id (``shared``: or several nodes')."""
    if not isinstance(value, str) or value not in kinds:
        raise _refuse(f"{where}: {json.dumps(value)[:80]} is not a node of this graph")
    if kinds[value] == AMBIGUOUS and not shared:
        raise _refuse(f"{where}: {value} names more than one node of this graph (circuit-"
                      "tracer's error ids 0_{layer}_{pos} can equal a layer-0 feature's): it "
                      "cannot be pinned, grouped or labelled")
    return value


def node_kinds(nodes: list[dict]) -> dict[str, str]:
    """Node id -> ``feature_type`` (as text), :data:`AMBIGUOUS` for an id that names several
    nodes: annotating one of those would annotate whichever the reader finds first."""
    kinds: dict[str, str] = {}
    for node in nodes:
        node_id = node["node_id"]
        kinds[node_id] = AMBIGUOUS if node_id in kinds else str(node.get("feature_type"))
    return kinds


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise _refuse(f"{where}: a list expected, got {type(value).__name__}")
    return value


def _pinned(value: object, kinds: Mapping[str, str]) -> list[str]:
    pinned: list[str] = []
    seen: set[str] = set()  # a set, not the list: linear in the ids, under the save lock
    for i, item in enumerate(_list(value, "qParams.pinnedIds")):
        node = _node(item, f"qParams.pinnedIds[{i}]", kinds)
        if node in seen:
            raise _refuse(f"qParams.pinnedIds[{i}]: {node} is pinned twice")
        seen.add(node)
        pinned.append(node)
    return pinned


def _supernodes(value: object, pinned: set[str], kinds: Mapping[str, str]) -> list[list[str]]:
    supernodes, owner = [], {}
    for i, item in enumerate(_list(value, "qParams.supernodes")):
        where = f"qParams.supernodes[{i}]"
        if not isinstance(item, list) or len(item) < 2:
            raise _refuse(f"{where}: [name, node_id, ...] expected (a name and one member at "
                          "least)")
        name = _text(item[0], f"{where}[0] (the name)", MAX_NAME_CHARS, empty=False)
        for j, member in enumerate(item[1:], start=1):
            node = _node(member, f"{where}[{j}]", kinds)
            if node not in pinned:
                raise _refuse(f"{where}[{j}]: {node} is not pinned (a supernode groups pinned "
                              "nodes)")
            if node in owner:
                raise _refuse(f"{where}[{j}]: {node} is already in supernode "
                              f"{json.dumps(owner[node])}")
            owner[node] = name
        supernodes.append([name, *item[1:]])
    return supernodes


def _other_fields(q: dict, kinds: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "clickedId" in q:
        clicked = q["clickedId"]
        out["clickedId"] = "" if clicked == "" else _node(clicked, "qParams.clickedId", kinds,
                                                          shared=True)
    if "linkType" in q:
        if q["linkType"] not in LINK_TYPES:
            raise _refuse(f"qParams.linkType: {json.dumps(q['linkType'])[:40]} is not one of "
                          f"{', '.join(LINK_TYPES)}")
        out["linkType"] = q["linkType"]
    if "sg_pos" in q:
        sg_pos = _text(q["sg_pos"], "qParams.sg_pos", 100_000)
        if not _SG_POS.fullmatch(sg_pos):
            raise _refuse("qParams.sg_pos: space-separated numbers expected")
        if not all(math.isfinite(float(x)) for x in sg_pos.split()):
            raise _refuse("qParams.sg_pos: a number overflows a double (a browser reads it as "
                          "Infinity)")
        out["sg_pos"] = sg_pos
    if "pruningThreshold" in q:
        threshold = q["pruningThreshold"]
        # compared as it is: a 400-digit integer is no float (math.isfinite would overflow)
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) \
                or (isinstance(threshold, float) and not math.isfinite(threshold)) \
                or not 0 <= threshold <= 1:
            raise _refuse(f"qParams.pruningThreshold: a number from 0 to 1 expected, got "
                          f"{json.dumps(threshold)[:40]}")
        out["pruningThreshold"] = threshold
    return out


def _labels(value: object, kinds: Mapping[str, str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for i, item in enumerate(_list(value, "clerps")):
        where = f"clerps[{i}]"
        if not isinstance(item, list) or len(item) != 2:
            raise _refuse(f"{where}: [node_id, text] expected")
        node = _node(item[0], f"{where}[0]", kinds)
        if kinds[node] not in EDITABLE:
            raise _refuse(f"{where}[0]: {node} is a {kinds[node]} node: only feature labels "
                          "can be edited (the viewers write the others themselves)")
        if node in labels:
            raise _refuse(f"{where}[0]: {node} is labelled twice")
        labels[node] = _text(item[1], f"{where}[1]", MAX_LABEL_CHARS)
    return labels


def parse_save(body: bytes, kinds: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``qParams`` fields and the labels (``{node_id: text}``) a save request sets, checked
    against the graph's nodes (``kinds``: node id -> ``feature_type``); raises
    :class:`AnnotationError` (400) naming the first field refused."""
    try:
        request = loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise _refuse("the body is not UTF-8 text") from None
    except RecursionError:
        raise _refuse("the body nests too deeply") from None
    except NonFiniteError as error:
        raise _refuse(f"the body holds a number a browser cannot read back ({error})") from None
    except ValueError as error:
        raise _refuse(f"the body is not JSON ({error})") from None
    if not isinstance(request, dict) or not isinstance(request.get("qParams"), dict):
        raise _refuse(f"the body must be a JSON object {_BODY}")
    extra = sorted(set(request) - {"qParams", "clerps"})
    if extra:
        raise _refuse(f"unknown key {extra[0]!r} in the body (expected qParams and clerps)")
    q = request["qParams"]
    unknown = sorted(set(q) - set(FIELDS))
    if unknown:
        raise _refuse(f"qParams.{unknown[0]}: not a field the viewer saves ({', '.join(FIELDS)})")
    for field in ("pinnedIds", "supernodes"):
        if field not in q:
            raise _refuse(f"qParams.{field} is missing (send the whole annotation: pinnedIds "
                          "and supernodes)")
    pinned = _pinned(q["pinnedIds"], kinds)
    fields = {"pinnedIds": pinned, "supernodes": _supernodes(q["supernodes"], set(pinned), kinds),
              **_other_fields(q, kinds)}
    return fields, _labels(request.get("clerps", []), kinds)


def version(key: Key) -> str:
    """A file version's entity tag (``ETag``): the page sends it back (``If-Match``) so that a
    save made from a page older than the file is refused rather than written onto another
    graph whose node ids happen to match."""
    return '"' + "-".join(f"{part:x}" for part in key[1:]) + '"'


def lock_path(target: Path) -> Path:
    """The lock file beside graph file ``target`` that saves of it hold (hidden: not listed)."""
    return target.with_name(f".{target.name}.lock")


@contextmanager
def _file_lock(target: Path, name: str) -> Iterator[None]:
    """Hold ``target``'s lock file (a ``flock``, dropped when its process ends); a save that
    waited :data:`LOCK_WAIT_S` is refused (503). The file is unlinked while still locked however
    the block ends, and a lock counts only on the file the path names at that moment, so removing
    it never lets two saves in at once."""
    path = lock_path(target)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                raise _refuse(f"{name} is being saved by another process (it holds "
                              f"{path.name}): save again in a moment", 503) from None
            time.sleep(0.05)
            continue
        except BaseException:
            os.close(fd)
            raise
        try:
            held = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            held = False
        if held:
            break
        os.close(fd)  # the file was removed (or replaced) before we locked it: open it again
    try:
        yield
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:  # the save's outcome stands; a lock file left is harmless
            log.warning("viewer: could not remove %s: %s", path, error.strerror or error)
        finally:
            os.close(fd)  # closing drops the lock


def _not_listed(index: GraphIndex, name: str) -> str:
    """Why a save of ``name`` is refused as not listed: the listing's reason when it has one."""
    reason = next((e["reason"] for e in index.skipped() if e["name"] == name), None)
    return f"{name!r} is not a graph the viewer lists" + (f" ({reason}): not saved" if reason
                                                          else "")


def save(index: GraphIndex, name: str, body: bytes,
         if_match: str | None = None) -> tuple[dict[str, int], str]:
    """Write the annotations in ``body`` (a save request) into graph ``name`` of ``index`` under its
    lock file (:func:`lock_path`); returns how many pinned nodes, supernodes and labels the file
    now has or got, and the written file's :func:`version`. Raises :class:`AnnotationError`: 404
    for a graph not listed, 400 for a malformed request, 403 for a write-protected file, 412 when
    ``if_match`` is not the file's version (it changed since the page loaded it), 409 when it
    changed while being saved, 413 when the annotated file would be over the listing's size cap,
    503 when another process's save of it did not end in time."""
    with _lock:
        if name not in index.names():
            raise _refuse(_not_listed(index, name), 404)
        target = (index.root / name).resolve()  # a listed link: write the file it names
        with _file_lock(target, name):
            summary, key = _save_locked(index, name, target, body, if_match)
    return summary, version(key)


def _save_locked(index: GraphIndex, name: str, target: Path, body: bytes,
                 if_match: str | None) -> tuple[dict[str, int], Key]:
    loaded = index.load(name)
    if loaded is None:
        raise _refuse(_not_listed(index, name), 404)
    if (index.root / name).resolve() != target:
        raise _refuse(f"{name} changed on disk while it was being saved (it now links to "
                      "another file); reload the page and save again", 409)
    data, key = loaded
    if if_match is not None and if_match.strip() != version(key):
        raise _refuse(f"{name} changed on disk since the page loaded it: reload the page "
                      "(annotations not saved are lost) and annotate again", 412)
    # no write bit for the owner: protected, which the replacing rename would ignore (the mode
    # bits, not os.access, which says yes to root)
    if not key[0] & stat.S_IWUSR:
        raise _refuse(f"{name} is write-protected (mode {stat.S_IMODE(key[0]):04o}): not saved; "
                      "make it writable (chmod u+w) to save annotations into it", 403)
    graph = loads(data)  # listed: strict JSON already
    nodes = [n for n in graph["nodes"] if isinstance(n, dict)
             and isinstance(n.get("node_id"), str)]
    kinds = node_kinds(nodes)
    fields, labels = parse_save(body, kinds)
    q = graph.get("qParams")
    graph["qParams"] = {**(q if isinstance(q, dict) else {}), **fields}
    for node in nodes:
        if node["node_id"] in labels:
            node["clerp"] = labels[node["node_id"]]
    text = json.dumps(graph, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > index.max_bytes:
        raise _refuse(f"the annotated graph would be {size} bytes, over the viewer's "
                      f"{index.max_bytes}-byte cap (max_bytes): not saved", 413)
    st = os.stat(target)
    if file_key(st) != key:  # a writer that does not take the lock (attribute --out)
        raise _refuse(f"{name} changed on disk while it was being saved; reload the page "
                      "and save again", 409)
    with replacing(target) as tmp:
        try:
            tmp.write_text(text, encoding="utf-8")
        except UnicodeEncodeError:  # a lone surrogate escaped in the file as it was
            tmp.write_text(json.dumps(graph, separators=(",", ":"), allow_nan=False),
                           encoding="utf-8")
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
    summary = {"pinned": len(fields["pinnedIds"]), "supernodes": len(fields["supernodes"]),
               "labels": len(labels)}
    return summary, file_key(os.stat(target))
