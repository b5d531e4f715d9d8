"""Which files under a directory the viewer lists and serves: graph JSON this package wrote.

A file is listed when it is a regular file (or a link, within the directory, to one) named
``*.json``, not hidden (``.name``, nor in a hidden folder: a graph being written is), at most
:data:`MAX_BYTES` long, nested at most :data:`MAX_DEPTH` levels deep, and a JSON object with
``nodes`` and ``links`` lists whose ``metadata.info.generator.name`` is :data:`GENERATOR` (the
marker ``attribute``'s graph.json export carries). Everything else — a FIFO, device or socket,
a link to one or out of the directory, a file over the cap or too deep, any other JSON — is
skipped and logged once (again only if it changes). Files are opened non-blocking and read only
up to their size, so a FIFO or a link to ``/dev/zero`` cannot hang or fill memory. Verdicts are
cached by path and (device, inode, size, mtime): an unchanged file is never read twice.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger("pyvene_causaltrace.viewer")

#: Largest graph file listed, in bytes (``make_server(..., max_bytes=...)`` overrides it).
MAX_BYTES = 256 * 1024 * 1024
#: Deepest nesting of arrays and objects listed (a graph.json nests 5 levels).
MAX_DEPTH = 64
#: ``metadata.info.generator.name`` of the graph JSON this package writes.
GENERATOR = "pyvene-causaltrace"

_MARKER = json.dumps(GENERATOR).encode()
_CHUNK = 1 << 24  # bytes scanned at once by nesting_depth
_NOT_A_GRAPH = f"not a graph JSON written by {GENERATOR}"
_PATH_KEYS = frozenset({"metadata", "info", "generator", "name", "nodes", "links"})

Key = tuple[int, int, int, int, int]


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


def _skeleton(pairs: list[tuple[str, object]]) -> dict | None:
    """An object on the way to the marker (or the top level), kept; any other (a node, a
    link) dropped as None, so that checking a graph holds little more than its text."""
    return dict(pairs) if any(key in _PATH_KEYS for key, _ in pairs) else None


def graph_problem(data: bytes, max_depth: int = MAX_DEPTH) -> str | None:
    """Why ``data`` is not a graph JSON this package wrote, or None when it is one."""
    if _MARKER not in data:  # cheap: most other JSON is never parsed
        return _NOT_A_GRAPH
    depth = nesting_depth(data, max_depth)
    if depth is None:
        return "not valid JSON (its brackets do not balance)"
    if depth > max_depth:
        return f"nested deeper than {max_depth} levels"
    try:
        payload = json.loads(data, object_pairs_hook=_skeleton)
    except RecursionError:
        return f"nested deeper than {max_depth} levels"
    except ValueError as error:
        return f"not valid JSON ({error})"
    if _field(payload, "metadata", "info", "generator", "name") != GENERATOR \
            or not isinstance(_field(payload, "nodes"), list) \
            or not isinstance(_field(payload, "links"), list):
        return _NOT_A_GRAPH
    return None


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
        self._verdicts: dict[str, tuple[Key, str | None]] = {}
        self._logged: dict[str, tuple[Key | None, str]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The graph files' paths relative to the directory (``/``-separated), sorted."""
        return sorted(self._scan())

    def read(self, name: str) -> bytes | None:
        """The bytes of graph ``name`` (one of :meth:`names`), or None when it is not listed."""
        loaded = self.load(name)
        return None if loaded is None else loaded[0]

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
        if key != listed[name]:  # changed since it was listed: judge what was read
            problem = graph_problem(data, self.max_depth)
            with self._lock:
                self._verdicts[name] = key, problem
                if problem is not None:
                    self._report(name, key, problem)
            if problem is not None:
                return None
        return data, key

    def _scan(self) -> dict[str, Key]:
        with self._lock:
            listed, seen = {}, set()
            for path in _json_files(self.root):
                name = path.relative_to(self.root).as_posix()
                seen.add(name)
                key, problem = self._judge(name, path)
                if problem is None:
                    listed[name] = key
                    self._logged.pop(name, None)
                else:
                    self._report(name, key, problem)
            for gone in set(self._verdicts) - seen:
                del self._verdicts[gone]
            for gone in set(self._logged) - seen:
                del self._logged[gone]
            return listed

    def _judge(self, name: str, path: Path) -> tuple[Key | None, str | None]:
        try:
            st = os.stat(path)
        except OSError as error:
            return None, f"cannot read it ({error.strerror})"
        key = file_key(st)
        try:
            _check_stat(st, self.max_bytes)
        except _Skip as skip:
            return key, str(skip)
        if path.is_symlink() and self.root not in path.resolve().parents:
            return key, "a link to a file outside the directory"
        cached = self._verdicts.get(name)
        if cached is not None and cached[0] == key:
            return cached
        try:
            data, key = read_capped(path, self.max_bytes)
        except _Skip as skip:
            return key, str(skip)
        self._verdicts[name] = key, graph_problem(data, self.max_depth)
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


def find_graphs(directory: str | Path, max_bytes: int = MAX_BYTES,
                max_depth: int = MAX_DEPTH) -> list[str]:
    """Relative paths of the graph JSON files this package wrote under ``directory``, sorted
    (see :class:`GraphIndex`)."""
    return GraphIndex(directory, max_bytes, max_depth).names()
