"""Which files under a directory the viewer lists and serves: attribution-graph JSON, whoever
wrote it (the rules: docs/attribution.md, "The viewer").

Listed: a regular ``*.json`` file, not hidden, within :data:`MAX_BYTES` and :data:`MAX_DEPTH`,
that Neuronpedia's graph schema validates or that carries :data:`GENERATOR`. Everything else
is skipped and logged once with its reason. JSON is read strictly (:mod:`..strict_json`), files
non-blocking and only up to their size, checked keeping one verdict per node and link, and
cached by path and (device, inode, size, mtime)."""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..arguments import checked
from ..errors import NonFiniteError
from ..graph_schema import LINK, NODE, ItemCheck, outer_problem
from ..strict_json import loads

log = logging.getLogger("pyvene_causaltrace.viewer")

#: Largest graph file listed, in bytes (``make_server(..., max_bytes=...)`` overrides it).
MAX_BYTES = 256 * 1024 * 1024
#: Deepest nesting of arrays and objects listed (a graph.json nests 5 levels).
MAX_DEPTH = 64
#: ``metadata.info.generator.name`` of the graph JSON this package writes.
GENERATOR = "pyvene-causaltrace"

_CHUNK = 1 << 24  # bytes scanned at once by nesting_depth
_NOT_A_GRAPH = "not a graph JSON (no nodes and links)"
#: circuit-tracer's own Save writes these qParams as strings (its page's URL parameters).
_CIRCUIT_TRACER_STRINGS = ("pinnedIds", "supernodes")

Key = tuple[int, int, int, int, int]


class Verdict(NamedTuple):
    """What the listing decided about one version of a file: why it is not listed (None: it
    is) and the generator its metadata names (``metadata.info.generator.name``, or None)."""

    problem: str | None
    generator: str | None = None


class _Skip(Exception):
    """A file that is not read (its reason is the message)."""


def file_key(st: os.stat_result) -> Key:
    """What identifies one version of a file: a new write (or a rename over it) changes it."""
    return st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def nesting_depth(data: bytes, limit: int = MAX_DEPTH) -> int | None:
    """How deeply the arrays and objects in the JSON text ``data`` nest (brackets inside
    strings do not count): ``limit + 1`` when deeper than ``limit``, None when its brackets do
    not balance. Without recursion, in linear time and a few bytes of memory per byte of text:
    a running count of brackets outside strings, in chunks."""
    if b"\\" in data:  # escaped backslashes, then escaped quotes: every quote left is real
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(data, dtype=np.uint8)
    depth, deepest, in_string = 0, 0, False
    for start in range(0, len(text), _CHUNK):
        chunk = text[start:start + _CHUNK]
        inside = np.logical_xor.accumulate(chunk == ord('"')) ^ in_string
        in_string = bool(inside[-1])
        step = ((chunk == ord("[")) | (chunk == ord("{"))).astype(np.int8)
        step -= (chunk == ord("]")) | (chunk == ord("}"))
        step[inside] = 0
        levels = np.cumsum(step[step != 0], dtype=np.int64) + depth
        if levels.size:
            if levels.min() < 0:
                return None
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
            if deepest > limit:
                return limit + 1
    return None if depth or in_string else deepest


#: Verdicts on node- and link-like objects, shared: (node problem, link problem).
_ItemVerdict = tuple[str | None, str | None]


def _reduce(pairs: list[tuple[str, object]]) -> dict | _ItemVerdict:
    """An object as it is parsed: one that may be a node (``node_id``) or a link (``source``) is
    checked against both item schemas and replaced by the two verdicts (a few shared tuples
    however many nodes a file has); any other (metadata, qParams) is kept."""
    item = dict(pairs)
    node, link = "node_id" in item, "source" in item
    if not (node or link):
        return item
    verdict = (NODE.problem(item) if node else _NO_NODE_ID,
               LINK.problem(item) if link else _NO_SOURCE)
    return _VERDICTS.setdefault(verdict, verdict)


