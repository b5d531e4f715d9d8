"""Where a dataset run's rows go as they are produced, so that nothing is lost on interruption.

An output directory holds ``manifest.json`` (settings and fingerprints: a rerun resumes only
when they match), ``.pvct.lock``, ``screen.jsonl``, ``results.jsonl`` and, with a transcoder,
``graphs.jsonl`` and ``graphs/`` (docs/datasets.md). Rows are appended one synced ``write`` per
batch, cut back if the write fails; only ``kill -9`` can leave a last line without its newline,
dropped when the directory is next opened. Any other incomplete line is damage, refused naming
the file and line."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..atomic import write_text
from ..errors import DamagedFileError, ManifestMismatchError
from ..runlock import single_writer
from ..strict_json import loads

MANIFEST, SCREEN, RESULTS = "manifest.json", "screen.jsonl", "results.jsonl"
GRAPHS = "graphs.jsonl"
FAITHFULNESS = "faithfulness.jsonl"  # a trace's faithfulness per (fact, kind)
_NUMBER = (int, float)
_NUMBER_OR_NULL = (int, float, type(None))

#: Keys (and their types) a line of each file must have.
ROW_FIELDS = {
    RESULTS: {"index": int, "fact": str, "kind": str, "seed": int, "subject_range": list,
              "clean": _NUMBER, "corrupt": _NUMBER, "restored": list},
    SCREEN: {"fact": (str, type(None)), "kept": bool},
    GRAPHS: {"index": int, "fact": str, "tokens": list, "subject_range": list, "answer": str,
             "n_features": int, "n_explored": int, "closure": _NUMBER,
             "error_share": _NUMBER_OR_NULL, "replacement": _NUMBER_OR_NULL,
             "completeness": _NUMBER_OR_NULL, "seconds": _NUMBER, "influence": dict},
}

#: What a differing manifest key means, for the message.
_MEANING = {"model": "the model's weights", "tokenizer": "the tokenizer",
            "records": "the data", "version": "the pyvene-causaltrace version",
            "transcoder": "the transcoder (its weights; None: a run without graphs)",
            "graphs": "the graph settings (None: a run without graphs)"}


def _afresh(directory: Path) -> str:
    return f"remove {directory} or choose another --out (output directory) to start afresh"


def _drop_partial_line(path: Path) -> None:
    """Cut a trailing line that a kill left without its newline (reads only the file's tail)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as handle:
        end = size
        while end > 0:
            start = max(0, end - 65536)
            handle.seek(start)
            block = handle.read(end - start)
            if end == size and block.endswith(b"\n"):
                return
            cut = block.rfind(b"\n")
            if cut >= 0 or start == 0:
                handle.truncate(start + cut + 1)
                handle.flush()
                os.fsync(handle.fileno())
                return
            end = start


def _check_row(row: object, fields: dict) -> str | None:
    """Why ``row`` is not a row with ``fields``, or ``None``."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for key, kind in fields.items():
        if key not in row:
            return f"no {key!r} field"
        value = row[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            return f"field {key!r} is {value!r}"
    return None


def read_jsonl(path: Path, fields: dict | None = None) -> Iterator[dict]:
    """Complete lines of ``path`` (none when it does not exist), one at a time. A last line
    without its newline (a kill mid-write) is skipped; any other line that is not JSON (or lacks
    ``fields``, default: those of the file's name in :data:`ROW_FIELDS`) raises
    :class:`~pyvene_causaltrace.errors.DamagedFileError` naming the file and line."""
    path = Path(path)
    fields = ROW_FIELDS.get(path.name, {}) if fields is None else fields
    if not path.exists():
        return
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.endswith(b"\n"):
                return
            try:
                row = loads(raw)
            except ValueError as error:  # JSONDecodeError, NaN/inf, or bytes not UTF-8
                problem = f"not a complete JSON row of finite numbers ({error})"
            else:
                problem = _check_row(row, fields)
            if problem is not None:
                raise DamagedFileError(
                    f"{path}, line {number}, is damaged: {problem}; delete that line (a rerun "
                    f"recomputes what it held), or start afresh in another --out")
            yield row


def read_manifest(directory: Path) -> dict:
    """``directory``'s manifest; refused when missing (naming the directory) or damaged
    (naming the file)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise FileNotFoundError(f"no run directory at {directory}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        rows = has_rows(directory)
        if not rows:
            raise ManifestMismatchError(
                f"{directory} holds no {MANIFEST}: not a dataset run directory") from None
        raise ManifestMismatchError(
            f"{directory} holds rows ({', '.join(rows)}) but no {MANIFEST} (deleted?): the "
            "settings they were made with cannot be proven, so they are not resumed; "
            f"{_afresh(directory)}") from None
    try:
        manifest = loads(text)
    except ValueError as error:
        manifest, problem = None, f"not valid JSON of finite numbers: {error}"
    else:
        problem = None if isinstance(manifest, dict) else "not a JSON object"
    if problem is None and not (isinstance(manifest.get("kinds"), list)
                                and all(isinstance(k, str) for k in manifest["kinds"])):
        problem = "no list of kinds"
    if problem is not None:
        raise DamagedFileError(
            f"{path} is damaged ({problem}), so the settings of the rows beside it cannot be "
            f"checked: restore it from a copy, or {_afresh(directory)}")
    return manifest


def has_rows(directory: Path) -> list[str]:
    """Names in ``directory`` that hold rows: a non-empty screen or results file, or shard
    directories of a sharded run."""
    directory = Path(directory)
    found = [name for name in (SCREEN, RESULTS, GRAPHS, FAITHFULNESS)
             if (directory / name).exists() and (directory / name).stat().st_size > 0]
    shards = sorted(p.name for p in directory.glob("shard-*-of-*") if p.is_dir())
    return found + shards


def check_run_directory(directory: Path) -> dict | None:
    """Refuse, before a model is loaded, a directory whose rows no run may resume: rows with
    no manifest, or a damaged manifest. A directory that does not exist, or holds no rows and
    no manifest, is a fresh start (None); else its manifest."""
    directory = Path(directory)
    if directory.is_dir() and ((directory / MANIFEST).exists() or has_rows(directory)):
        return read_manifest(directory)  # refuses rows without a manifest, or a damaged one
    return None


def _differences(previous: dict, manifest: dict, skip: Sequence[str] = ("about",)) -> str:
    differs = sorted(k for k in set(previous) | set(manifest)
                     if k not in skip and previous.get(k) != manifest.get(k))
    return "; ".join(
        f"{_MEANING[k]} differ(s) ({k} {previous.get(k)!r} -> {manifest.get(k)!r})"
        if k in _MEANING else f"{k}: {previous.get(k)!r} -> {manifest.get(k)!r}"
        for k in differs)


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd`` completely (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class RunDirectory:
    """One run's output directory (see module docstring); holds its lock until :meth:`close`
    (or the end of a ``with`` block)."""

    def __init__(self, path: str | Path, manifest: dict) -> None:
        self.path = Path(path)
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(single_writer(self.path))
        try:
            self._open(manifest)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the directory's lock."""
        self._lock.close()

    def _open(self, manifest: dict) -> None:
        previous = check_run_directory(self.path)
        if previous is not None:
            detail = _differences(previous, manifest)
            if detail:
                raise ManifestMismatchError(
                    f"{self.path} holds a run with other settings or inputs ({detail}); resume "
                    "with the same ones or choose another output directory")
        else:
            write_text(json.dumps(manifest, indent=2, sort_keys=True), self.path / MANIFEST)
        self.manifest = manifest
        for name in (SCREEN, RESULTS, GRAPHS, FAITHFULNESS):
            _drop_partial_line(self.path / name)

    def append(self, name: str, rows: list[dict]) -> None:
        """Append ``rows`` in one synced write; if it fails (disk full, Ctrl-C) the file is cut
        back to where it was, so it never ends in part of a batch."""
        if not rows:
            return
        data = "".join(json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n"
                       for row in rows).encode()  # never write what read_jsonl refuses
        fd = os.open(self.path / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.fstat(fd).st_size
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except BaseException as error:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                if isinstance(error, OSError) and error.errno and error.filename is None:
                    raise OSError(error.errno, error.strerror, str(self.path / name)) from error
                raise
        finally:
            os.close(fd)

    def rows(self, name: str = RESULTS) -> Iterator[dict]:
        return read_jsonl(self.path / name)

    def done(self) -> set[tuple[str, str, int]]:
        """``(fact, kind, seed)`` keys already written."""
        return {(row["fact"], row["kind"], row["seed"]) for row in self.rows(RESULTS)}

    def faithfulness_done(self) -> set[tuple[str, str]]:
        """``(fact, kind)`` whose faithfulness row is already written."""
        return {(row["fact"], row["kind"]) for row in self.rows(FAITHFULNESS)}

    def graphs_done(self) -> set[str]:
        """Facts whose graph row is already written."""
        return {row["fact"] for row in self.rows(GRAPHS)}
