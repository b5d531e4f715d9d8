"""Where a dataset run's rows go as they are produced, so that nothing is lost on interruption.

An output directory holds:

- ``manifest.json``: the run's settings. A rerun into the same directory resumes only when its
  settings are the same; otherwise it stops and says which setting differs.
- ``screen.jsonl``: one line per record: kept (the model knows it) or skipped, and why.
- ``results.jsonl``: one line per (fact, kind, seed) with the restored P(answer) grid.

Lines are appended with one ``write`` per batch, flushed and synced; a line cut short by a
kill is dropped when the file is next opened. Reading streams line by line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

MANIFEST, SCREEN, RESULTS = "manifest.json", "screen.jsonl", "results.jsonl"


class ManifestMismatchError(ValueError):
    """An output directory holds a run with other settings."""


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
    """One run's output directory (see module docstring)."""

    def __init__(self, path: str | Path, manifest: dict) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        stored = self.path / MANIFEST
        if stored.exists():
            previous = json.loads(stored.read_text())
            differs = sorted(k for k in set(previous) | set(manifest)
                             if previous.get(k) != manifest.get(k))
            if differs:
                detail = "; ".join(f"{k}: {previous.get(k)!r} -> {manifest.get(k)!r}"
                                   for k in differs)
                raise ManifestMismatchError(
                    f"{self.path} holds a run with other settings ({detail}); resume with the "
                    "same settings or choose another output directory")
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