_VERDICTS: dict[_ItemVerdict, _ItemVerdict] = {}
_NO_NODE_ID, _NO_SOURCE = "'node_id' is a required property", "'source' is a required property"


def _items_problem(payload: dict, key: str, check: ItemCheck, side: int) -> str | None:
    items = payload.get(key)
    if not isinstance(items, list):
        return None  # the schema says so
    for i, item in enumerate(items):
        problem = item[side] if isinstance(item, tuple) else check.problem(item)
        if problem is not None:
            return f"{key}[{i}]: {problem}"
    return None


def examine(data: bytes, max_depth: int = MAX_DEPTH) -> Verdict:
    """Whether the JSON text ``data`` is a graph the viewer lists (see the module), and the
    generator it names."""
    if b'"nodes"' not in data or b'"links"' not in data:  # most other JSON is never parsed
        return Verdict(_NOT_A_GRAPH)
    depth = nesting_depth(data, max_depth)
    if depth is None:
        return Verdict("not valid JSON (its brackets do not balance)")
    if depth > max_depth:
        return Verdict(f"nested deeper than {max_depth} levels")
    try:
        payload = loads(data, object_pairs_hook=_reduce)
    except RecursionError:
        return Verdict(f"nested deeper than {max_depth} levels")
    except NonFiniteError as error:
        return Verdict(f"not JSON: {error}; a browser cannot read it")
    except ValueError as error:
        return Verdict(f"not valid JSON ({error})")
    generator = _field(payload, "metadata", "info", "generator", "name")
    generator = generator if isinstance(generator, str) else None
    if not isinstance(payload, dict) or not isinstance(payload.get("nodes"), list) \
            or not isinstance(payload.get("links"), list):
        return Verdict(_NOT_A_GRAPH, generator)
    if generator == GENERATOR:
        return Verdict(None, generator)
    q = payload.get("qParams")
    if isinstance(q, dict):  # circuit-tracer's saved strings: the page reads them too
        payload = {**payload, "qParams": {key: value for key, value in q.items()
                                          if not (key in _CIRCUIT_TRACER_STRINGS
                                                  and isinstance(value, str))}}
    problem = outer_problem(payload) or _items_problem(payload, "nodes", NODE, 0) \
        or _items_problem(payload, "links", LINK, 1)
    if problem is not None:
        return Verdict(f"not a graph JSON: Neuronpedia's graph schema refuses it ({problem})",
                       generator)
    return Verdict(None, generator)


def _field(payload: object, *keys: str) -> object:
    for key in keys:
        payload = payload.get(key) if isinstance(payload, dict) else None
    return payload


