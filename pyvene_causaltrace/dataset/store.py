"""Where a dataset run's rows go as they are produced, so that nothing is lost on interruption.

An output directory holds:

- ``manifest.json``: the run's settings and identity — fingerprints of the model's weights, the
  tokenizer and the data, the package version (:mod:`~pyvene_causaltrace.fingerprint`) — plus
  informational fields (``about``: the model's name as given). A rerun into the same directory
  resumes only when settings and identity are the same; otherwise it stops and says what
  differs. The same model under another spelling of its path is the same model.
- ``.pvct.lock``: held while a run writes (:mod:`~pyvene_causaltrace.runlock`): a second run on
  the same directory is refused.
- ``screen.jsonl``: one line per record: kept (the model knows it) or skipped, and why.
- ``results.jsonl``: one line per (fact, kind, seed) with the restored P(answer) grid.

Lines are appended with one ``write`` per batch, flushed and synced; a line cut short by a
kill is dropped when the file is next opened. Reading streams line by line.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import ManifestMismatchError

MANIFEST, SCREEN, RESULTS = "manifest.json", "screen.jsonl", "results.jsonl"


#: What a differing manifest key means, for the message.
_MEANING = {"model": "the model's weights", "tokenizer": "the tokenizer",
            "records": "the data", "version": "the pyvene-causaltrace version"}


def _drop_partial_line(path: Path) -> None:
    """Cut a trailing line that a kill left without its newline."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        data = handle.read()
        if data.endswith(b"\n"):
            return
        handle.truncate(data.rfind(b"\n") + 1)


def read_jsonl(path: Path) -> Iterator[dict]:
    """Complete lines of ``path`` (none when it does not exist), one at a time."""
    if not path.exists():
        return
    with open(path) as handle:
        for line in handle:
            if line.endswith("\n"):
                yield json.loads(line)


class RunDirectory:
    """One run's output directory (see module docstring); holds its lock until :meth:`close`
    (or the end of a ``with`` block)."""

    def __init__(self, path: str | Path, manifest: dict) -> None:
        from ..runlock import single_writer

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
        stored = self.path / MANIFEST
        if stored.exists():
            previous = json.loads(stored.read_text())
            differs = sorted(k for k in set(previous) | set(manifest)
                             if k != "about" and previous.get(k) != manifest.get(k))
            if differs:
                detail = "; ".join(
                    f"{_MEANING[k]} differ(s) ({k} {previous.get(k)!r} -> {manifest.get(k)!r})"
                    if k in _MEANING else f"{k}: {previous.get(k)!r} -> {manifest.get(k)!r}"
                    for k in differs)
                raise ManifestMismatchError(
                    f"{self.path} holds a run with other settings or inputs ({detail}); resume "
                    "with the same ones or choose another output directory")
        else:
            tmp = stored.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
            os.replace(tmp, stored)
        self.manifest = manifest
        for name in (SCREEN, RESULTS):
            _drop_partial_line(self.path / name)

    def append(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        text = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
        with open(self.path / name, "a") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    def rows(self, name: str = RESULTS) -> Iterator[dict]:
        return read_jsonl(self.path / name)

    def done(self) -> set[tuple[str, str, int]]:
        """``(fact, kind, seed)`` keys already written."""
        return {(row["fact"], row["kind"], row["seed"]) for row in self.rows(RESULTS)}
