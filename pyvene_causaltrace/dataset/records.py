"""Fact records: ROME's ``known_1000.json`` or JSONL of ``{prompt, subject, attribute}``.

``subject`` is the span to corrupt (``occurrence`` when it appears more than once); the scored
token is the first of ``" " + attribute`` unless it starts with whitespace, as in ROME.
Malformed records do not stop a run: :func:`read_records` returns them as
:class:`RecordError` values naming the record.

    records, errors = read_records("known_1000.json")   # or "known_1000": fetched once"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..arguments import checked
from ..errors import InputError
from .sources import DATASETS, dataset_path


@dataclass(frozen=True)
class FactRecord:
    """One prompt to trace. ``id`` is unique within a dataset (``known_id`` or the index)."""

    id: str
    prompt: str
    subject: str
    attribute: str
    occurrence: int = 0

    @property
    def target(self) -> str:
        """The string whose first token is scored."""
        return self.attribute if self.attribute[:1].isspace() else " " + self.attribute

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RecordError:
    """A record that cannot be traced, and why (``where``: file and line or index)."""

    where: str
    id: str | None
    reason: str

    def __str__(self) -> str:
        name = f" (id {self.id})" if self.id is not None else ""
        return f"{self.where}{name}: {self.reason}"


def parse_record(raw: object, index: int, where: str) -> FactRecord | RecordError:
    """One raw JSON object -> a record, or the error that names it."""
    if not isinstance(raw, dict):
        return RecordError(where, None, f"expected an object, got {type(raw).__name__}")
    rid = raw.get("known_id")  # a null one is absent: the id, else the index
    rid = str(next(v for v in (rid, raw.get("id"), index) if v is not None))
    for key in ("prompt", "subject", "attribute"):
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            return RecordError(where, rid, f"field {key!r} must be a non-empty string, "
                                           f"got {value!r}")
    occurrence = raw.get("occurrence", 0)
    if not isinstance(occurrence, int) or isinstance(occurrence, bool) or occurrence < 0:
        return RecordError(where, rid, f"field 'occurrence' must be a non-negative integer, "
                                       f"got {occurrence!r}")
    if raw["prompt"].count(raw["subject"]) <= occurrence:
        return RecordError(where, rid, f"subject {raw['subject']!r} does not occur "
                                       f"{occurrence + 1} time(s) in prompt {raw['prompt']!r}")
    return FactRecord(rid, raw["prompt"], raw["subject"], raw["attribute"], occurrence)


@checked
def read_records(path: str | Path) -> tuple[list[FactRecord], list[RecordError]]:
    """Records from a JSON list (ROME's format) or a JSONL file (one object per line), or from a
    named dataset (``"known_1000"``: fetched once into the cache, :mod:`.sources`)."""
    if isinstance(path, str) and path in DATASETS and not Path(path).exists():
        path = dataset_path(path, progress=True)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dataset at {path} (named datasets: {', '.join(DATASETS)})")
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError(f"{path}: not valid JSON: {error}") from None
        return _collect((raw, i, f"{path}[{i}]") for i, raw in enumerate(items))
    return _collect((_json_or_error(line, f"{path}:{n}"), n - 1, f"{path}:{n}")
                    for n, line in enumerate(text.splitlines(), start=1) if line.strip())


def _json_or_error(line: str, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        return RecordError(where, None, f"not valid JSON: {error}")


def _collect(items: Iterable[tuple[object, int, str]]):
    records: list[FactRecord] = []
    errors: list[RecordError] = []
    seen: set[str] = set()
    for raw, index, where in items:
        made = raw if isinstance(raw, RecordError) else parse_record(raw, index, where)
        if isinstance(made, FactRecord) and made.id in seen:
            made = RecordError(where, made.id, "duplicate id")
        if isinstance(made, RecordError):
            errors.append(made)
        else:
            seen.add(made.id)
            records.append(made)
    return records, errors