def read_capped(path: Path, max_bytes: int) -> tuple[bytes, Key]:
    """The bytes of the regular file at ``path`` (at most ``max_bytes``) and its key. Opened
    without blocking (a FIFO does not wait for a writer) and checked on the open file; raises
    :class:`_Skip` for anything else."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        with open(os.open(path, flags), "rb") as handle:
            st = os.fstat(handle.fileno())
            _check_stat(st, max_bytes)
            data = handle.read(st.st_size + 1)
    except OSError as error:
        raise _Skip(f"cannot read it ({error.strerror})") from None
    if len(data) != st.st_size:
        raise _Skip("it changed while it was read")
    return data, file_key(st)


def _check_stat(st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _Skip("not a regular file (a FIFO, device, socket, or a link to one)")
    if st.st_size > max_bytes:
        raise _Skip(f"{st.st_size} bytes, over the {max_bytes}-byte cap (max_bytes)")


class GraphIndex:
    """The graph files under ``directory``, found again on each call (cheap: unchanged files
    are not read again). Safe to share between the server's threads."""

    def __init__(self, directory: str | Path, max_bytes: int = MAX_BYTES,
                 max_depth: int = MAX_DEPTH) -> None:
        self.root = Path(directory).expanduser().resolve()
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self._verdicts: dict[str, tuple[Key, Verdict]] = {}
        self._logged: dict[str, tuple[Key | None, str]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The graph files' paths relative to the directory (``/``-separated), sorted."""
        return sorted(self._scan())

    def entries(self) -> list[dict[str, object]]:
        """The graph files, sorted by path: ``{"name": path, "generator": name or None,
        "ours": whether this package wrote it}`` (its ``metadata.info.generator.name``)."""
        return [{"name": name, "generator": generator, "ours": generator == GENERATOR}
                for name, (_, generator) in sorted(self._scan().items())]

    def skipped(self) -> list[dict[str, str]]:
        """The ``*.json`` files that look like graphs but are not listed, sorted by path:
        ``{"name": path, "reason": why}`` (files that are no graph JSON at all left out)."""
        self._scan()
        with self._lock:
            return [{"name": name, "reason": problem}
                    for name, (_, problem) in sorted(self._logged.items())
                    if problem != _NOT_A_GRAPH]

    @checked
    def load(self, name: str) -> tuple[bytes, Key] | None:
        """The bytes of graph ``name`` and the key (mode, device, inode, size, mtime) of the
        file they were read from, or None when it is not listed."""
        listed = self._scan()
        if name not in listed:
            return None
        try:
            data, key = read_capped(self.root / name, self.max_bytes)
        except _Skip as skip:
            with self._lock:
                self._report(name, None, str(skip))
            return None
        if key != listed[name][0]:  # changed since it was listed: judge what was read
            verdict = examine(data, self.max_depth)
            with self._lock:
                self._verdicts[name] = key, verdict
                if verdict.problem is not None:
                    self._report(name, key, verdict.problem)
            if verdict.problem is not None:
                return None
        return data, key

    def _scan(self) -> dict[str, tuple[Key, str | None]]:
        """The listed files: path -> (key, generator)."""
        with self._lock:
            listed, seen = {}, set()
            for path in _json_files(self.root):
                name = path.relative_to(self.root).as_posix()
                seen.add(name)
                key, verdict = self._judge(name, path)
                if verdict.problem is None:
                    listed[name] = key, verdict.generator
                    self._logged.pop(name, None)
                else:
                    self._report(name, key, verdict.problem)
            for gone in set(self._verdicts) - seen:
                del self._verdicts[gone]
            for gone in set(self._logged) - seen:
                del self._logged[gone]
            return listed

    def _judge(self, name: str, path: Path) -> tuple[Key | None, Verdict]:
        try:
            st = os.stat(path)
        except OSError as error:
            return None, Verdict(f"cannot read it ({error.strerror})")
        key = file_key(st)
        try:
            _check_stat(st, self.max_bytes)
        except _Skip as skip:
            return key, Verdict(str(skip))
        if path.is_symlink() and self.root not in path.resolve().parents:
            return key, Verdict("a link to a file outside the directory")
        cached = self._verdicts.get(name)
        if cached is not None and cached[0] == key:
            return cached
        try:
            data, key = read_capped(path, self.max_bytes)
        except _Skip as skip:
            return key, Verdict(str(skip))
        self._verdicts[name] = key, examine(data, self.max_depth)
        return self._verdicts[name]

    def _report(self, name: str, key: Key | None, problem: str) -> None:
        if self._logged.get(name) == (key, problem):
            return
        self._logged[name] = key, problem
        level = logging.INFO if problem == _NOT_A_GRAPH else logging.WARNING
        log.log(level, "viewer: skipped %s: %s", self.root / name, problem)


def _json_files(root: Path) -> Iterator[Path]:
    """``*.json`` entries under ``root`` that are not directories, hidden ones (``.name``:
    e.g. a graph being written, ``.git``) left out; links to directories are not followed."""
    for folder, folders, files in os.walk(root, followlinks=False):
        folders[:] = [name for name in folders if not name.startswith(".")]
        for file in files:
            if file.endswith(".json") and not file.startswith("."):
                yield Path(folder) / file


@checked
def find_graphs(directory: str | Path, max_bytes: int = MAX_BYTES,
                max_depth: int = MAX_DEPTH) -> list[str]:
    """Relative paths of the graph JSON files under ``directory``, sorted (see
    :class:`GraphIndex`)."""
    return GraphIndex(directory, max_bytes, max_depth).names()
