"""Settings shared by the commands: the default fact, and small argument helpers."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError

EIFFEL = {
    "prompt": "The Eiffel Tower is in the city of",
    "subject": "The Eiffel Tower",
    "answer": " Paris",
}


def number_or_name(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def out_dir(path: Path | None) -> Path | None:
    """``--out``, refused early when it names a file."""
    if path is not None and path.exists() and not path.is_dir():
        raise InputError(f"--out {path} is a file; give a directory")
    return path
