"""Settings shared by the commands: the default fact, and small argument helpers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypeVar

from ..errors import InputError

T = TypeVar("T")

EIFFEL = {
    "prompt": "The Eiffel Tower is in the city of",
    "subject": "The Eiffel Tower",
    "answer": " Paris",
}


def fact_default(key: str, prompt: str | None, given: str | None) -> str | None:
    """``given``, or else the default fact's ``key`` when ``prompt`` is the default prompt."""
    return EIFFEL[key] if given is None and prompt == EIFFEL["prompt"] else given


def number_or_name(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def settings_of(cls: type[T], values: dict[str, object], flags: dict[str, str]) -> T:
    """``cls(**values)``, a settings object built from flags (``flags``: argparse dest ->
    field); a refusal that opens with a field's name is prefixed with that field's flag."""
    try:
        return cls(**values)
    except InputError as error:
        by_field = {field: "--" + dest.replace("_", "-") for dest, field in flags.items()}
        first = re.match(r"\w+", str(error))
        flag = by_field.get(first.group(0)) if first else None
        if flag is None:
            raise
        raise InputError(f"{flag}: {error}") from None


def out_dir(path: Path | None) -> Path | None:
    """``--out``, refused early when it names a file."""
    if path is not None and path.exists() and not path.is_dir():
        raise InputError(f"--out {path} is a file; give a directory")
    return path
