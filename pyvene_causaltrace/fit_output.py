"""The directory a fit writes: only its own, one fit at a time, replaced whole or not at all.

    with fit_output(path) as out:          # refuses a folder fit did not write; locks it
        old = out.record()                 # the fit there (None when there is none)
        out.commit(write, record)          # write(tmp) fills a fresh directory; swapped in

``path`` is written only when absent or holding ``fit.json`` (a user's folder, even empty, is
refused: nothing else is ever deleted). ``.<name>.fit.lock`` beside it (beside: a refit renames
the directory away) makes a second fit raise :class:`~.errors.OutputLockedError`. The new
transcoder is written to ``<name>.partial-XXXXXXXX`` (:data:`MARK` first, ``fit.json`` last),
the old renamed to ``<name>.old-XXXXXXXX``, the new renamed in, the old removed; after a kill at
any step :meth:`recover` puts the complete one in place and removes only marked leftovers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import DamagedFileError, InputError
from .runlock import exclusive

RECORD = "fit.json"
MARK = ".pvct-fit"  # "this directory was made by fit": written first into every partial


def read_record(path: Path) -> dict:
    """``path``'s ``fit.json`` as a dict, or :class:`DamagedFileError` naming it and why."""
    record_path = path / RECORD
    fix = f"remove {path} or pass --refit (refit=True) to fit it again"
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{record_path} is not JSON ({error}): a damaged fit record; "
                               f"{fix}") from None
    if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
        what = type(record).__name__ if not isinstance(record, dict) else "no settings"
        raise DamagedFileError(f"{record_path} is not a fit record (a JSON object with "
                               f"settings; it holds {what}): {fix}")
    return record


def _complete(path: Path) -> bool:
    try:
        read_record(path)
    except (DamagedFileError, OSError):
        return False
    return True


def check_owned(path: Path) -> None:
    """Refuse ``path`` unless it is absent or holds ``fit.json`` (never suggesting refit: a
    refit would replace the folder)."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise InputError(f"{path} is a file, not a transcoder directory: choose another out")
    if (path / RECORD).is_file():
        return
    what = "is an empty directory" if not any(path.iterdir()) else "holds other files"
    raise InputError(
        f"{path} {what} and no {RECORD}: not a transcoder fit wrote, so fit will not write "
        "there (nor replace it); choose another out (a new directory)")


def remove_owned(path: Path) -> None:
    """Delete a directory fit made: everything but its marks first, then ``fit.json``, then
    :data:`MARK`, so one cut short is still recognised as fit's (and removed) next time."""
    marked = (path / MARK).is_file() or (path / RECORD).is_file()
    if not path.is_dir() or (any(path.iterdir()) and not marked):
        return
    for entry in path.iterdir():
        if entry.name not in (RECORD, MARK):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for name in (RECORD, MARK):
        (path / name).unlink(missing_ok=True)
    path.rmdir()


class FitOutput:
    """One fit's hold on ``path`` (made by :func:`fit_output`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._leftover = re.compile(re.escape(path.name) + r"\.(partial|old)-[A-Za-z0-9_]{8}")

    def _leftovers(self, kind: str) -> list[Path]:
        found = [p for p in self.path.parent.iterdir() if (m := self._leftover.fullmatch(p.name))
                 and m.group(1) == kind and p.is_dir()]
        return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)

    def recover(self) -> None:
        """Finish a swap a kill cut short: with nothing at ``path``, put the newest complete
        partial (else the newest complete old one) there; then remove fit's leftovers."""
        if not self.path.parent.is_dir():
            return
        if not self.path.exists():
            done = [p for kind in ("partial", "old") for p in self._leftovers(kind)
                    if _complete(p)]
            if done:
                done[0].rename(self.path)
        for kind in ("partial", "old"):
            for leftover in self._leftovers(kind):
                remove_owned(leftover)

    def record(self) -> dict | None:
        """The fit at ``path`` (:func:`read_record`), or None when there is none."""
        return read_record(self.path) if self.path.exists() else None

    def refuse_other_settings(self, record: dict, asked: dict, what: str) -> None:
        """Refuse reusing ``record`` (the fit at ``path``) for ``asked`` settings that differ,
        naming each setting; ``what``: the fit it holds, for the message."""
        recorded = record["settings"]
        differ = [f"{k} {recorded.get(k)!r} (asked {v!r})" for k, v in asked.items()
                  if recorded.get(k) != v]
        if differ:
            raise InputError(f"{self.path} holds {what} with other settings: "
                             f"{'; '.join(differ)}. Pass refit=True (--refit) to replace it, "
                             "or another out")

    def commit(self, write: Callable[[Path], None], record: dict) -> None:
        """``write(tmp)`` the transcoder into a fresh directory, add ``record`` as ``fit.json``,
        and swap it in for whatever fit wrote at ``path`` (module docstring)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=self.path.name + ".partial-", dir=self.path.parent))
        try:
            (tmp / MARK).write_text("written by pyvene-causaltrace fit\n", encoding="utf-8")
            write(tmp)
            staged = tmp / (RECORD + ".tmp")
            staged.write_text(json.dumps(record, indent=2, allow_nan=False), encoding="utf-8")
            staged.rename(tmp / RECORD)  # last: a partial with fit.json is complete
            old = None
            if self.path.exists():
                check_owned(self.path)  # still fit's own (the lock keeps other fits out)
                old = self.path.with_name(f"{self.path.name}.old-{tmp.name[-8:]}")
                self.path.rename(old)
            try:
                tmp.rename(self.path)  # the new one in place before the old one goes
            except OSError:
                if old is not None:
                    old.rename(self.path)
                raise
            if old is not None:
                remove_owned(old)
        finally:
            if tmp.exists():
                remove_owned(tmp)


@contextlib.contextmanager
def fit_output(path: Path) -> Iterator[FitOutput]:
    """Hold ``path`` for one fit: refuse it unless it is fit's own, lock it, finish a swap an
    earlier fit left half done."""
    path = Path(os.path.abspath(path.expanduser()))
    check_owned(path)
    with exclusive(path.parent / f".{path.name}.fit.lock", path):
        out = FitOutput(path)
        out.recover()
        check_owned(path)
        yield out
